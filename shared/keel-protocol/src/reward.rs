//! Scoring and environment steps, served by the reward service over NATS (queue group
//! `reward`: `<prefix>.reward.score`, `<prefix>.reward.env.step`) and REST (`POST /v1/score`,
//! `POST /v1/env/step`), plus the contract of a user's own HTTP reward service.
//!
//! An environment is chosen by name with its typed configuration ([`EnvConfig`], written
//! `{"name": "math", "time_limit_ms": 500}`). A step takes each sample's conversation so far
//! and its metadata (ground truth, tests, game state) and answers an observation (or none),
//! a reward (or named reward components), whether the episode ended, the stop strings for the
//! next turn and the updated metadata. A single-turn scorer is an environment that ends after
//! one step. A sample whose scoring failed carries its error; [`OnError`] decides what that
//! means for the batch.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use crate::FieldError;

/// The queue group of reward workers.
pub const REWARD_QUEUE_GROUP: &str = "reward";

/// Stable error codes of reward replies (NATS `error.type`, REST `error.type`).
pub mod error_types {
    /// The body is not valid for the operation; the message names the field.
    pub const INVALID_REQUEST: &str = "invalid_request";
    /// A sample failed and the request asked for `on_error: fail`; the message names it.
    pub const SAMPLE_FAILED: &str = "sample_failed";
    /// Too many requests in flight on this replica; retry another or later.
    pub const UNAVAILABLE: &str = "unavailable";
    /// The reply would exceed NATS's message size: send fewer samples per request.
    pub const TOO_LARGE: &str = "too_large";
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool` or `environment`.
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        Self { role: role.to_string(), content: content.into() }
    }
}

/// What happens to a sample whose scoring failed (an HTTP plugin down, a malformed reply):
/// `zero` (reward 0, the error attached), `skip` (marked `skipped` and left out of training:
/// sample mask 0) or `fail` (the whole request fails with `sample_failed`, naming the sample;
/// in a run, so does the step).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// Reward 0; the result carries the error.
    #[default]
    Zero,
    /// The result is marked `skipped` (the run gives it sample mask 0) and carries the error.
    Skip,
    /// The whole request fails with `sample_failed`, naming the sample.
    Fail,
}

/// The environment that scores a batch, by name, with its configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "name", rename_all = "snake_case")]
pub enum EnvConfig {
    Math(MathConfig),
    Code(CodeConfig),
    SlidingPuzzle(SlidingPuzzleConfig),
    ExactMatch(ExactMatchConfig),
    Regex(RegexConfig),
    MultipleChoice(MultipleChoiceConfig),
    Http(HttpRewardConfig),
    RewardModel(RewardModelConfig),
    Agent(AgentConfig),
}

impl EnvConfig {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Math(_) => "math",
            Self::Code(_) => "code",
            Self::SlidingPuzzle(_) => "sliding_puzzle",
            Self::ExactMatch(_) => "exact_match",
            Self::Regex(_) => "regex",
            Self::MultipleChoice(_) => "multiple_choice",
            Self::Http(_) => "http",
            Self::RewardModel(_) => "reward_model",
            Self::Agent(_) => "agent",
        }
    }

    /// Whether every reward it gives is 0 or 1 (a right-or-wrong verifier, over all turns):
    /// validation then reports `accuracy`, else the mean reward.
    pub fn binary_rewards(&self) -> bool {
        match self {
            Self::Math(_) | Self::ExactMatch(_) | Self::Regex(_) | Self::MultipleChoice(_) | Self::SlidingPuzzle(_) => {
                true
            }
            // Partial credit, or a reward per attempt with feedback.
            Self::Code(c) => c.all_or_nothing && !c.feedback,
            Self::Http(_) | Self::RewardModel(_) | Self::Agent(_) => false,
        }
    }
}

/// `math`: the last `\boxed{}` (or the pattern's capture) against `metadata.ground_truth`,
/// by mathematical equivalence. Reward 1 or 0.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct MathConfig {
    /// A regex with one capture group for the answer (e.g. `Answer:\s*(.+)`), used when the
    /// response has no `\boxed{}`; the last match wins.
    pub answer_pattern: Option<String>,
    /// Relative tolerance for decimals.
    pub relative_tolerance: f64,
    /// Per-sample time limit in milliseconds; a sample over it scores 0.
    pub time_limit_ms: u64,
}

impl Default for MathConfig {
    fn default() -> Self {
        Self { answer_pattern: None, relative_tolerance: 1e-4, time_limit_ms: 1000 }
    }
}

/// `code`: the last fenced Python block of the response, run in the sandbox against
/// `metadata.tests` (`[{"stdin", "stdout"}]` or `[{"assert": "assert f(1) == 2"}]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct CodeConfig {
    /// Reward 1 only when every test passes (else the fraction passed).
    pub all_or_nothing: bool,
    /// CPU seconds per test run.
    pub cpu_seconds: u64,
    /// Wall-clock seconds per test run; the process tree is killed after it.
    pub wall_seconds: f64,
    /// Address space per process, MiB.
    pub memory_mb: u64,
    /// Processes the program may have at once.
    pub max_processes: u64,
    /// Largest file the program may write, MiB.
    pub max_file_mb: u64,
    /// Output kept per stream (stdout, stderr), bytes.
    pub max_output_bytes: usize,
    /// Multi-turn: answer the test report as an observation and let the model try again until
    /// every test passes or `max_attempts` is reached.
    pub feedback: bool,
    /// Attempts with `feedback` before the episode ends, counted in `metadata.attempts`; at
    /// least 1.
    pub max_attempts: u32,
}

impl Default for CodeConfig {
    fn default() -> Self {
        Self {
            all_or_nothing: false,
            cpu_seconds: 5,
            wall_seconds: 10.0,
            memory_mb: 512,
            max_processes: 16,
            max_file_mb: 16,
            max_output_bytes: 64 * 1024,
            feedback: false,
            max_attempts: 3,
        }
    }
}

/// `sliding_puzzle`: the N×N sliding-tile game. `metadata` holds `{"size", "seed",
/// "shuffle_moves"}` for a new game or the `board` of one in progress. Actions are
/// `<action>up|down|left|right|view</action>` or `<action>slide R C</action>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct SlidingPuzzleConfig {
    /// Moves (valid or not) before the episode ends unsolved.
    pub max_moves: u32,
}

