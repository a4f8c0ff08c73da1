//! A generation request after validation at the edge (HTTP or NATS): nothing downstream
//! checks it again.

use keel_model::sampling::SamplingParams;

/// What one prompt asks for; `n` samples share its prefill.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub prompt: Vec<i64>,
    pub n: usize,
    pub max_tokens: usize,
    /// Temperature, top-p, top-k, min-p; `seed` is the first sample's, sample i uses seed + i.
    pub sampling: SamplingParams,
    /// Tokens that end a sample (eos ids unless `ignore_eos`, plus the request's stop ids);
    /// the stop token is part of the output ids.
    pub stop_token_ids: Vec<i64>,
    /// Strings that end a sample; the text is cut before the string unless
    /// `include_stop_str_in_output`.
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
    /// How many most-likely alternatives to report per token (0 = none).
    pub top_logprobs: usize,
}

/// Why a sample ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// A stop token or stop string.
    Stop,
    /// max_tokens or the context length.
    Length,
    /// The client went away.
    Abort,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
        }
    }
}

/// One generated token of sample `index`.
#[derive(Debug, Clone)]
pub struct TokenOut {
    pub index: usize,
    pub token: i64,
    pub logprob: f32,
    pub top: Vec<(i64, f32)>,
}

/// What the engine sends back about a request, in order.
#[derive(Debug, Clone)]
pub enum Event {
    Token(TokenOut),
    /// Sample `index` ended; `stop` names the stop string that ended it.
    Finished {
        index: usize,
        reason: Finish,
        stop: Option<String>,
    },
    /// The request failed as a whole (e.g. the model rejected it).
    Failed(String),
}
