//! The environment abstraction and the registry that builds environments from their typed
//! configuration.
//!
//! An [`Environment`] steps a whole batch at once (so an HTTP plugin can batch and the code
//! sandbox can run samples side by side) and answers one [`Outcome`] per sample, in order.
//! Environments whose work is plain CPU per sample implement [`SampleEnv`] instead and run on
//! the blocking pool. Built environments are cached by configuration, so a plugin's
//! concurrency limit and a compiled regex are shared by every request that names them.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use keel_protocol::Subjects;
use keel_protocol::reward::{EnvConfig, EnvSample, EnvStepResult, Message, SampleError};
use serde_json::Value;

use crate::envs;
use crate::sandbox::Sandbox;

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
struct Blocking<E>(Arc<E>);

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

/// Shared handles environments are built with.
#[derive(Clone)]
pub struct EnvContext {
    pub http: reqwest::Client,
    /// Whether `http` environments may name loopback and private addresses.
    pub allow_private: bool,
    /// For `reward_model` (trainer requests); none when the service runs without NATS.
    pub nats: Option<async_nats::Client>,
    pub subjects: Subjects,
    /// The JetStream object-store bucket for bodies over 1 MiB (the trainers' bucket).
    pub bulk_bucket: String,
    pub sandbox: Arc<Sandbox>,
}

impl std::fmt::Debug for EnvContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvContext").field("nats", &self.nats.is_some()).field("sandbox", &self.sandbox).finish()
    }
}

/// Builds the environment `config` names; the error names the bad field (`env.pattern: ...`).
pub fn build(config: &EnvConfig, ctx: &EnvContext) -> Result<Arc<dyn Environment>, String> {
    build_unprefixed(config, ctx).map_err(|e| format!("env.{e}"))
}

fn build_unprefixed(config: &EnvConfig, ctx: &EnvContext) -> Result<Arc<dyn Environment>, String> {
    let env: Arc<dyn Environment> = match config {
        EnvConfig::Math(c) => Arc::new(Blocking(Arc::new(envs::math::MathEnv::new(c)?))),
        EnvConfig::Code(c) => Arc::new(envs::code::CodeEnv::new(c, ctx.sandbox.clone())?),
        EnvConfig::SlidingPuzzle(c) => Arc::new(Blocking(Arc::new(envs::puzzle::PuzzleEnv::new(c)?))),
        EnvConfig::ExactMatch(c) => Arc::new(Blocking(Arc::new(envs::matching::ExactMatch::new(c)?))),
        EnvConfig::Regex(c) => Arc::new(Blocking(Arc::new(envs::matching::RegexEnv::new(c)?))),
        EnvConfig::MultipleChoice(c) => Arc::new(Blocking(Arc::new(envs::matching::MultipleChoice::new(c)?))),
        EnvConfig::Http(c) => Arc::new(envs::http::HttpEnv::new(c, ctx.http.clone(), ctx.allow_private)?),
        EnvConfig::RewardModel(c) => Arc::new(envs::reward_model::RewardModelEnv::new(
            c,
            ctx.nats.clone(),
            ctx.subjects.clone(),
            &ctx.bulk_bucket,
        )?),
    };
    Ok(env)
}

/// Built environments by configuration (at most [`EnvCache::CAPACITY`]; the oldest half is
/// dropped when full).
#[derive(Clone, Default)]
pub struct EnvCache {
    built: Arc<Mutex<Built>>,
}

/// A use counter, and each environment with the count of its last use.
type Built = (u64, HashMap<String, (u64, Arc<dyn Environment>)>);

impl std::fmt::Debug for EnvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EnvCache")
    }
}

impl EnvCache {
    pub const CAPACITY: usize = 64;

    pub fn get(&self, config: &EnvConfig, ctx: &EnvContext) -> Result<Arc<dyn Environment>, String> {
        let key = serde_json::to_string(config).map_err(|e| e.to_string())?;
        let mut guard = self.built.lock().map_err(|_| "environment cache poisoned".to_string())?;
        let (clock, built) = &mut *guard;
        *clock += 1;
        if let Some((used, env)) = built.get_mut(&key) {
            *used = *clock;
            return Ok(env.clone());
        }
        let env = build(config, ctx)?;
        if built.len() >= Self::CAPACITY {
            let mut ages: Vec<u64> = built.values().map(|(used, _)| *used).collect();
            ages.sort_unstable();
            let cutoff = ages[ages.len() / 2];
            built.retain(|_, (used, _)| *used > cutoff);
        }
        built.insert(key, (*clock, env.clone()));
        Ok(env)
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
pub fn compile_pattern(field: &str, pattern: &str, groups: bool) -> Result<regex::Regex, String> {
    let regex = regex::RegexBuilder::new(pattern)
        .size_limit(1 << 20)
        .build()
        .map_err(|e| format!("{field}: not a valid regex: {e}"))?;
    if groups && regex.captures_len() < 2 {
        return Err(format!("{field}: needs one capture group around the answer"));
    }
    Ok(regex)
}

/// The last capture of `pattern` in `text`.
pub fn last_capture(pattern: &regex::Regex, text: &str) -> Option<String> {
    pattern.captures_iter(text).last().and_then(|c| c.get(1)).map(|m| m.as_str().trim().to_string())
}