impl Default for SlidingPuzzleConfig {
    fn default() -> Self {
        Self { max_moves: 50 }
    }
}

/// `exact_match`: the response (or the pattern's capture) equals `metadata.ground_truth`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ExactMatchConfig {
    /// Compare case-sensitively (else both sides are lowercased first).
    pub case_sensitive: bool,
    /// Collapse runs of whitespace and trim both ends before comparing.
    pub normalize_whitespace: bool,
    /// A regex with one capture group that extracts the answer (the last match wins).
    pub answer_pattern: Option<String>,
}

impl Default for ExactMatchConfig {
    fn default() -> Self {
        Self { case_sensitive: false, normalize_whitespace: true, answer_pattern: None }
    }
}

/// `regex`: reward 1 when the response matches the pattern (`metadata.pattern` overrides it).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RegexConfig {
    /// The regex the response must match (anywhere in it, or all of it with `full_match`); a
    /// sample's `metadata.pattern` overrides it. A sample with neither fails to score.
    pub pattern: Option<String>,
    /// The whole response must match, not just a part.
    pub full_match: bool,
}

/// `multiple_choice`: the answer letter (`Answer: B`, `\boxed{B}`, `(B)`) against
/// `metadata.ground_truth`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct MultipleChoiceConfig {
    /// The option letters.
    pub choices: String,
}

impl Default for MultipleChoiceConfig {
    fn default() -> Self {
        Self { choices: "ABCD".into() }
    }
}

/// `http`: the user's own reward service (contract: `openapi/reward-plugin.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct HttpRewardConfig {
    /// The endpoint that scores (`POST`).
    pub url: String,
    /// Per attempt.
    pub timeout_ms: u64,
    /// Retries after the first attempt (on timeouts, connection errors, 429 and 5xx).
    pub max_retries: u32,
    /// The first retry waits about this long; each later one twice as long, with jitter.
    pub backoff_ms: u64,
    /// The longest a retry waits, milliseconds (before jitter); at most 60,000.
    pub max_backoff_ms: u64,
    /// Requests in flight to this endpoint from one reward replica.
    pub max_concurrency: usize,
    /// A larger reply is refused.
    pub max_response_bytes: usize,
    /// The `Authorization` header value (e.g. `Bearer abc`).
    pub authorization: Option<String>,
    /// Or: the reward service's environment variable holding it (keeps secrets out of run
    /// specs); its name must start with `KEEL_REWARD_SECRET_`.
    pub authorization_env: Option<String>,
    /// Samples per request: 1 sends one sample per request, more sends `{"samples": [...]}`.
    pub batch_size: usize,
}

