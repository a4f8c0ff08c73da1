//! Requests and replies of a trainer worker. A run claims a free worker on
//! [`Subjects::trainer_claim`](crate::Subjects::trainer_claim) (or a named one on its own
//! claim subject), then drives it on `keel.v1.trainer.<worker>.<op>`: load, logprobs, train,
//! score, save, heartbeat, release. Every request after the claim names its run; a worker
//! answers requests of other runs with a `wrong_run` error. Replies use
//! [`Reply`](crate::Reply); error `type`s are listed in [`error_types`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::Payload;
use crate::training::{OptimizerConfig, TrainingConfig};

/// Stable error codes of trainer replies.
pub mod error_types {
    pub use crate::lease::error_types::{BUSY, STALE_HOLDER, WRONG_RUN};
    /// A [`SendWeights`](super::SendWeights) names a kept communicator this worker does not
    /// have (it restarted, or let it go): ask again for a new one.
    pub const UNKNOWN_SESSION: &str = "unknown_session";
    /// The body is not valid JSON for the operation, or its contents are inconsistent
    /// (shape mismatch, NaN, out-of-vocabulary token).
    pub const INVALID_REQUEST: &str = "invalid_request";
    /// The training configuration was refused; the message lists every field.
    pub const INVALID_CONFIG: &str = "invalid_config";
    /// A model or checkpoint could not be loaded.
    pub const LOAD_FAILED: &str = "load_failed";
    /// An operation that needs loaded models came before `load`.
    pub const NOT_LOADED: &str = "not_loaded";
    /// A bulk payload could not be fetched from or stored to the object store.
    pub const PAYLOAD: &str = "payload";
    /// Saving a checkpoint failed; nothing was made visible.
    pub const SAVE_FAILED: &str = "save_failed";
    /// The loss or the gradient norm came out NaN or infinite; no step was taken.
    pub const NON_FINITE: &str = "non_finite";
    /// Anything else (details are in the worker's log).
    pub const INTERNAL: &str = "internal";
}

pub use crate::lease::{
    ClaimReply, ClaimRequest, HOLDER_HEADER, HeartbeatReply, HeartbeatRequest, ReleaseRequest, Released,
};

/// Where a model comes from: a Hugging Face directory or a checkpoint written by a trainer
/// (which also holds optimiser and scheduler state, restored when the policy loads from it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSource {
    pub path: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadRequest {
    pub run_id: String,
    pub policy: ModelSource,
    /// The frozen reference. Default: the reference a resumed checkpoint was trained against,
    /// else the policy as loaded (when the loss needs one).
    #[serde(default)]
    pub reference: Option<ModelSource>,
    pub training: TrainingConfig,
    /// `cpu`, `cuda` or `cuda:N` (default: the worker's configured device).
    #[serde(default)]
    pub device: Option<String>,
    /// Compute dtype: f32, bf16 or f16 (master weights and optimiser state stay f32).
    /// Default: f32 on CPU, bf16 on CUDA.
    #[serde(default)]
    pub dtype: Option<String>,
    /// Keep the reference on the CPU and move it to the device only to score.
    #[serde(default)]
    pub reference_offload: bool,
    /// Restore optimiser and scheduler state when the policy is a trainer checkpoint.
    #[serde(default = "default_true")]
    pub resume: bool,
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Tensor-parallel ranks the models are split over (1: no split). On the CPU the ranks
    /// are threads; on CUDA rank r uses the r-th GPU from `device`, over NCCL.
    #[serde(default = "default_parallel_size")]
    pub tensor_parallel_size: usize,
    /// Data-parallel replicas (1: none), each of `tensor_parallel_size` ranks: the trainer
    /// runs the grid's ranks as threads (on CUDA, rank d·TP + t on the (d·TP + t)-th GPU from
    /// `device`); each replica trains on its share of every global batch.
    #[serde(default = "default_parallel_size")]
    pub data_parallel_size: usize,
    /// PPO's critic, trained beside the policy (split over the ranks as the policy is).
    #[serde(default)]
    pub critic: Option<CriticLoad>,
}

