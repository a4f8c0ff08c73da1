//! The trainer's error type. Each variant maps to one stable `type` code of the reply
//! envelope ([`keel_protocol::trainer::error_types`]).

use keel_protocol::trainer::error_types;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    InvalidRequest(String),
    #[error("invalid training configuration: {0}")]
    InvalidConfig(String),
    #[error("cannot load {what}: {reason}")]
    Load { what: String, reason: String },
    #[error("no model is loaded: send `load` first")]
    NotLoaded,
    #[error("{0}")]
    NonFinite(String),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error("{0}")]
    Payload(String),
    #[error(transparent)]
    Model(#[from] keel_model::Error),
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
    /// A tensor-parallel collective failed (a rank left, timed out, or the backend failed).
    #[error("tensor parallel: {0}")]
    Collective(keel_collective::Error),
    /// A rank of a trainer group whose ranks are processes of their own failed the call (the
    /// error it reported, with its reply type).
    #[error("rank {rank} of the trainer group: {message}")]
    Rank { rank: usize, kind: &'static str, message: String },
    /// The group of trainer processes is not whole: a rank left, or has not joined yet.
    #[error("trainer group: {0}")]
    Group(String),
    #[error("{0}")]
    Internal(String),
}

impl From<keel_collective::Error> for Error {
    fn from(e: keel_collective::Error) -> Self {
        Self::Collective(e)
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The reply's `type` code.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidRequest(_) => error_types::INVALID_REQUEST,
            Self::InvalidConfig(_) => error_types::INVALID_CONFIG,
            Self::Load { .. } => error_types::LOAD_FAILED,
            Self::NotLoaded => error_types::NOT_LOADED,
            Self::NonFinite(_) => error_types::NON_FINITE,
            Self::Checkpoint(_) => error_types::SAVE_FAILED,
            Self::Payload(_) => error_types::PAYLOAD,
            Self::Model(keel_model::Error::InvalidInput(_) | keel_model::Error::TokenOutOfRange { .. }) => {
                error_types::INVALID_REQUEST
            }
            Self::Rank { kind, .. } => kind,
            Self::Model(_) | Self::Torch(_) | Self::Collective(_) | Self::Group(_) | Self::Internal(_) => {
                error_types::INTERNAL
            }
        }
    }

    /// Whether this error only follows another rank's failure (a collective that timed out
    /// or was aborted because a peer gave up): the error that started it says more.
    pub fn is_consequence(&self) -> bool {
        match self {
            Self::Collective(c) | Self::Model(keel_model::Error::Collective(c)) => keel_collective::is_consequence(c),
            _ => false,
        }
    }
}

/// The reply type named `code` (`internal` for one this version does not know).
fn reply_type(code: &str) -> &'static str {
    use error_types::*;
    [INVALID_REQUEST, INVALID_CONFIG, LOAD_FAILED, NOT_LOADED, PAYLOAD, SAVE_FAILED, NON_FINITE]
        .into_iter()
        .find(|k| *k == code)
        .unwrap_or(INTERNAL)
}

/// A rank of a trainer group of processes reports its errors by reply type.
impl keel_collective::process::RankError for Error {
    fn code(&self) -> &str {
        self.kind()
    }

    fn is_consequence(&self) -> bool {
        Error::is_consequence(self)
    }

    fn reported(rank: usize, code: &str, message: String) -> Self {
        Self::Rank { rank, kind: reply_type(code), message }
    }
}