/// Bounds on an `http` environment's settings, so that no request holds a slot for ever.
pub mod http_limits {
    pub const MAX_RETRIES: u32 = 10;
    pub const MAX_TIMEOUT_MS: u64 = 600_000;
    pub const MAX_BACKOFF_MS: u64 = 60_000;
    pub const MAX_CONCURRENCY: usize = 1024;
    pub const MAX_RESPONSE_BYTES: usize = 64 << 20;
    pub const MAX_BATCH: usize = 1024;
    /// The most completions one sample's agent may ask for.
    pub const MAX_AGENT_CALLS: u32 = 1024;
    /// What `authorization_env` must start with.
    pub const SECRET_PREFIX: &str = "KEEL_REWARD_SECRET_";
}

impl HttpRewardConfig {
    /// What is wrong with it on its face (field paths relative to the environment): the URL
    /// (absolute, http or https, with a host), the bounds, and the authorization's shape.
    /// Whether its host is allowed and its secret bound to it is the reward service's call.
    pub fn problems(&self) -> Vec<FieldError> {
        use http_limits::*;
        let mut problems = Vec::new();
        match url::Url::parse(&self.url) {
            Err(e) => problems.push(FieldError::new("url", format!("`{}` is not an absolute URL: {e}", self.url))),
            Ok(url) if !matches!(url.scheme(), "http" | "https") => {
                problems.push(FieldError::new("url", format!("`{}` must be http or https", self.url)))
            }
            Ok(url) if url.host_str().is_none_or(str::is_empty) => {
                problems.push(FieldError::new("url", format!("`{}` has no host", self.url)))
            }
            Ok(_) => {}
        }
        let bounded = [
            ("timeout_ms", self.timeout_ms, 1, MAX_TIMEOUT_MS),
            ("max_retries", u64::from(self.max_retries), 0, u64::from(MAX_RETRIES)),
            ("backoff_ms", self.backoff_ms, 0, MAX_BACKOFF_MS),
            ("max_backoff_ms", self.max_backoff_ms, 0, MAX_BACKOFF_MS),
            ("max_concurrency", self.max_concurrency as u64, 1, MAX_CONCURRENCY as u64),
            ("batch_size", self.batch_size as u64, 1, MAX_BATCH as u64),
            ("max_response_bytes", self.max_response_bytes as u64, 16, MAX_RESPONSE_BYTES as u64),
        ];
        for (field, value, least, most) in bounded {
            if value < least || value > most {
                problems.push(FieldError::new(field, format!("must be {least} to {most}, got {value}")));
            }
        }
        match (&self.authorization, &self.authorization_env) {
            (Some(_), Some(_)) => {
                problems.push(FieldError::new("authorization_env", "give authorization or authorization_env, not both"))
            }
            (None, Some(var)) if !var.starts_with(SECRET_PREFIX) => problems.push(FieldError::new(
                "authorization_env",
                format!("must name a variable starting with {SECRET_PREFIX}"),
            )),
            _ => {}
        }
        problems
    }
}

impl Default for HttpRewardConfig {
    fn default() -> Self {
        Self {
            url: String::new(),
            timeout_ms: 10_000,
            max_retries: 3,
            backoff_ms: 200,
            max_backoff_ms: 5_000,
            max_concurrency: 16,
            max_response_bytes: 1 << 20,
            authorization: None,
            authorization_env: None,
            batch_size: 1,
        }
    }
}

