//! A generator's claim by a run and its load of the run's model (on the generator's own
//! subjects, `<prefix>.generator.<id>.<op>`), then the run's rollout requests
//! (`<prefix>.run.<run>.generate`, queue group of the generators the run holds) and the
//! weights-updated event each of them hears (`<prefix>.run.<run>.weights`). Token ids in,
//! token ids, logprobs and finish reasons out; the reply names the weight version that
//! served it.

use serde::{Deserialize, Serialize};

/// Sampling settings (temperature 0 = greedy; seed for sample i is seed + i).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Sampling {
    pub temperature: f64,
    pub top_p: f64,
    /// None = off.
    pub top_k: Option<usize>,
    pub min_p: f64,
    pub seed: Option<u64>,
}

impl Default for Sampling {
    fn default() -> Self {
        Self { temperature: 1.0, top_p: 1.0, top_k: None, min_p: 0.0, seed: None }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutRequest {
    pub run_id: String,
    /// The oldest weight version the run accepts (a generator on an older one refuses with
    /// `stale_weights`).
    #[serde(default)]
    pub min_weight_version: u64,
    pub prompt_token_ids: Vec<i64>,
    #[serde(default = "one")]
    pub n: usize,
    pub max_tokens: usize,
    #[serde(default)]
    pub sampling: Sampling,
    /// Extra stop tokens (eos ids stop too unless `ignore_eos`).
    #[serde(default)]
    pub stop_token_ids: Vec<i64>,
    #[serde(default)]
    pub stop: Vec<String>,
    #[serde(default)]
    pub include_stop_str_in_output: bool,
    #[serde(default)]
    pub ignore_eos: bool,
    /// Names one logical request across its retries: a generator that is still working on
    /// a request with this id answers the retry with that work's reply instead of starting
    /// it again (the retry after a lost reply, or one sent to the same replica).
    #[serde(default)]
    pub request_id: Option<String>,
}

fn one() -> usize {
    1
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutSample {
    pub token_ids: Vec<i64>,
    /// Logprob of each token under the distribution it was sampled from (after temperature,
    /// before top-k/top-p/min-p).
    pub logprobs: Vec<f32>,
    /// `stop`, `length` or `abort`.
    pub finish_reason: String,
    /// The stop string that ended the sample, if one did.
    pub stop_reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutReply {
    pub weight_version: u64,
    pub samples: Vec<RolloutSample>,
}

/// Stable error codes of a generator's replies.
pub mod error_types {
    pub use crate::lease::error_types::{BUSY, STALE_HOLDER, WRONG_RUN};
    pub const INVALID_REQUEST: &str = "invalid_request";
    /// The run's model could not be loaded (the loader's reason follows).
    pub const LOAD_FAILED: &str = "load_failed";
    pub const STALE_WEIGHTS: &str = "stale_weights";
    /// The run's weights of the version asked for were refused by this generator (another
    /// architecture or shape): waiting will not help.
    pub const REFIT_FAILED: &str = "refit_failed";
    pub const UNAVAILABLE: &str = "unavailable";
}

/// Load the run's model on a generator the run holds, replacing what it served (its
/// start-up model, or nothing). The generator serves it on the run's subjects, and on its
/// OpenAI API under `served_model_name`, until the run releases it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadModel {
    pub run_id: String,
    /// A Hugging Face directory inside the generator's path roots: the run's model, or the
    /// checkpoint it resumes from.
    pub path: String,
    /// The weight version the directory stands for (the step a resumed run starts after).
    #[serde(default)]
    pub version: u64,
    /// The name its OpenAI API serves the model under (default: the run's id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_model_name: Option<String>,
    /// `f32`, `bf16` or `f16` (default: the generator's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// Tokens per sequence, prompt included (default: the generator's own, or the model's
    /// context up to 4096).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<usize>,
    /// Ranks the model is split over (default: the generator's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor_parallel_size: Option<usize>,
}

/// What a generator loaded for a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelLoaded {
    pub generator_id: String,
    pub served_model_name: String,
    pub dtype: String,
    pub max_model_len: usize,
    pub tensor_parallel_size: usize,
    /// Blocks of the KV cache.
    pub kv_blocks: usize,
    pub seconds: f64,
    /// The OpenAI API's base URL as the generator advertises it (`…/v1`), for agents.
    #[serde(default)]
    pub base_url: String,
}

/// An operation on a generator's own subjects, by its request type: the operation it is sent
/// as and the reply it gets.
pub trait GeneratorCall: Serialize + serde::de::DeserializeOwned + Send + Sync {
    const OP: crate::subjects::GeneratorOp;
    type Reply: Serialize + serde::de::DeserializeOwned + Send;
    fn run_id(&self) -> &str;
}

macro_rules! generator_calls {
    ($($request:ty => $op:ident, $reply:ty;)*) => {$(
        impl GeneratorCall for $request {
            const OP: crate::subjects::GeneratorOp = crate::subjects::GeneratorOp::$op;
            type Reply = $reply;
            fn run_id(&self) -> &str {
                &self.run_id
            }
        }
    )*};
}

generator_calls! {
    crate::lease::ClaimRequest => Claim, crate::lease::ClaimReply;
    LoadModel => Load, ModelLoaded;
    crate::lease::HeartbeatRequest => Heartbeat, crate::lease::HeartbeatReply;
    crate::lease::ReleaseRequest => Release, crate::lease::Released;
    crate::agent::AgentSessionOpen => AgentOpen, crate::agent::AgentSessionOpened;
    crate::agent::AgentSessionClose => AgentClose, crate::agent::AgentTrajectory;
}

/// New policy weights to serve, at `version`: from memory (`weights`, a weights-only export
/// in buckets) or from a HF directory (`path`: a run's base model or the checkpoint it
/// resumes from).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightsUpdated {
    pub run_id: String,
    pub version: u64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<WeightBuckets>,
    /// How this refit treats samples already running; unset: the generator's own
    /// `refit_mode`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refit_mode: Option<RefitMode>,
}

/// How a refit treats the samples a generator is running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefitMode {
    /// Admit nothing new until the running samples finish, then swap the weights: no sample
    /// mixes weight versions.
    #[default]
    Drain,
    /// Swap at the next token boundary; running samples continue on the new weights.
    Pause,
}