/// The critic of a PPO run: a model of the policy's kind whose final hidden state at each
/// position goes through a scalar value head, trained on the returns the orchestrator sends
/// with each batch ([`TrainBatch::returns`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CriticLoad {
    /// The model the critic starts from, with a new value head of zeros; when the policy is a
    /// checkpoint that holds a critic (`critic/`) and `resume` is set, that critic is loaded
    /// instead, with its optimiser state.
    pub model: ModelSource,
    pub optimizer: OptimizerConfig,
    /// The value-clipping range ε: a new value counts in the loss at most ε from the value
    /// the batch was scored with (`None`: no clipping).
    #[serde(default)]
    pub value_clip: Option<f64>,
    /// The critic's first optimiser steps train it alone: the policy is not updated until the
    /// critic has taken this many.
    #[serde(default)]
    pub warmup_steps: u64,
}

fn default_parallel_size() -> usize {
    1
}

fn default_true() -> bool {
    true
}

fn default_seed() -> u64 {
    42
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadReply {
    pub parameters: i64,
    /// Optimiser steps already taken (non-zero when resumed from a checkpoint).
    pub step: u64,
    pub has_reference: bool,
    pub has_value_head: bool,
    /// Ranks the models are split over.
    #[serde(default = "default_parallel_size")]
    pub tensor_parallel_size: usize,
    pub timing: Timing,
    pub memory: Memory,
}

/// Token sequences to score.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sequences {
    pub input_ids: Vec<Vec<i64>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scorer {
    #[default]
    Policy,
    Reference,
    /// The PPO critic's values: entry t is the value of the state before token t (from the
    /// final hidden state at t − 1), entry 0 is 0, like the logprobs' layout.
    Critic,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogprobsRequest {
    pub run_id: String,
    #[serde(default)]
    pub model: Scorer,
    pub batch: Payload<Sequences>,
    /// Logits are divided by this before log-softmax (the sampling temperature).
    #[serde(default = "default_temperature")]
    pub temperature: f64,
}

fn default_temperature() -> f64 {
    1.0
}

/// Per-token logprobs, one row per sequence, entry 0 = 0.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Logprobs {
    pub logprobs: Vec<Vec<f32>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogprobsReply {
    pub logprobs: Payload<Logprobs>,
    pub timing: Timing,
    pub memory: Memory,
}

/// One training batch. Row-aligned: every per-token field has one row per sequence with the
/// sequence's length. Pairwise losses (DPO, reward model) take rows 2i (chosen) and 2i + 1
/// (rejected) as pair i.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainBatch {
    pub input_ids: Vec<Vec<i64>>,
    /// 1 on tokens the loss covers (generated / assistant tokens), else 0.
    pub token_mask: Vec<Vec<f32>>,
    /// 0 drops a sample from the loss (default: all 1).
    #[serde(default)]
    pub sample_mask: Option<Vec<f32>>,
    /// Advantages (clipped_pg): one per sample, or one per token (NeMo-RL's [B, S]).
    #[serde(default)]
    pub advantages: Option<Advantages>,
    /// Logprobs the generator reported (default: equal to prev_logprobs).
    #[serde(default)]
    pub generation_logprobs: Option<Vec<Vec<f32>>>,
    /// Policy logprobs before this update (default: computed by the trainer first).
    #[serde(default)]
    pub prev_logprobs: Option<Vec<Vec<f32>>>,
    /// Reference logprobs (default: computed by the trainer with its reference model).
    #[serde(default)]
    pub reference_logprobs: Option<Vec<Vec<f32>>>,
    /// The critic's values the batch was scored with (PPO; laid out as [`Scorer::Critic`]),
    /// the centres of value clipping.
    #[serde(default)]
    pub values: Option<Vec<Vec<f32>>>,
    /// The critic's targets per token (PPO: the GAE advantage plus the value), laid out like
    /// the logprobs; with them, a trainer with a critic trains it on this batch.
    #[serde(default)]
    pub returns: Option<Vec<Vec<f32>>>,
}

/// A batch's advantages: one per sample (broadcast over its tokens), or one per token, each
/// row as long as its sequence (entry 0 unused, like logprobs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Advantages {
    PerSample(Vec<f32>),
    PerToken(Vec<Vec<f32>>),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainRequest {
    pub run_id: String,
    pub batch: Payload<TrainBatch>,
    #[serde(default = "default_temperature")]
    pub temperature: f64,
}

/// The loss and its metrics on a batch, changing nothing (validation of DPO and reward
/// models): one global batch over the whole of `batch`, no gradients, no optimiser step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvaluateRequest {
    pub run_id: String,
    pub batch: Payload<TrainBatch>,
    #[serde(default = "default_temperature")]
    pub temperature: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvaluateReply {
    /// The loss function's metrics (NeMo-RL names) over the whole batch, and `global_valid_tokens`.
    pub metrics: BTreeMap<String, f64>,
    pub tokens: u64,
    pub timing: Timing,
    pub memory: Memory,
}

/// One optimiser step: the loss function's metrics (NeMo-RL names) plus `lr`, `grad_norm`
/// (before clipping) and `global_valid_tokens`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: u64,
    pub metrics: BTreeMap<String, f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainReply {
    pub steps: Vec<StepMetrics>,
    pub tokens: u64,
    pub timing: Timing,
    pub memory: Memory,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScoreRequest {
    pub run_id: String,
    pub batch: Payload<Sequences>,
}

/// Reward-model scores, one per sequence (the value head on its last token).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScoreReply {
    pub scores: Vec<f32>,
    pub timing: Timing,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SaveRequest {
    pub run_id: String,
    /// Directory to write; it appears complete or not at all (written beside it and renamed).
    pub path: String,
    /// Free-form training info stored in `trainer_state.json` (consumed samples, metrics).
    #[serde(default)]
    pub info: serde_json::Value,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SaveReply {
    pub path: String,
    pub step: u64,
    pub files: Vec<String>,
    pub timing: Timing,
}

/// Exports the policy's weights (never the optimiser's state) for the generators: cast to
/// `dtype`, packed into buckets of at most `bucket_bytes`, left where `to` says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportRequest {
    pub run_id: String,
    /// `f32`, `bf16` or `f16` (what the generators serve); default: the policy's own.
    #[serde(default)]
    pub dtype: Option<String>,
    #[serde(default = "default_bucket_bytes")]
    pub bucket_bytes: u64,
    /// Where the buckets go (default: the object store).
    #[serde(default)]
    pub to: ExportTo,
}

/// Where an export leaves its buckets, as `generation.weight_transfer` chooses (the
/// `directory` transfer saves a checkpoint instead of exporting).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ExportTo {
    /// Objects of the run's bulk bucket in the JetStream object store.
    #[default]
    ObjectStore,
    /// Files under `dir` (shared memory on the trainer's host, e.g.
    /// `/dev/shm/keel-weights/<run>`): the worker keeps the three newest exports there
    /// untouched, reuses the files of the one before for the next export, and deletes older
    /// ones; the directory goes when the run releases the worker.
    SharedMemory { dir: String },
    /// One buffer in the trainer's GPU memory, shared with the generators on the same host
    /// through CUDA IPC: the worker keeps its two newest such exports (a generator may still
    /// be copying the older) and frees them when the run lets it go. Refused on a CPU
    /// trainer.
    CudaIpc,
    /// One buffer in the trainer's memory (its GPU's, or host memory for a CPU trainer), for
    /// generators to receive over a communicator they form with the trainer
    /// ([`SendWeights`]): kept and freed as `cuda_ipc`'s are.
    Collective,
}

/// A generator's request, on [`crate::Subjects::trainer_send_weights`], to receive an
/// export kept for the collective transfer. The trainer answers at once ([`SendAccepted`], or
/// why it will not send); then the two meet on a two-rank communicator, the trainer rank 0
/// and the generator rank 1 — a new one on `<meeting>.<session>` (the bucket's
/// [`crate::generator::CollectiveBuffer::meeting`]: NCCL when the export is in GPU memory and
/// `device` is a GPU, TCP through the trainer when both are on the CPU), or, with `reuse`,
/// the one the two formed under `session` for an earlier transfer and kept — and the trainer
/// broadcasts each range of the export's buffer in order. The export's id is the capability:
/// the trainer sends only an export it keeps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendWeights {
    pub export: String,
    /// One subject token, unique to the pair's communicator.
    pub session: String,
    /// The generator's device: `cpu` or `cuda` (the two sides must agree).
    pub device: String,
    /// `(offset, bytes)` of each bucket to send, in the order they are received.
    pub ranges: Vec<(u64, u64)>,
    /// Send over the communicator kept under `session` (refused with
    /// [`error_types::UNKNOWN_SESSION`] when the trainer keeps none: the generator then asks
    /// for a new one).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reuse: bool,
}

