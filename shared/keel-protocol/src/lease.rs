//! Claims of a worker by a run, for both kinds of claimed worker: trainer workers and
//! generators. A run claims a free worker through its kind's queue group (or a named one on
//! the worker's own claim subject), renews the claim with heartbeats and releases it when it
//! ends; a worker whose lease runs out with nothing in flight (its run's orchestrator
//! disappeared) drops the run's models and is free again.

use serde::{Deserialize, Serialize};

/// Stable error codes of claims and of requests to a claimed worker.
pub mod error_types {
    /// Another run holds the worker.
    pub const BUSY: &str = "busy";
    /// The request names a run that does not hold the worker (or nobody holds it).
    pub const WRONG_RUN: &str = "wrong_run";
    /// The request names a holder of the run that a newer claim replaced (see
    /// [`ClaimRequest::holder`](super::ClaimRequest::holder)).
    pub const STALE_HOLDER: &str = "stale_holder";
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimRequest {
    pub run_id: String,
    /// The claim is released when no request or heartbeat arrives for this long.
    #[serde(default = "default_lease_seconds")]
    pub lease_seconds: f64,
    /// Who in the run holds the claim (the orchestrator's claim of the run). A claim by the
    /// same run with another holder takes the worker over: from then on, requests that name
    /// the earlier holder in [`HOLDER_HEADER`] are refused as `stale_holder`, so a driver
    /// whose lease lapsed cannot train, load or release behind the one that replaced it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
}

/// The NATS header naming the holder a request to a claimed worker is made for (see
/// [`ClaimRequest::holder`]).
pub const HOLDER_HEADER: &str = "Keel-Holder";

fn default_lease_seconds() -> f64 {
    60.0
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClaimReply {
    /// The worker's id: its subjects are `<prefix>.<kind>.<worker_id>.<op>`.
    pub worker_id: String,
    pub lease_seconds: f64,
}

/// Renew the run's lease on the worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeartbeatRequest {
    pub run_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeartbeatReply {
    pub lease_seconds: f64,
    /// Whether the run's models are loaded on the worker.
    pub loaded: bool,
}

/// Give the worker back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    pub run_id: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Released {
    pub worker_id: String,
}
