//! A generation request after validation at the edge (HTTP or NATS): nothing downstream
//! checks it again.

use keel_model::sampling::{SamplingParams, TopLogprobs};
use tokio::sync::mpsc::UnboundedReceiver;

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
    /// Tokens generated before a stop token or stop string may end a sample (stop tokens
    /// are masked until then).
    pub min_tokens: usize,
    /// Structured output: what each sample may write (each sample forks its own).
    pub guide: Option<crate::guide::Guide>,
    /// Added to these tokens' logits before sampling (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(i64, f32)>,
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
    /// Sample `index` ended on weight version `version`; `stop` names the stop string that
    /// ended it.
    Finished {
        index: usize,
        reason: Finish,
        stop: Option<String>,
        version: u64,
    },
    /// The request failed as a whole (e.g. the model rejected it).
    Failed(String),
}

/// What the engine can serve: requests are checked against these once, at the edge.
#[derive(Debug, Clone)]
pub struct Limits {
    pub vocab_size: i64,
    pub max_model_len: usize,
    pub max_num_seqs: usize,
    pub eos_token_ids: Vec<i64>,
}

/// A refused request: what is wrong and which field it concerns.
#[derive(Debug, Clone, PartialEq)]
pub struct Invalid {
    pub message: String,
    pub param: &'static str,
}

fn invalid(param: &'static str, message: String) -> Invalid {
    Invalid { message, param }
}

/// A request as a client sent it, before checking.
#[derive(Debug, Clone)]
pub struct Draft {
    pub prompt: Vec<i64>,
    pub n: usize,
    /// None: all the room the context leaves.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop_token_ids: Vec<i64>,
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
    pub ignore_eos: bool,
    pub top_logprobs: usize,
    pub min_tokens: usize,
}

/// Most top logprobs a request may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;

pub use keel_protocol::limits::{MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS};

impl Limits {
    /// Checks `draft` and makes it a request the engine can always serve.
    pub fn check(&self, draft: Draft) -> Result<GenRequest, Invalid> {
        let prompt = draft.prompt;
        if prompt.is_empty() {
            return Err(invalid("prompt", "the prompt is empty".into()));
        }
        if let Some((i, id)) = prompt.iter().enumerate().find(|(_, id)| !(0..self.vocab_size).contains(*id)) {
            return Err(invalid(
                "prompt",
                format!("prompt token {i} ({id}) is out of the vocabulary (size {})", self.vocab_size),
            ));
        }
        let limit = self.max_model_len;
        let max_tokens = draft.max_tokens.unwrap_or(limit.saturating_sub(prompt.len()));
        if max_tokens == 0 {
            return Err(invalid("max_tokens", "max_tokens must be at least 1".into()));
        }
        if prompt.len() + max_tokens > limit {
            return Err(invalid(
                "max_tokens",
                format!(
                    "This model's maximum context length is {limit} tokens. However, you requested {} tokens ({} in the prompt, {max_tokens} for the completion).",
                    prompt.len() + max_tokens,
                    prompt.len()
                ),
            ));
        }
        if draft.n == 0 || draft.n > self.max_num_seqs {
            return Err(invalid(
                "n",
                format!("n must be between 1 and {} (the server's max_num_seqs), got {}", self.max_num_seqs, draft.n),
            ));
        }
        if draft.min_tokens > max_tokens {
            return Err(invalid(
                "min_tokens",
                format!("min_tokens ({}) must not exceed max_tokens ({max_tokens})", draft.min_tokens),
            ));
        }
        let t = draft.sampling.temperature;
        if !(t.is_finite() && (0.0..=100.0).contains(&t)) {
            return Err(invalid("temperature", format!("temperature must be in [0, 100], got {t}")));
        }
        draft.sampling.validate().map_err(|e| {
            let text = e.to_string();
            let param = ["top_p", "top_k", "min_p"].into_iter().find(|p| text.contains(p)).unwrap_or("sampling");
            invalid(param, text)
        })?;
        if draft.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(invalid(
                "logprobs",
                format!("at most {MAX_TOP_LOGPROBS} top logprobs, got {}", draft.top_logprobs),
            ));
        }
        if draft.stop.iter().any(String::is_empty) {
            return Err(invalid("stop", "stop strings must not be empty".into()));
        }
        if draft.stop.len() > MAX_STOP_STRINGS {
            return Err(invalid("stop", format!("at most {MAX_STOP_STRINGS} stop strings, got {}", draft.stop.len())));
        }
        if let Some(long) = draft.stop.iter().find(|s| s.len() > MAX_STOP_STRING_BYTES) {
            return Err(invalid(
                "stop",
                format!("a stop string may be at most {MAX_STOP_STRING_BYTES} bytes, got one of {}", long.len()),
            ));
        }
        if draft.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(invalid(
                "stop_token_ids",
                format!("at most {MAX_STOP_TOKEN_IDS} stop token ids, got {}", draft.stop_token_ids.len()),
            ));
        }
        let mut stop_token_ids = draft.stop_token_ids;
        if let Some(id) = stop_token_ids.iter().find(|id| !(0..self.vocab_size).contains(*id)) {
            return Err(invalid("stop_token_ids", format!("stop token {id} is out of the vocabulary")));
        }
        if !draft.ignore_eos {
            stop_token_ids.extend(&self.eos_token_ids);
        }
        Ok(GenRequest {
            prompt,
            n: draft.n,
            max_tokens,
            sampling: draft.sampling,
            stop_token_ids,
            stop: draft.stop,
            include_stop_str_in_output: draft.include_stop_str_in_output,
            top_logprobs: draft.top_logprobs,
            min_tokens: draft.min_tokens,
            guide: None,
            logit_bias: Vec::new(),
        })
    }
}