/// `agent`: the user's agent service, which drives the policy itself through the
/// generator's OpenAI API for each sample and answers with its reward (contract:
/// `openapi/agent.json`; the Agents guide). The tokens trained on are the ones the generator
/// sampled under the sample's key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// The agent's endpoint (`POST`, one sample per request).
    pub url: String,
    /// Completions one sample's agent may ask for.
    pub max_calls: u32,
    /// Tokens one sample's agent may have generated, over all its calls (0: the run's
    /// `max_total_sequence_length`). Each call is also held to `generation.max_new_tokens`.
    pub max_tokens: u64,
    /// How long one sample's agent may take, from the request to its answer, milliseconds.
    pub timeout_ms: u64,
    /// Agents in flight from one reward replica.
    pub max_concurrency: usize,
    /// A larger reply is refused.
    pub max_response_bytes: usize,
    /// The `Authorization` header value sent to the agent (e.g. `Bearer abc`).
    pub authorization: Option<String>,
    /// Or: the reward service's environment variable holding it (its name must start with
    /// `KEEL_REWARD_SECRET_`).
    pub authorization_env: Option<String>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            url: String::new(),
            max_calls: 16,
            max_tokens: 0,
            timeout_ms: 300_000,
            max_concurrency: 64,
            max_response_bytes: 1 << 20,
            authorization: None,
            authorization_env: None,
        }
    }
}

impl AgentConfig {
    /// The HTTP call to the agent, as an `http` environment's: one attempt (an episode is not
    /// repeated: the calls it made are already recorded), one sample a request.
    pub fn http(&self) -> HttpRewardConfig {
        HttpRewardConfig {
            url: self.url.clone(),
            timeout_ms: self.timeout_ms,
            max_retries: 0,
            max_concurrency: self.max_concurrency,
            max_response_bytes: self.max_response_bytes,
            authorization: self.authorization.clone(),
            authorization_env: self.authorization_env.clone(),
            batch_size: 1,
            ..HttpRewardConfig::default()
        }
    }

    /// What is wrong with it on its face (field paths relative to the environment).
    pub fn problems(&self) -> Vec<FieldError> {
        let mut problems = self.http().problems();
        if !(1..=http_limits::MAX_AGENT_CALLS).contains(&self.max_calls) {
            problems.push(FieldError::new(
                "max_calls",
                format!("must be 1 to {}, got {}", http_limits::MAX_AGENT_CALLS, self.max_calls),
            ));
        }
        problems
    }

    /// The limits its samples get, `max_tokens` 0 meaning the run's longest sequence.
    pub fn limits(&self, max_total_sequence_length: usize) -> crate::agent::AgentLimits {
        let whole = max_total_sequence_length as u64;
        crate::agent::AgentLimits {
            max_calls: self.max_calls,
            max_tokens: if self.max_tokens == 0 { whole } else { self.max_tokens },
            timeout_seconds: self.timeout_ms as f64 / 1000.0,
        }
    }
}

/// `reward_model`: a Bradley–Terry model trained by Keel, loaded on a trainer worker the run
/// has claimed; each sample's `token_ids` are scored there.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RewardModelConfig {
    /// The trainer worker that has the reward model loaded.
    pub worker_id: String,
    /// The run that holds that worker.
    pub run_id: String,
    /// How long the trainer may take, milliseconds (0: 30 s).
    pub timeout_ms: u64,
}

/// One sample: its conversation so far (the last message is the model's turn) and metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EnvSample {
    pub messages: Vec<Message>,
    /// Ground truth, tests, game state: whatever the environment reads; returned updated.
    #[serde(default)]
    #[schema(value_type = Object)]
    pub metadata: Value,
    /// The conversation's token ids, when the caller has them (`reward_model` needs them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<i64>>,
    /// For `agent`: where the sample's agent reaches the policy, and its limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentSample>,
}

/// An `agent` sample's endpoint and limits (the run opened its session on a generator).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentSample {
    pub openai: crate::agent::AgentEndpoint,
    pub limits: crate::agent::AgentLimits,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EnvStepRequest {
    pub env: EnvConfig,
    #[serde(default)]
    pub on_error: OnError,
    pub samples: Vec<EnvSample>,
}

/// Why one sample could not be scored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SampleError {
    /// `invalid_sample`, `timeout`, `http_status`, `malformed_reply`, `too_large`,
    /// `unreachable`, `sandbox`, `trainer`.
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
}

impl SampleError {
    pub fn new(kind: &str, message: impl Into<String>) -> Self {
        Self { kind: kind.to_string(), message: message.into() }
    }
}

impl std::fmt::Display for SampleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

