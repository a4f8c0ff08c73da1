//! The environments: the [`Environment`] trait, the text helpers they share, and the
//! built-in ones, one file each: [`math`], [`code`] (in the sandbox), [`puzzle`]
//! (`sliding_puzzle`), [`matching`] (`exact_match`, `regex`, `multiple_choice`), [`http`]
//! (the user's reward service), [`agent`] (the user's agent, which drives the policy itself)
//! and [`reward_model`] (a Bradley–Terry model on a trainer worker).
//!
//! An [`Environment`] steps a whole batch at once (so an HTTP plugin can batch and the code
//! sandbox can run samples side by side) and answers one [`Outcome`] per sample, in order.
//! Environments whose work is plain CPU per sample implement [`SampleEnv`] instead and run on
//! the blocking pool (`Blocking`). The registry that builds and caches them from their
//! configuration is `registry`.

pub mod agent;
pub mod code;
pub mod http;
pub mod matching;
pub mod math;
pub mod puzzle;
pub mod reward_model;

use keel_protocol::FieldError;
use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use keel_protocol::reward::{EnvSample, EnvStepResult, Message, SampleError};
use serde_json::Value;

/// One sample's step, or why it could not be scored.
pub type Outcome = Result<EnvStepResult, SampleError>;

pub trait Environment: Send + Sync {
    /// One step of every sample, in order.
    fn step<'a>(&'a self, samples: &'a [EnvSample]) -> BoxFuture<'a, Vec<Outcome>>;

    /// Batch-level metrics beyond the common ones (reward mean, errors).
    fn metrics(&self, _results: &[EnvStepResult]) -> BTreeMap<String, f64> {
        BTreeMap::new()
    }
}

/// An environment scored one sample at a time on CPU (math, matching, the puzzle).
pub trait SampleEnv: Send + Sync + 'static {
    fn step_one(&self, sample: &EnvSample) -> Outcome;
}

/// Runs a [`SampleEnv`] on the blocking pool, so CPU work never holds an async worker.
pub(crate) struct Blocking<E>(pub(crate) Arc<E>);

impl<E: SampleEnv> Environment for Blocking<E> {
    fn step<'a>(&'a self, samples: &'a [EnvSample]) -> BoxFuture<'a, Vec<Outcome>> {
        let env = self.0.clone();
        let owned = samples.to_vec();
        let n = owned.len();
        let span = tracing::Span::current();
        Box::pin(async move {
            let work = move || span.in_scope(|| owned.iter().map(|s| env.step_one(s)).collect::<Vec<_>>());
            match tokio::task::spawn_blocking(work).await {
                Ok(outcomes) => outcomes,
                Err(e) => vec![Err(SampleError::new("internal", format!("scoring thread failed: {e}"))); n],
            }
        })
    }
}

/// The model's turn: the last message, which must be the assistant's.
pub fn last_turn(sample: &EnvSample) -> Result<&str, SampleError> {
    match sample.messages.last() {
        Some(m) if m.role == "assistant" => Ok(&m.content),
        Some(m) => {
            Err(SampleError::new("invalid_sample", format!("the last message is `{}`, not `assistant`", m.role)))
        }
        None => Err(SampleError::new("invalid_sample", "messages is empty")),
    }
}

/// The last user message before the model's turn (empty when there is none).
pub fn prompt_of(messages: &[Message]) -> &str {
    messages.iter().rev().find(|m| m.role == "user").map_or("", |m| m.content.as_str())
}

/// `metadata.<key>` as text (numbers are written out), or an error naming it.
pub fn metadata_text(metadata: &Value, key: &str) -> Result<String, SampleError> {
    match metadata.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Number(n)) => Ok(n.to_string()),
        Some(other) => Err(SampleError::new("invalid_sample", format!("metadata.{key} must be a string, not {other}"))),
        None => Err(SampleError::new("invalid_sample", format!("metadata.{key} is missing"))),
    }
}

/// A compiled pattern (with one capture group when `groups`); the error names `field`.
pub fn compile_pattern(field: &str, pattern: &str, groups: bool) -> Result<regex::Regex, FieldError> {
    let regex = regex::RegexBuilder::new(pattern)
        .size_limit(1 << 20)
        .build()
        .map_err(|e| FieldError::new(field, format!("not a valid regex: {e}")))?;
    if groups && regex.captures_len() < 2 {
        return Err(FieldError::new(field, "needs one capture group around the answer"));
    }
    Ok(regex)
}

/// The last capture of `pattern` in `text`.
pub fn last_capture(pattern: &regex::Regex, text: &str) -> Option<String> {
    pattern.captures_iter(text).last().and_then(|c| c.get(1)).map(|m| m.as_str().trim().to_string())
}
