//! The checkpoint service's REST bodies and its events (`<prefix>.checkpoint.created`,
//! `<prefix>.checkpoint.deleted`, on JetStream so a generator that was down still sees
//! every refit).
//!
//! A checkpoint is created with the list of its files (path, sha256, size); files whose
//! content the store already holds need no upload. Each missing file is then uploaded and
//! verified against its sha256; the checkpoint becomes visible only when committed with every
//! file present.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// One file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// Relative path in the checkpoint (`model.safetensors`, `optimizer/state.pt`).
    pub path: String,
    /// Lower-case hex sha256 of the content.
    pub sha256: String,
    pub size: u64,
}

/// Keep the `keep_top_k` best checkpoints of a run by `metric` (ties go to the newer) and
/// always the latest; the rest are deleted when no one is reading them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Retention {
    pub keep_top_k: usize,
    pub metric: String,
    #[serde(default = "yes")]
    pub higher_is_better: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateCheckpoint {
    pub run_id: String,
    pub step: u64,
    #[serde(default)]
    pub metrics: BTreeMap<String, f64>,
    /// Free-form training info (consumed samples, dataloader position, the run config).
    #[serde(default)]
    #[schema(value_type = Object)]
    pub info: serde_json::Value,
    pub files: Vec<FileEntry>,
    /// The run's retention policy from now on (kept until changed).
    #[serde(default)]
    pub retention: Option<Retention>,
}

/// A checkpoint as the service shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Checkpoint {
    pub id: uuid::Uuid,
    pub run_id: String,
    pub step: u64,
    /// `pending` (files still arriving) or `complete`.
    pub status: String,
    pub metrics: BTreeMap<String, f64>,
    #[schema(value_type = Object)]
    pub info: serde_json::Value,
    pub files: Vec<FileEntry>,
    /// Paths still to upload (pending checkpoints).
    pub missing: Vec<String>,
    /// Seconds since the Unix epoch.
    pub created_at: f64,
}

/// A promise to read a checkpoint: it is not deleted while a lease holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LeaseRequest {
    /// Who reads (a run id, a generator).
    pub holder: String,
    pub seconds: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Lease {
    pub id: uuid::Uuid,
    pub checkpoint_id: uuid::Uuid,
    pub holder: String,
    /// Seconds since the Unix epoch.
    pub expires_at: f64,
}

/// `<prefix>.checkpoint.created` and `<prefix>.checkpoint.deleted`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointEvent {
    pub id: uuid::Uuid,
    pub run_id: String,
    pub step: u64,
    pub metrics: BTreeMap<String, f64>,
}