/// One sample's step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EnvStepResult {
    /// The environment's answer for the next turn (none when it has nothing to say).
    pub observation: Option<Message>,
    pub reward: f64,
    /// Named reward components, when the environment gives several.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rewards: BTreeMap<String, f64>,
    pub terminated: bool,
    /// Stop strings for the next generation turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_strings: Option<Vec<String>>,
    #[schema(value_type = Object)]
    pub metadata: Value,
    /// The answer the environment extracted from the response.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    /// Anything else the environment reports (test outcomes, a plugin's `info`).
    #[serde(default, skip_serializing_if = "Value::is_null")]
    #[schema(value_type = Object)]
    pub info: Value,
    /// Set when scoring failed (the reward is then 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<SampleError>,
    /// `on_error: skip` marked this sample to be left out of training.
    #[serde(default)]
    pub skipped: bool,
}

impl EnvStepResult {
    /// A final step with a reward and nothing to say.
    pub fn done(reward: f64, metadata: Value) -> Self {
        Self {
            observation: None,
            reward,
            rewards: BTreeMap::new(),
            terminated: true,
            stop_strings: None,
            metadata,
            answer: None,
            info: Value::Null,
            error: None,
            skipped: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EnvStepReply {
    pub results: Vec<EnvStepResult>,
    /// Batch-level metrics (`reward_mean`, `error_count`, environment-specific ones).
    pub metrics: BTreeMap<String, f64>,
}

/// A completion to score directly: `messages`, or `prompt` and `completion`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ScoreSample {
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub completion: Option<String>,
    #[serde(default)]
    pub messages: Option<Vec<Message>>,
    #[serde(default)]
    #[schema(value_type = Object)]
    pub metadata: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<i64>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ScoreRequest {
    pub env: EnvConfig,
    #[serde(default)]
    pub on_error: OnError,
    pub samples: Vec<ScoreSample>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ScoreResult {
    pub reward: f64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rewards: BTreeMap<String, f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    #[serde(default, skip_serializing_if = "Value::is_null")]
    #[schema(value_type = Object)]
    pub info: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<SampleError>,
    #[serde(default)]
    pub skipped: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ScoreReply {
    pub results: Vec<ScoreResult>,
    pub metrics: BTreeMap<String, f64>,
}

/// The contract of a user's reward service: what Keel sends (`POST` to the configured URL).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PluginRequest {
    /// The last user message before the completion.
    pub prompt: String,
    /// The model's last turn.
    pub completion: String,
    /// The whole conversation.
    pub messages: Vec<Message>,
    /// The sample's metadata (ground truth and anything else the dataset carries).
    #[schema(value_type = Object)]
    pub metadata: Value,
}

/// With `batch_size` above 1, samples travel together and results come back in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PluginBatchRequest {
    pub samples: Vec<PluginRequest>,
}

/// What the user's service answers: `reward`, or named `rewards` (whose sum is the reward
/// when `reward` is absent), and optional `info` passed through.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PluginResponse {
    #[serde(default)]
    pub reward: Option<f64>,
    #[serde(default)]
    pub rewards: Option<BTreeMap<String, f64>>,
    #[serde(default)]
    #[schema(value_type = Object)]
    pub info: Value,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PluginBatchResponse {
    pub results: Vec<PluginResponse>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environments_are_named_with_their_config_inline() {
        let env: EnvConfig = serde_json::from_str(r#"{"name": "math", "time_limit_ms": 50}"#).unwrap();
        assert_eq!(env, EnvConfig::Math(MathConfig { time_limit_ms: 50, ..MathConfig::default() }));
        assert_eq!(env.name(), "math");
        let env: EnvConfig = serde_json::from_str(r#"{"name": "sliding_puzzle"}"#).unwrap();
        assert_eq!(env.name(), "sliding_puzzle");
        let err = serde_json::from_str::<EnvConfig>(r#"{"name": "math", "time_limt_ms": 5}"#).unwrap_err();
        assert!(err.to_string().contains("time_limt_ms"), "{err}");
        let err = serde_json::from_str::<EnvConfig>(r#"{"name": "chess"}"#).unwrap_err();
        assert!(err.to_string().contains("chess"), "{err}");
        let back = serde_json::to_value(EnvConfig::Code(CodeConfig::default())).unwrap();
        assert_eq!(back["name"], "code");
    }
}
