//! What the service skeleton can fail with. Each message says what failed and where, for a
//! service's start-up log or a request's refusal; no variant carries a secret (NATS URLs are
//! shown with their password replaced).

use std::path::PathBuf;

/// A service's start-up or a part of it failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot connect to NATS at {url}: {reason}")]
    NatsConnect { url: String, reason: String },
    #[error("cannot subscribe to {subject}: {reason}")]
    Subscribe { subject: String, reason: String },
    #[error(transparent)]
    Bulk(#[from] BulkError),
    #[error(transparent)]
    Path(#[from] PathError),
    #[error(transparent)]
    Postgres(#[from] PostgresError),
    #[error(transparent)]
    Subjects(#[from] keel_protocol::subjects::InvalidPrefix),
    #[error("HTTP server: {0}")]
    Http(#[from] std::io::Error),
    /// A concurrent part of the service ended with an error.
    #[error("{part}: {reason}")]
    Part { part: &'static str, reason: String },
    /// A concurrent part of the service ended by itself, without an error.
    #[error("{0} stopped")]
    PartStopped(&'static str),
    /// A service's own start-up step failed (`cannot {what}: {reason}`).
    #[error("cannot {what}: {reason}")]
    Start { what: &'static str, reason: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A service's own start-up step `what` ("load the model") failed with `reason`.
    pub fn start(what: &'static str, reason: impl std::fmt::Display) -> Self {
        Self::Start { what, reason: reason.to_string() }
    }
}

/// Moving a body through the JetStream object store failed.
#[derive(Debug, thiserror::Error)]
pub enum BulkError {
    #[error("cannot create the object store bucket `{bucket}`: {reason}")]
    Open { bucket: String, reason: String },
    #[error("cannot encode payload: {0}")]
    Encode(serde_json::Error),
    #[error("cannot store payload `{name}` in bucket `{bucket}`: {reason}")]
    Put { bucket: String, name: String, reason: String },
    #[error("object is in bucket `{found}`, this service uses `{ours}`")]
    ForeignBucket { found: String, ours: String },
    #[error("cannot fetch object `{name}`: {reason}")]
    Get { name: String, reason: String },
    #[error("payload `{name}` is not valid: {source}")]
    Invalid { name: String, source: serde_json::Error },
    #[error("cannot delete object `{name}`: {reason}")]
    Delete { name: String, reason: String },
}

/// A path a request or a setting names is not one this service may use.
#[derive(Debug, thiserror::Error)]
pub enum PathError {
    #[error("{setting}: name at least one directory")]
    NoRoots { setting: String },
    #[error("{setting}: {}: {source}", root.display())]
    BadRoot { setting: String, root: PathBuf, source: std::io::Error },
    #[error("`{path}` must be a path without `..`")]
    Climbs { path: String },
    #[error("`{path}`: {source}")]
    Unresolvable { path: String, source: std::io::Error },
    #[error("`{path}` is outside the directories this service may use ({roots}); add its directory to {setting}")]
    Outside { path: String, roots: String, setting: String },
    /// The error of the request field `field`.
    #[error("{field}: {source}")]
    Field { field: String, source: Box<PathError> },
}

/// Connecting to Postgres or preparing the service's schema failed.
#[derive(Debug, thiserror::Error)]
pub enum PostgresError {
    #[error("schema `{0}`: lowercase letters and `_` only")]
    InvalidSchema(String),
    #[error("database_url: {0}")]
    InvalidUrl(sqlx::Error),
    /// `doing` says what was being done ("cannot reach Postgres at URL").
    #[error("{doing}: {source}")]
    Failed { doing: String, source: sqlx::Error },
    #[error("migrations failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}
