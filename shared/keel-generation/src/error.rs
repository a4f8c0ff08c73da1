//! What the engine's calls can fail with.

/// A request, refit or memory change the engine could not carry out.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The scheduler thread is gone (it failed or the engine was dropped).
    #[error("the scheduler has stopped")]
    Stopped,
    /// The scheduler ended the call without an answer.
    #[error("the scheduler dropped the {0}")]
    Dropped(&'static str),
    #[error("superseded by a newer refit before version {0} was loaded")]
    RefitSuperseded(u64),
    #[error("superseded by a newer sleep or wake")]
    MemorySuperseded,
    /// The model failed: a refit that does not fit, a device error.
    #[error(transparent)]
    Model(#[from] keel_model::Error),
    /// A request failed while it ran; the message is the engine's.
    #[error("{0}")]
    Request(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
