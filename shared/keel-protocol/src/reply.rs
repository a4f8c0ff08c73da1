//! The reply envelope of every NATS request: `{"ok": value}` or
//! `{"error": {"type": "...", "message": "..."}}`, where `type` is a stable snake_case code.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
}

impl std::fmt::Display for ErrorBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply<T> {
    Ok(T),
    Error(ErrorBody),
}

impl<T> Reply<T> {
    pub fn error(kind: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Error(ErrorBody { kind: kind.into(), message: message.into() })
    }
}
