//! Agent environments: an HTTP service of the user's that drives the policy itself, through
//! the generator's OpenAI-compatible API, for one sample at a time.
//!
//! For each sample the run opens a session on one of its generators
//! ([`AgentSessionOpen`], on the generator's own `agent_open` subject): a key scoped to that
//! sample, with its limits. The reward service then sends the agent an [`AgentRequest`] (the
//! task, the generator's base URL, the key and the served model's name); the agent calls
//! `/v1/chat/completions` with that key as its bearer token as many times as it likes, and
//! answers with its reward ([`crate::reward::PluginResponse`], as a reward plugin does).
//! Every completion made under the key is recorded by the generator as it sampled it —
//! prompt token ids, sampled token ids, their logprobs and the weight version — and the run
//! collects them when it closes the session ([`AgentSessionClose`] →
//! [`AgentTrajectory`]): the sample it trains on is those tokens, never the agent's own
//! rendering of the conversation.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use crate::reward::Message;

/// What one sample's agent may spend.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentLimits {
    /// Completions under the sample's key.
    pub max_calls: u32,
    /// Tokens generated over all of them.
    pub max_tokens: u64,
    /// Seconds from the start of the agent's episode to its answer.
    pub timeout_seconds: f64,
}

/// Where the agent reaches the policy: an OpenAI-compatible base URL (ending in `/v1`), the
/// key to send as `Authorization: Bearer <api_key>`, and the model name to ask for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentEndpoint {
    pub base_url: String,
    pub api_key: String,
    pub model: String,
}

/// What Keel sends the agent (`POST` to the environment's `url`); the agent answers with a
/// [`crate::reward::PluginResponse`]: `reward` or named `rewards`, and optional `info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct AgentRequest {
    /// The task: the dataset's prompt as chat messages (the agent may add its own system
    /// prompt and tools).
    pub messages: Vec<Message>,
    /// The sample's metadata: `ground_truth`, `task` and the dataset row's other fields.
    #[schema(value_type = Object)]
    pub metadata: Value,
    /// The policy, for this sample only.
    pub openai: AgentEndpoint,
    pub limits: AgentLimits,
}

/// Open a session for one sample on a generator the run holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentSessionOpen {
    pub run_id: String,
    /// The bearer token the agent will send; unique to the sample.
    pub key: String,
    pub limits: AgentLimits,
    /// The oldest weight version the sample may be generated with (a generator on older
    /// weights refuses with `stale_weights`).
    #[serde(default)]
    pub min_weight_version: u64,
    /// The run's sampling settings: they replace whatever the agent asks for, so that the
    /// logprobs recorded are of the distribution the trainer scores.
    #[serde(default)]
    pub sampling: crate::generator::Sampling,
    /// The most tokens one call may generate (the run's `generation.max_new_tokens`; 0: no
    /// limit but the session's).
    #[serde(default)]
    pub max_call_tokens: usize,
}

/// Where the agent of the session reaches this generator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentSessionOpened {
    pub generator_id: String,
    /// The OpenAI API's base URL as this generator advertises it (`…/v1`).
    pub base_url: String,
    pub model: String,
}

/// Close a session: the key stops working, and what was generated under it comes back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentSessionClose {
    pub run_id: String,
    pub key: String,
}

/// One completion made under a session's key, as the generator sampled it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentCall {
    /// Whether the call's prompt starts with the previous call's prompt and completion,
    /// token for token (the agent continued the same conversation).
    pub continues: bool,
    /// The prompt's token ids: when `continues`, only those after the previous call's prompt
    /// and completion; otherwise the whole prompt.
    pub prompt_token_ids: Vec<i64>,
    /// The sampled token ids (the end-of-turn token included when the model wrote it).
    pub token_ids: Vec<i64>,
    /// The logprob of each sampled token, of the distribution it was sampled from.
    pub logprobs: Vec<f32>,
    pub weight_version: u64,
    /// `stop` or `length`.
    pub finish_reason: String,
    /// The agent's rendering of the conversation tokenised differently from what was
    /// sampled, and the sampled tokens were put back in its place.
    #[serde(default)]
    pub respliced: bool,
}

/// Everything generated under a closed session's key, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentTrajectory {
    pub calls: Vec<AgentCall>,
    /// The first limit the agent went past (a call over `max_calls`, over `max_tokens` or
    /// after `timeout_seconds`): the sample is then dropped with this reason.
    pub violation: Option<String>,
}
