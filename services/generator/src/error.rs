//! What the generator can fail with, at start-up and while it serves NATS. (Requests to the
//! OpenAI API fail with [`crate::openai::ApiError`].)

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Service(#[from] keel_service::Error),
    #[error(transparent)]
    Bulk(#[from] keel_service::BulkError),
    #[error(transparent)]
    Path(#[from] keel_service::PathError),
    #[error(transparent)]
    Model(#[from] keel_model::Error),
    #[error(transparent)]
    Engine(#[from] keel_generation::Error),
    #[error("max_model_len {max_model_len} exceeds the model's context of {context}")]
    ContextTooShort { max_model_len: i64, context: i64 },
    #[error(
        "gpu_memory_utilization {utilization} leaves no room for the KV cache on cuda:{ordinal} ({free_mib} of \
         {total_mib} MiB free before loading, about {weights_mib} MiB of weights and {activations_mib} MiB of \
         activations)"
    )]
    NoRoomForKvCache {
        utilization: f64,
        ordinal: usize,
        free_mib: usize,
        total_mib: usize,
        weights_mib: i64,
        activations_mib: i64,
    },
    #[error("the {0} subscription ended")]
    SubscriptionEnded(&'static str),
    #[error("NATS flush failed: {0}")]
    Flush(String),
    #[error("weight bucket `{name}` has {got} bytes, not {expected}")]
    BucketSize { name: String, got: usize, expected: u64 },
    #[error("fewer weight buckets arrived than the export lists")]
    BucketMissing,
    #[error("receiving the weights from the trainer: {0}")]
    Receive(String),
    #[error("`{0}` is in the weight buckets twice")]
    DuplicateTensor(String),
    /// A task of the service (loading, unpacking, the HTTP server) panicked or was cancelled.
    #[error("{0} failed: {1}")]
    Task(&'static str, tokio::task::JoinError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
