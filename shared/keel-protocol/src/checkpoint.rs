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
    /// Relative path in the checkpoint (`model.safetensors`, `optimizer/state.pt`): at most 8
    /// parts of letters, digits, `.`, `-` and `_`, none hidden.
    #[schema(
        min_length = 1,
        max_length = 255,
        pattern = "^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}(/[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}){0,7}$"
    )]
    pub path: String,
    /// Lower-case hex sha256 of the content.
    #[schema(pattern = "^[0-9a-f]{64}$")]
    pub sha256: String,
    /// Bytes; at most 1 TiB.
    #[schema(maximum = 1_099_511_627_776_u64)]
    pub size: u64,
}

/// Keep the `keep_top_k` best checkpoints of a run by `metric` (ties go to the newer) and
/// always the latest; the rest are deleted when no one is reading them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Retention {
    #[schema(maximum = 10000)]
    pub keep_top_k: usize,
    #[schema(min_length = 1)]
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
    /// 1 to 200 letters, digits, `-`, `_`, `.` or `:`.
    #[schema(pattern = "^[A-Za-z0-9_.:-]{1,200}$")]
    pub run_id: String,
    pub step: u64,
    #[serde(default)]
    pub metrics: BTreeMap<String, f64>,
    /// Free-form training info (consumed samples, dataloader position, the run config): any
    /// JSON value, kept as sent (absent: `null`).
    #[serde(default)]
    #[schema(value_type = Value)]
    pub info: serde_json::Value,
    /// At least one.
    #[schema(min_items = 1)]
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
    /// The `info` the checkpoint was created with, as sent: any JSON value, `null` when none
    /// was.
    #[schema(value_type = Value)]
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
    /// Who reads (a run id, a generator): 1 to 200 characters, none of them control
    /// characters.
    #[schema(min_length = 1, max_length = 200, pattern = "^[^\\x00-\\x1f\\x7f-\\x9f]+$")]
    pub holder: String,
    /// How long the lease holds: more than 0 seconds and at most a week.
    #[schema(exclusive_minimum = 0, maximum = 604800)]
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

/// Which file names a checkpoint may hold: relative paths of at most 8 parts and 255
/// characters (100 per part, as tar's header holds), each part letters, digits, `.`, `-`, `_` (not starting with `.`), so nothing
/// can climb out of the directory a download writes (`..`, absolute paths, odd characters
/// and hidden files are refused). The service checks them on the way in, the CLI on the way
/// out.
pub fn check_path(path: &str) -> Result<(), InvalidPath> {
    if path.is_empty() || path.len() > 255 {
        return Err(InvalidPath::new(path, "must be 1 to 255 characters"));
    }
    if path.starts_with('/') {
        return Err(InvalidPath::new(path, "must be relative"));
    }
    let parts: Vec<&str> = path.split('/').collect();
    if parts.len() > 8 {
        return Err(InvalidPath::new(path, "is nested more than 8 deep"));
    }
    for part in parts {
        if part.len() > 100 {
            return Err(InvalidPath::new(path, "has a part longer than 100 characters"));
        }
        if part.is_empty() || part.starts_with('.') {
            return Err(InvalidPath::new(path, "has an empty, `.`, `..` or hidden part"));
        }
        if !part.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')) {
            return Err(InvalidPath::new(path, "may hold only letters, digits, `.`, `-`, `_` and `/`"));
        }
    }
    Ok(())
}

/// A file name [`check_path`] refuses, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("file name `{path}` {reason}")]
pub struct InvalidPath {
    pub path: String,
    pub reason: &'static str,
}

impl InvalidPath {
    fn new(path: &str, reason: &'static str) -> Self {
        Self { path: path.to_string(), reason }
    }
}

/// Whether `sha` is a lower-case hex sha256.
pub fn is_sha256(sha: &str) -> bool {
    sha.len() == 64 && sha.chars().all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traversal_and_odd_names_are_refused() {
        for good in ["model.safetensors", "tokenizer.json", "optimizer/state-0.pt", "a/b_c/d.e"] {
            assert!(check_path(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "../etc/passwd",
            "a/../../b",
            "/abs",
            "a//b",
            ".hidden",
            "a/./b",
            "sp ace",
            "semi;colon",
            "ü",
            "a\\b",
            "x\0y",
        ] {
            assert!(check_path(bad).is_err(), "{bad:?}");
        }
        assert!(check_path("a/".repeat(9).trim_end_matches('/')).is_err());
        assert!(is_sha256(&"ab".repeat(32)) && !is_sha256(&"AB".repeat(32)) && !is_sha256("abc"));
    }
}