/// Everything one sample produced.
#[derive(Debug, Default, Clone)]
pub struct SampleOut {
    pub tokens: Vec<i64>,
    pub logprobs: Vec<f32>,
    pub top: Vec<TopLogprobs>,
    /// Why it ended and the stop string that ended it.
    pub finish: Option<(Finish, Option<String>)>,
    /// The weight version it ended on.
    pub version: u64,
}

impl SampleOut {
    pub fn push(&mut self, token: TokenOut) {
        self.tokens.push(token.token);
        self.logprobs.push(token.logprob);
        self.top.push(token.top);
    }

    pub fn stop(&self) -> Option<&str> {
        self.finish.as_ref().and_then(|f| f.1.as_deref())
    }

    pub fn finish_reason(&self) -> Option<String> {
        self.finish.as_ref().map(|f| f.0.as_str().to_string())
    }
}

/// The `n` samples of a request, once the engine is done with it (the failure message if
/// the request failed).
pub async fn collect(mut events: UnboundedReceiver<Event>, n: usize) -> crate::Result<Vec<SampleOut>> {
    let mut samples = vec![SampleOut::default(); n];
    while let Some(event) = events.recv().await {
        match event {
            Event::Token(t) => samples[t.index].push(t),
            Event::Finished { index, reason, stop, version } => {
                samples[index].finish = Some((reason, stop));
                samples[index].version = version;
            }
            Event::Failed(message) => return Err(crate::Error::Request(message)),
        }
    }
    Ok(samples)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draft(stop: Vec<String>, stop_token_ids: Vec<i64>) -> Draft {
        Draft {
            prompt: vec![1, 2],
            n: 1,
            max_tokens: Some(4),
            sampling: SamplingParams::default(),
            stop_token_ids,
            stop,
            include_stop_str_in_output: false,
            ignore_eos: false,
            top_logprobs: 0,
            min_tokens: 0,
        }
    }

    /// Stop strings and stop token ids are bounded in count and length, refused naming the
    /// field; a request within the bounds is taken.
    #[test]
    fn stop_strings_are_bounded_in_count_and_length() {
        let limits = Limits { vocab_size: 100, max_model_len: 64, max_num_seqs: 4, eos_token_ids: vec![0] };
        let refused = |d: Draft| limits.check(d).unwrap_err();
        let many = vec!["x".to_string(); MAX_STOP_STRINGS + 1];
        assert_eq!(refused(draft(many, vec![])).param, "stop");
        let long = vec!["y".repeat(MAX_STOP_STRING_BYTES + 1)];
        assert!(refused(draft(long, vec![])).message.contains("bytes"));
        assert_eq!(refused(draft(vec![], vec![1; MAX_STOP_TOKEN_IDS + 1])).param, "stop_token_ids");
        let fits = draft(vec!["z".repeat(MAX_STOP_STRING_BYTES); MAX_STOP_STRINGS], vec![1; MAX_STOP_TOKEN_IDS]);
        assert_eq!(limits.check(fits).unwrap().stop.len(), MAX_STOP_STRINGS);
    }
}