/// The trainer's answer to [`SendWeights`], before it sends: the bytes it will send.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendAccepted {
    pub bytes: u64,
}

fn default_bucket_bytes() -> u64 {
    256 << 20
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportReply {
    pub step: u64,
    pub weights: crate::generator::WeightBuckets,
    pub timing: Timing,
}

/// Colocated runs: the trainer moves its optimiser's state (and, with `weights`, the
/// policy's parameters and gradients) to host memory while the generators have the GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OffloadRequest {
    pub run_id: String,
    #[serde(default)]
    pub weights: bool,
}

/// What an `offload` or `onload` moved, and how long it took.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryMoved {
    /// Bytes moved (rank 0's under tensor parallelism; none on a CPU device).
    pub bytes: u64,
    pub seconds: f64,
}

/// Requests that carry only the run: one type per operation, so that each names its own.
macro_rules! run_only {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct $name {
            pub run_id: String,
        }
    )*};
}

run_only!(
    /// Colocated runs: what `offload` moved, back on the training device.
    OnloadRequest,
);

/// A trainer operation, by its request type: the operation it is sent as and the reply it
/// gets. The orchestrator's calls and the worker's dispatch both go through it, so a request
/// sent as the wrong operation, or a reply read as the wrong type, does not compile.
pub trait TrainerCall: Serialize + serde::de::DeserializeOwned + Send + Sync {
    const OP: crate::subjects::TrainerOp;
    type Reply: Serialize + serde::de::DeserializeOwned + Send;
    fn run_id(&self) -> &str;
}

