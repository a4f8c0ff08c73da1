//! What the REST and NATS sides share: requests validated at the edge, the environment run
//! on them, the `on_error` policy applied, batch metrics, and the counters `/metrics` shows.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use keel_protocol::reward::{
    EnvSample, EnvStepReply, EnvStepRequest, EnvStepResult, Message, OnError, SampleError, ScoreReply, ScoreRequest,
    ScoreResult, error_types,
};
use keel_service::json::BodyError;
use serde::de::DeserializeOwned;
use tokio::sync::Semaphore;
use tracing::Instrument;

use crate::registry::{EnvCache, EnvContext};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The body is not JSON at all.
    #[error("the body is not JSON: {0}")]
    InvalidJson(String),
    /// The request is malformed or inconsistent; the message names the field.
    #[error("{0}")]
    InvalidRequest(String),
    /// A sample failed under `on_error: fail`.
    #[error("samples[{index}]: {error}")]
    SampleFailed { index: usize, error: SampleError },
    #[error("too many requests in flight; retry later or on another replica")]
    Unavailable,
}

impl Error {
    /// The stable `type` code.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidJson(_) | Self::InvalidRequest(_) => error_types::INVALID_REQUEST,
            Self::SampleFailed { .. } => error_types::SAMPLE_FAILED,
            Self::Unavailable => error_types::UNAVAILABLE,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Decodes a JSON body; the error names the field path (`samples[0].messages: ...`).
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    keel_service::json::parse(bytes).map_err(|e| match e {
        BodyError::NotJson(m) => Error::InvalidJson(m),
        BodyError::Invalid(m) => Error::InvalidRequest(m),
    })
}

/// Per-environment counters since start.
#[derive(Debug, Default, Clone)]
pub struct EnvStats {
    pub requests: u64,
    pub samples: u64,
    pub errors: u64,
    pub reward_sum: f64,
    pub seconds: f64,
}

/// The scoring core: environments by configuration, admission and counters.
#[derive(Clone)]
pub struct Scorer {
    ctx: EnvContext,
    cache: EnvCache,
    admission: Arc<Semaphore>,
    max_samples: usize,
    stats: Arc<Mutex<BTreeMap<&'static str, EnvStats>>>,
}

impl std::fmt::Debug for Scorer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scorer").field("ctx", &self.ctx).field("max_samples", &self.max_samples).finish()
    }
}

impl Scorer {
    pub fn new(ctx: EnvContext, max_in_flight: usize, max_samples: usize) -> Self {
        Self {
            ctx,
            cache: EnvCache::default(),
            admission: Arc::new(Semaphore::new(max_in_flight)),
            max_samples,
            stats: Arc::default(),
        }
    }

    pub fn sandbox(&self) -> &crate::sandbox::Sandbox {
        &self.ctx.sandbox
    }

    /// A copy of the counters.
    pub fn stats(&self) -> BTreeMap<&'static str, EnvStats> {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Requests being served now.
    pub fn in_flight(&self, max_in_flight: usize) -> usize {
        max_in_flight.saturating_sub(self.admission.available_permits())
    }

    /// One environment step of every sample.
    pub async fn step(&self, request: EnvStepRequest) -> Result<EnvStepReply> {
        self.check_count(request.samples.len())?;
        let agent = matches!(request.env, keel_protocol::reward::EnvConfig::Agent(_));
        for (i, sample) in request.samples.iter().enumerate() {
            if agent {
                // The agent writes the model's turns itself: the sample is the task.
                if sample.agent.is_none() {
                    return Err(Error::InvalidRequest(format!(
                        "samples[{i}].agent: an agent sample needs the endpoint and limits of its session"
                    )));
                }
            } else {
                check_turn(i, &sample.messages)?;
            }
        }
        let span = tracing::info_span!("env_step", env = request.env.name(), samples = request.samples.len());
        self.run(&request.env, request.on_error, &request.samples).instrument(span).await
    }