/// A generator's answer to a [`WeightsUpdated`] published with a reply subject: the
/// version it now serves (or why it could not load it) and how long the refit took, from the
/// event's arrival (fetching the buckets included) to the new weights serving.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightsLoaded {
    pub run_id: String,
    pub version: u64,
    pub seconds: f64,
    /// The dtype the generator serves in: later exports are cast to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Colocated training and generation: the orchestrator has the generators give the GPU to
/// the trainer (`sleep`: the KV pool freed once running samples finish, the weights moved to
/// host memory with `offload_weights`) and take it back (`wake`). Published with a reply
/// subject; each generator answers with a [`MemoryReport`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryChange {
    pub run_id: String,
    pub action: MemoryAction,
    #[serde(default)]
    pub offload_weights: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryAction {
    Sleep,
    Wake,
}

impl MemoryAction {
    pub fn verb(self) -> &'static str {
        match self {
            Self::Sleep => "sleep",
            Self::Wake => "wake",
        }
    }
}

/// A generator's answer to a [`MemoryChange`]: how long it took (a sleep waits for the
/// running samples) and the bytes freed or taken back, or why it failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryReport {
    pub seconds: f64,
    pub bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A model's parameters, exported weights only, as raw little-endian tensor bytes in
/// buckets of at most a bucket size each: objects of the JetStream object store, or files in
/// shared memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightBuckets {
    /// `f32`, `bf16` or `f16`: every tensor's dtype.
    pub dtype: String,
    pub buckets: Vec<WeightBucket>,
    /// Set when the tensors are a LoRA run's adapters (`<module>.lora_A.weight` and
    /// `….lora_B.weight`) instead of the weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<AdapterRefit>,
}

/// What a generator needs to serve a LoRA run's adapters: it serves `W + s·B·A` for every
/// targeted weight `W` of the base model, keeping the base weights to merge each new version
/// of the adapters into.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdapterRefit {
    /// `s` (`alpha / rank`, or `alpha / √rank` with rsLoRA).
    pub scale: f64,
    /// The model directory the adapters sit on, as the trainer loaded it (an adapter
    /// directory there stands for its base with its own adapters merged).
    pub base: String,
}

/// One buffer of packed tensors, wherever the export left it ([`BucketAt`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightBucket {
    pub at: BucketAt,
    /// Its size in bytes (the sum of its tensors').
    pub bytes: u64,
    pub tensors: Vec<PackedTensor>,
}

/// Where a bucket's bytes are: an object of the JetStream object store, a file in shared
/// memory (`/dev/shm`) when trainer and generators are on one host, a range of the trainer's
/// GPU memory shared through CUDA IPC (generators on the same host's GPUs), or a range of a
/// buffer the trainer keeps and sends over a communicator (the collective transfer).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BucketAt {
    Object(crate::ObjectRef),
    File(String),
    CudaIpc(CudaIpcBuffer),
    Collective(CollectiveBuffer),
}

impl BucketAt {
    pub fn object(&self) -> Option<&crate::ObjectRef> {
        match self {
            Self::Object(object) => Some(object),
            _ => None,
        }
    }

    pub fn cuda_ipc(&self) -> Option<&CudaIpcBuffer> {
        match self {
            Self::CudaIpc(buffer) => Some(buffer),
            _ => None,
        }
    }

    pub fn collective(&self) -> Option<&CollectiveBuffer> {
        match self {
            Self::Collective(buffer) => Some(buffer),
            _ => None,
        }
    }
}

/// A bucket in the GPU memory of the trainer's process, for a process on the same host to
/// map (CUDA IPC): the allocation's handle, where the bucket starts in it, and on which GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CudaIpcBuffer {
    /// `cuIpcGetMemHandle`'s handle of the allocation, 64 bytes in hex.
    pub handle: String,
    /// The bucket's offset in the allocation.
    pub offset: u64,
    /// The UUID of the GPU the allocation is on, in hex.
    pub device_uuid: String,
    /// The exporting process: CUDA opens no handle in the process that made it, so that
    /// process reads the bucket at `address`, its address there.
    pub pid: u32,
    pub address: u64,
}

/// A bucket kept in the trainer's memory for the collective transfer: which export, where
/// the bucket starts in it, and where to ask for it (see
/// [`crate::trainer::SendWeights`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollectiveBuffer {
    /// The export's id (every bucket of one export has the same).
    pub export: String,
    pub offset: u64,
    /// The subject the trainer takes [`crate::trainer::SendWeights`] on.
    pub subject: String,
    /// The subject prefix the two sides meet under (the session's token is appended).
    pub meeting: String,
    /// Where the export is: `cpu` or `cuda`.
    pub device: String,
    /// The UUID of the trainer's GPU, in hex, when the export is on one: NCCL joins
    /// processes on different GPUs only, so a generator on that same GPU says so instead of
    /// failing in NCCL (CUDA IPC is the transfer for it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_uuid: Option<String>,
}

/// Where a tensor is in its bucket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PackedTensor {
    /// The Hugging Face parameter name.
    pub name: String,
    pub shape: Vec<i64>,
    pub offset: u64,
    pub bytes: u64,
}
