//! The crate's error type: every message names the file, field or tensor that is wrong.

use std::path::PathBuf;

use tch::Kind;

/// One problem found while matching a checkpoint's tensors to the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WeightProblem {
    Missing { name: String },
    Unexpected { name: String },
    Shape { name: String, expected: Vec<i64>, found: Vec<i64> },
    Dtype { name: String, dtype: String },
}

impl std::fmt::Display for WeightProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Missing { name } => write!(f, "missing tensor `{name}`"),
            Self::Unexpected { name } => write!(f, "unexpected tensor `{name}`"),
            Self::Shape { name, expected, found } => {
                write!(f, "tensor `{name}` has shape {found:?}, expected {expected:?}")
            }
            Self::Dtype { name, dtype } => {
                write!(f, "tensor `{name}` has unsupported dtype {dtype} (need F32, BF16 or F16)")
            }
        }
    }
}

fn list_problems(problems: &[WeightProblem]) -> String {
    const SHOWN: usize = 8;
    let mut text = problems.iter().take(SHOWN).map(ToString::to_string).collect::<Vec<_>>().join("; ");
    if problems.len() > SHOWN {
        text.push_str(&format!("; and {} more", problems.len() - SHOWN));
    }
    text
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("model directory {} does not exist or is not a directory", .0.display())]
    MissingDirectory(PathBuf),
    #[error("{}: invalid JSON: {source}", path.display())]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("config.json: unknown architecture `{name}` (supported: {supported})")]
    UnknownArchitecture { name: String, supported: String },
    #[error("config.json: `{field}` = {value} is not supported: {reason}")]
    Unsupported { field: String, value: String, reason: String },
    #[error("config.json: `{field}` {reason}")]
    InvalidConfig { field: String, reason: String },
    #[error("{}: corrupt safetensors file: {reason}", path.display())]
    Safetensors { path: PathBuf, reason: String },
    #[error("no weights in {}: expected model.safetensors or model.safetensors.index.json", .0.display())]
    NoWeights(PathBuf),
    #[error("weights do not match the model: {}", list_problems(.0))]
    Weights(Vec<WeightProblem>),
    #[error("token id {id} at row {row}, position {position} is out of range for vocabulary size {vocab_size}")]
    TokenOutOfRange { id: i64, row: usize, position: usize, vocab_size: i64 },
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("device: {0}")]
    Device(String),
    /// A tensor-parallel collective failed (a rank left, timed out, or the backend failed).
    #[error("tensor parallel: {0}")]
    Collective(keel_collective::Error),
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
    /// A CUDA kernel could not run.
    #[error("{0}")]
    Kernel(Box<KernelError>),
    /// What another rank of a group of processes reported (see [`keel_collective::process`]).
    #[error("rank {rank}: {message}")]
    Rank { rank: usize, message: String },
    /// The group of processes this rank belongs to broke (a rank left): nothing runs on it
    /// any more.
    #[error("the group of ranks broke: {0}")]
    GroupLost(String),
}

impl From<KernelError> for Error {
    fn from(e: KernelError) -> Self {
        Error::Kernel(Box::new(e))
    }
}

/// What the CUDA kernels (`crate::cuda`) can fail with.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("CUDA kernels: {0}")]
    Unavailable(String),
    #[error("CUDA kernels do not compile: {0}")]
    Compile(String),
    #[error("CUDA driver: {0}")]
    Driver(String),
    #[error("kernel launch: {0}")]
    Shape(String),
    #[error("kernel {kernel} on {kind:?} differs from the tch path by {worst:e} (tolerance {tolerance:e})")]
    Mismatch { kernel: &'static str, kind: Kind, worst: f64, tolerance: f64 },
    #[error(transparent)]
    Torch(#[from] tch::TchError),
    /// The tch path a kernel is checked against failed.
    #[error("the tch reference: {0}")]
    Reference(Box<Error>),
}

impl From<Error> for KernelError {
    fn from(e: Error) -> Self {
        KernelError::Reference(Box::new(e))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The tokenizer crate's errors keep their messages.
impl From<keel_tokenizer::Error> for Error {
    fn from(e: keel_tokenizer::Error) -> Self {
        match e {
            keel_tokenizer::Error::Io { path, source } => Self::Io { path, source },
            keel_tokenizer::Error::Json { path, source } => Self::Json { path, source },
            keel_tokenizer::Error::Tokenizer(message) => Self::Tokenizer(message),
            keel_tokenizer::Error::ChatTemplate(message) => Self::ChatTemplate(message),
        }
    }
}

impl From<keel_collective::Error> for Error {
    fn from(e: keel_collective::Error) -> Self {
        Self::Collective(e)
    }
}

/// A rank of a group of processes (a generator's tensor-parallel ranks) reports its errors to
/// the leader by message.
impl keel_collective::process::RankError for Error {
    fn code(&self) -> &str {
        "failed"
    }

    fn is_consequence(&self) -> bool {
        matches!(self, Self::Collective(c) if keel_collective::is_consequence(c))
    }

    fn reported(rank: usize, _code: &str, message: String) -> Self {
        Self::Rank { rank, message }
    }
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }

    pub(crate) fn json(path: impl Into<PathBuf>) -> impl FnOnce(serde_json::Error) -> Self {
        let path = path.into();
        move |source| Self::Json { path, source }
    }

    pub(crate) fn unsupported(field: &str, value: impl std::fmt::Display, reason: &str) -> Self {
        Self::Unsupported { field: field.into(), value: value.to_string(), reason: reason.into() }
    }

    pub(crate) fn invalid(field: &str, reason: impl Into<String>) -> Self {
        Self::InvalidConfig { field: field.into(), reason: reason.into() }
    }
}
