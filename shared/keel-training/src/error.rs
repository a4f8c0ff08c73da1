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
            Self::Model(_) | Self::Torch(_) | Self::Collective(_) | Self::Internal(_) => error_types::INTERNAL,
        }
    }
}