macro_rules! trainer_calls {
    ($($request:ty => $op:ident, $reply:ty;)*) => {$(
        impl TrainerCall for $request {
            const OP: crate::subjects::TrainerOp = crate::subjects::TrainerOp::$op;
            type Reply = $reply;
            fn run_id(&self) -> &str {
                &self.run_id
            }
        }
    )*};
}

trainer_calls! {
    ClaimRequest => Claim, ClaimReply;
    LoadRequest => Load, LoadReply;
    LogprobsRequest => Logprobs, LogprobsReply;
    TrainRequest => Train, TrainReply;
    EvaluateRequest => Evaluate, EvaluateReply;
    ScoreRequest => Score, ScoreReply;
    SaveRequest => Save, SaveReply;
    ExportRequest => Export, ExportReply;
    OffloadRequest => Offload, MemoryMoved;
    OnloadRequest => Onload, MemoryMoved;
    HeartbeatRequest => Heartbeat, HeartbeatReply;
    ReleaseRequest => Release, Released;
}

/// Seconds spent in each phase of an operation.
pub type Timing = BTreeMap<String, f64>;

/// Memory after an operation, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Memory {
    /// Resident set of the worker process.
    pub rss_bytes: u64,
    /// Peak resident set of the worker process.
    pub peak_rss_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::subjects::TrainerOp;

    /// Every trainer operation is named by exactly one request type.
    #[test]
    fn every_trainer_operation_has_one_request_type() {
        let named = [
            ClaimRequest::OP,
            LoadRequest::OP,
            LogprobsRequest::OP,
            TrainRequest::OP,
            EvaluateRequest::OP,
            ScoreRequest::OP,
            SaveRequest::OP,
            ExportRequest::OP,
            OffloadRequest::OP,
            OnloadRequest::OP,
            HeartbeatRequest::OP,
            ReleaseRequest::OP,
        ];
        for op in TrainerOp::ALL {
            let count = named.iter().filter(|n| **n == op).count();
            assert_eq!(count, 1, "{} is named by {count} request types", op.name());
        }
        assert_eq!(named.len(), TrainerOp::ALL.len());
    }
}