    /// Direct scoring: each sample is one finished turn.
    pub async fn score(&self, request: ScoreRequest) -> Result<ScoreReply> {
        self.check_count(request.samples.len())?;
        let samples = request
            .samples
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                let messages = match (s.messages, s.completion) {
                    (Some(_), Some(_)) => {
                        return Err(Error::InvalidRequest(format!(
                            "samples[{i}]: give messages or completion, not both"
                        )));
                    }
                    (Some(messages), None) => {
                        check_turn(i, &messages)?;
                        messages
                    }
                    (None, Some(completion)) => {
                        let prompt = s.prompt.map(|p| Message::new("user", p));
                        prompt.into_iter().chain([Message::new("assistant", completion)]).collect()
                    }
                    (None, None) => {
                        return Err(Error::InvalidRequest(format!(
                            "samples[{i}].completion: missing (or give messages)"
                        )));
                    }
                };
                Ok(EnvSample { messages, metadata: s.metadata, token_ids: s.token_ids, agent: None })
            })
            .collect::<Result<Vec<_>>>()?;
        let span = tracing::info_span!("score", env = request.env.name(), samples = samples.len());
        let reply = self.run(&request.env, request.on_error, &samples).instrument(span).await?;
        let results = reply
            .results
            .into_iter()
            .map(|r| ScoreResult {
                reward: r.reward,
                rewards: r.rewards,
                answer: r.answer,
                info: r.info,
                error: r.error,
                skipped: r.skipped,
            })
            .collect();
        Ok(ScoreReply { results, metrics: reply.metrics })
    }

    fn check_count(&self, n: usize) -> Result<()> {
        if n > self.max_samples {
            return Err(Error::InvalidRequest(format!(
                "samples: {n} samples, at most {} per request",
                self.max_samples
            )));
        }
        Ok(())
    }

    async fn run(
        &self,
        config: &keel_protocol::reward::EnvConfig,
        on_error: OnError,
        samples: &[EnvSample],
    ) -> Result<EnvStepReply> {
        let _permit = self.admission.clone().try_acquire_owned().map_err(|_| Error::Unavailable)?;
        let env = self.cache.get(config, &self.ctx).map_err(|e| Error::InvalidRequest(e.to_string()))?;
        let started = Instant::now();
        let outcomes = env.step(samples).await;
        let seconds = started.elapsed().as_secs_f64();
        let errors = outcomes.iter().filter(|o| o.is_err()).count();
        if let Some((index, Err(error))) = outcomes.iter().enumerate().find(|(_, o)| o.is_err())
            && on_error == OnError::Fail
        {
            self.count(config.name(), samples.len(), errors, 0.0, seconds);
            return Err(Error::SampleFailed { index, error: error.clone() });
        }
        let results: Vec<EnvStepResult> = outcomes
            .into_iter()
            .zip(samples)
            .map(|(outcome, sample)| {
                outcome.unwrap_or_else(|error| {
                    tracing::debug!(%error, "sample failed");
                    let mut failed = EnvStepResult::done(0.0, sample.metadata.clone());
                    failed.skipped = on_error == OnError::Skip;
                    failed.error = Some(error);
                    failed
                })
            })
            .collect();
        let reward_sum: f64 = results.iter().map(|r| r.reward).sum();
        self.count(config.name(), samples.len(), errors, reward_sum, seconds);
        let mut metrics = env.metrics(&results);
        let n = results.len().max(1) as f64;
        metrics.insert("reward_mean".into(), reward_sum / n);
        metrics.insert("error_count".into(), errors as f64);
        metrics.insert("skipped_count".into(), results.iter().filter(|r| r.skipped).count() as f64);
        metrics.insert("terminated_rate".into(), results.iter().filter(|r| r.terminated).count() as f64 / n);
        metrics.insert("seconds".into(), seconds);
        Ok(EnvStepReply { results, metrics })
    }

    fn count(&self, env: &'static str, samples: usize, errors: usize, reward_sum: f64, seconds: f64) {
        if let Ok(mut stats) = self.stats.lock() {
            let s = stats.entry(env).or_default();
            s.requests += 1;
            s.samples += samples as u64;
            s.errors += errors as u64;
            s.reward_sum += reward_sum;
            s.seconds += seconds;
        }
    }
}

/// The conversation must end with the model's turn; the error names sample `index`.
fn check_turn(index: usize, messages: &[Message]) -> Result<()> {
    let invalid = |why: String| Err(Error::InvalidRequest(format!("samples[{index}].messages: {why}")));
    match messages.last() {
        None => invalid("must hold at least the model's turn".into()),
        Some(m) if m.role != "assistant" => {
            invalid(format!("the last message must be the assistant's, not `{}`", m.role))
        }
        Some(_) => Ok(()),
    }
}
