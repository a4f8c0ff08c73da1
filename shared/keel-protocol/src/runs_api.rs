//! The runs API's response bodies: a run, a page of runs, metrics, samples and the event
//! stream (`GET /v1/runs...`). The spec a run was submitted with is [`crate::run::RunSpec`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use crate::reward::Message;
use crate::run::{Algorithm, RunSpec};

/// Where a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Queued,
    Running,
    /// Running, but held up by a dependency that has been gone past the grace period (the
    /// reason names it); the run carries on by itself when it is back.
    Waiting,
    Succeeded,
    Failed,
    Cancelled,
}

impl RunStatus {
    pub const ALL: [RunStatus; 6] =
        [Self::Queued, Self::Running, Self::Waiting, Self::Succeeded, Self::Failed, Self::Cancelled];

    pub fn name(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Waiting => "waiting",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }

    pub fn is_final(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }
}

/// A run as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Run {
    pub id: uuid::Uuid,
    pub name: Option<String>,
    pub algorithm: Algorithm,
    pub status: RunStatus,
    /// Why the run failed, was cancelled, or is waiting.
    pub reason: Option<String>,
    /// Steps completed (recorded metrics go up to this step).
    pub step: u64,
    pub total_steps: u64,
    pub created_at: String,
    pub updated_at: String,
    /// The latest value of each metric.
    pub latest_metrics: BTreeMap<String, f64>,
    pub spec: RunSpec,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RunList {
    pub runs: Vec<Run>,
    /// Pass as `after` for the next page (absent on the last page).
    pub next: Option<String>,
}

/// One metric's values by step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MetricSeries {
    pub name: String,
    /// `[step, value]` pairs in step order.
    #[schema(schema_with = points_schema)]
    pub points: Vec<(u64, f64)>,
}

/// `[[step, value], ...]` as arrays of two numbers: the tuple form utoipa writes
/// (`prefixItems` with `items: false`) is one that client generators cannot read.
fn points_schema() -> utoipa::openapi::schema::Array {
    use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, Type};
    let pair = ArrayBuilder::new()
        .items(ObjectBuilder::new().schema_type(Type::Number))
        .min_items(Some(2))
        .max_items(Some(2))
        .description(Some("`[step, value]`: the step (an integer from 0) and the metric's value"));
    ArrayBuilder::new().items(pair).description(Some("`[step, value]` pairs in step order.")).build()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Metrics {
    pub metrics: Vec<MetricSeries>,
}

/// One recorded rollout (or validation sample).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Sample {
    pub step: u64,
    /// `train` or `validation`.
    pub split: String,
    pub prompt: String,
    /// Every turn after the prompt as text, joined by newlines (see `turns` for the roles).
    pub completion: String,
    pub reward: f64,
    pub ground_truth: Option<String>,
    pub finish_reason: Option<String>,
    /// Named reward components, each summed over the sample's turns (an environment or reward
    /// plugin that reports several).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rewards: BTreeMap<String, f64>,
    /// What the environment last reported besides the reward (a plugin's `info`).
    #[serde(default, skip_serializing_if = "Value::is_null")]
    #[schema(value_type = Object)]
    pub info: Value,
    /// The turns after the prompt: the model's (`assistant`) and the environment's
    /// observations, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub turns: Vec<Message>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_prompt_tokens: Option<u64>,
    /// Tokens the model generated: those the loss covers (observations are not among them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_generated_tokens: Option<u64>,
    /// Every token of the sample: prompt, generated and observations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_tokens: Option<u64>,
    /// Cut at the maximum sequence length (or the last turn ran out of new tokens).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncated: Option<bool>,
    /// Why scoring the sample failed (its environment's error: a plugin that did not answer,
    /// an agent that timed out, went past a limit or did not keep to one conversation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Left out of training (sample mask 0) for that error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropped: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Samples {
    pub samples: Vec<Sample>,
}

/// What the event stream carries: status changes, each step's metrics and each checkpoint
/// saved. Each variant has its own name in the document (`RunEventStatus`, ...), so a
/// generated client has a type for each.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RunEvent {
    /// The run's new status.
    #[schema(title = "RunEventStatus")]
    Status { status: RunStatus, reason: Option<String> },
    /// A step's recorded metrics.
    #[schema(title = "RunEventStep")]
    Step { step: u64, metrics: BTreeMap<String, f64> },
    /// A checkpoint saved at a step.
    #[schema(title = "RunEventCheckpoint")]
    Checkpoint { step: u64, checkpoint_id: uuid::Uuid },
}

impl RunEvent {
    /// The SSE event name: `status`, `step` or `checkpoint`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Status { .. } => "status",
            Self::Step { .. } => "step",
            Self::Checkpoint { .. } => "checkpoint",
        }
    }

    /// Whether this is the run's final status.
    pub fn is_final(&self) -> bool {
        matches!(self, Self::Status { status, .. } if status.is_final())
    }
}

/// An event with its sequence number (the SSE `id`, for `Last-Event-ID`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RunEventRecord {
    pub seq: i64,
    pub at: String,
    pub event: RunEvent,
}
