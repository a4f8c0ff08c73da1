//! Every type that crosses a process boundary in Keel, and the NATS subject names. No I/O:
//! services serialise these with serde_json and send them over NATS or HTTP.
//!
//! Layout:
//! - [`subjects`]: typed builders for every NATS subject (`keel.v1.trainer.<worker>.train`, ...).
//! - [`limits`]: the largest values a run spec and a training configuration may hold.
//! - [`payload`]: [`Payload`], a message body carried inline or, above 1 MiB, by reference to
//!   the JetStream object store.
//! - [`reply`]: the `{"ok": ...}` / `{"error": {"type", "message"}}` reply envelope.
//! - [`training`]: the training configuration (loss, optimiser, schedule, batching) with
//!   validation that lists every problem with its field path.
//! - [`agent`]: agent environments: the sessions a run opens on its generators for one
//!   sample each, what the agent receives, and what the generator recorded under its key.
//! - [`checkpoint`]: the checkpoint service's bodies and events.
//! - [`generator`]: a generator's claim by a run and its load of the run's model, rollout
//!   requests, and the weights-updated event.
//! - [`lease`]: claims of a worker (a trainer or a generator) by a run: claim, heartbeat,
//!   release.
//! - [`reward`]: environment steps and scoring (environment configs, samples, results) and
//!   the contract of a user's HTTP reward service.
//! - [`run`]: the run spec users submit to the orchestrator (validated with every problem's
//!   field path) and the orchestrator's REST bodies (runs, metrics, samples, events).
//! - [`trainer`]: the trainer worker's requests and replies (claim, load, logprobs, train,
//!   score, save, heartbeat, release).

pub mod agent;
pub mod checkpoint;
pub mod generator;
pub mod lease;
pub mod limits;
pub mod payload;
pub mod reply;
pub mod reward;
pub mod run;
pub mod runs_api;
pub mod subjects;
pub mod trainer;
pub mod training;

pub use payload::{MAX_INLINE_BYTES, ObjectRef, Payload};
pub use reply::{ErrorBody, Reply};
pub use subjects::Subjects;

/// One problem in a configuration: the dotted field path and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self { field: field.into(), message: message.into() }
    }
}

impl std::error::Error for FieldError {}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// Joins problems into one line: `a.b: must be positive; c: ...`.
pub fn join_problems(problems: &[FieldError]) -> String {
    problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}
