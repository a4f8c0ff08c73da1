//! The run spec a user submits to the orchestrator (`POST /v1/runs`, YAML or JSON); the
//! runs API's response bodies are in [`crate::runs_api`]. Keys follow NeMo-RL's configs where one exists
//! (`grpo.num_prompts_per_step`, `checkpointing.keep_top_k`, ...). [`RunSpec::problems`]
//! lists every semantic problem at once, each with its field path; shape errors (unknown
//! fields, wrong types) come from the parser with theirs.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::FieldError;
use crate::limits;
use crate::reward::{EnvConfig, OnError};
use crate::training::{LossConfig, OptimizerConfig, TrainingConfig};

// The runs API's bodies live in `runs_api`; they are named here too, where they always were.
pub use crate::runs_api::{MetricSeries, Metrics, Run, RunEvent, RunEventRecord, RunList, RunStatus, Sample, Samples};

/// What a run does: `grpo` (group-relative policy optimisation, with its DAPO, GSPO and
/// REINFORCE++ variants), `sft` (supervised fine-tuning on prompt → answer or chat
/// messages), `dpo` (direct preference optimisation on prompt, chosen and rejected), `rm`
/// (reward-model training, Bradley–Terry, on the same pairs) or `eval` (generation and
/// scoring only, nothing trained: accuracy and pass@k).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Group-relative policy optimisation (and its DAPO / GSPO / REINFORCE variants).
    Grpo,
    /// Supervised fine-tuning on prompt → answer or chat messages.
    Sft,
    /// Direct preference optimisation on (prompt, chosen, rejected).
    Dpo,
    /// Reward-model training (Bradley–Terry) on (prompt, chosen, rejected).
    Rm,
    /// Generation and scoring only: accuracy and pass@k.
    Eval,
}

impl Algorithm {
    pub fn name(self) -> &'static str {
        match self {
            Self::Grpo => "grpo",
            Self::Sft => "sft",
            Self::Dpo => "dpo",
            Self::Rm => "rm",
            Self::Eval => "eval",
        }
    }

    /// The loss the trainer must be configured with.
    pub fn loss_name(self) -> Option<&'static str> {
        match self {
            Self::Grpo => Some("clipped_pg"),
            Self::Sft => Some("nll"),
            Self::Dpo => Some("dpo"),
            Self::Rm => Some("bradley_terry"),
            Self::Eval => None,
        }
    }

    /// Whether the run samples from a generator.
    pub fn generates(self) -> bool {
        matches!(self, Self::Grpo | Self::Eval)
    }
}

/// The starting weights: a Hugging Face directory on the services' shared disk, a model of
/// the Hugging Face cache by its Hub id, or a checkpoint in the checkpoint service (by id).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelRef {
    /// A Hugging Face model directory (with its `config.json`), or LoRA adapters in PEFT's
    /// layout (`adapter_config.json`), on the disk the services share (NeMo-RL's
    /// `policy.model_name` as a path); inside the orchestrator's path roots. Give exactly one
    /// of `path`, `name` and `checkpoint`.
    #[serde(default)]
    pub path: Option<String>,
    /// A Hugging Face model id (`Qwen/Qwen3-0.6B`, NeMo-RL's `policy.model_name`), found in
    /// the Hugging Face cache of the orchestrator's host (`HF_HUB_CACHE`, else `HF_HOME/hub`,
    /// else `~/.cache/huggingface/hub`) as `hf download` leaves it; nothing is downloaded.
    /// Give exactly one of `path`, `name` and `checkpoint`.
    #[serde(default)]
    pub name: Option<String>,
    /// With `name`: the branch, tag or commit of the cached snapshot (default `main`).
    #[serde(default)]
    pub revision: Option<String>,
    /// The id (a UUID) of a committed checkpoint in the checkpoint service, such as one an
    /// earlier run saved. Give exactly one of `path`, `name` and `checkpoint`.
    #[serde(default)]
    pub checkpoint: Option<uuid::Uuid>,
}

/// Which keys of a JSONL record hold what.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct DataKeys {
    /// The key holding the prompt (NeMo-RL's `input_key` or `prompt_key`).
    pub prompt: String,
    /// The key holding the answer: SFT's target, and the ground truth the environments check
    /// (`metadata.ground_truth`) (NeMo-RL's `output_key`).
    pub answer: String,
    /// The key holding a list of `{role, content}` messages: chat SFT trains every assistant
    /// turn; to generate, the messages before the last assistant turn are the prompt.
    pub messages: String,
    /// The key holding the preferred answer, for `dpo` and `rm` (NeMo-RL's `chosen_key`).
    pub chosen: String,
    /// The key holding the other answer, for `dpo` and `rm` (NeMo-RL's `rejected_key`).
    pub rejected: String,
    /// The task name, which picks the environment (`environments.tasks`).
    pub task: String,
}

impl Default for DataKeys {
    fn default() -> Self {
        Self {
            prompt: "prompt".into(),
            answer: "answer".into(),
            messages: "messages".into(),
            chosen: "chosen".into(),
            rejected: "rejected".into(),
            task: "task".into(),
        }
    }
}

/// A dataset file uploaded to the orchestrator (`POST /v1/datasets`): where it is kept, to
/// name in a spec's `data.*.path`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct DatasetUploaded {
    /// The file on the orchestrator's disk, named by its content's SHA-256.
    pub path: String,
    /// The SHA-256 of its bytes, in hex.
    pub sha256: String,
    pub bytes: u64,
}

/// A dataset: a JSONL file, Parquet files (a Hugging Face dataset's directory), or the
/// built-in arithmetic generator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum DatasetSpec {
    /// A JSONL file, one JSON record per line (NeMo-RL's `data_path`).
    Jsonl {
        /// The file, on the disk the services share; inside the orchestrator's path roots.
        path: String,
        /// Which keys of a record hold the prompt, the answer, the messages, the pair and the
        /// task.
        #[serde(default)]
        keys: DataKeys,
    },
    /// Parquet: one file, or a directory laid out as a Hugging Face dataset
    /// (`data/train-00000-of-00002.parquet`, `test/0000.parquet`, ...) read for one split.
    /// Each row is a record, its columns the keys (lists and structs as JSON).
    Parquet {
        /// A `.parquet` file, or a directory searched (recursively) for the split's files;
        /// inside the orchestrator's path roots.
        path: String,
        /// With a directory: the split whose files are read, those named `<split>-*.parquet`,
        /// `<split>.parquet` or lying in a directory named `<split>`, in name order (a
        /// directory with one split needs none).
        #[serde(default)]
        split: Option<String>,
        /// Which columns hold the prompt, the answer, the messages, the pair and the task.
        #[serde(default)]
        keys: DataKeys,
    },
    /// `What is A + B?` problems with exact answers, drawn from `seed`. Preference records
    /// (chosen = the right answer, rejected = an off-by-some one) are made too.
    Arithmetic {
        /// Problems drawn (with replacement) from the split; 0: every problem of the split
        /// once, in an order shuffled by `seed` (for validation and test sets, where each
        /// problem should count once).
        #[serde(default = "default_arithmetic_size")]
        #[schema(maximum = 10_000_000)] // MAX_ARITHMETIC_SIZE
        size: usize,
        /// Operands are drawn from 0..=max_operand.
        #[serde(default = "default_max_operand")]
        #[schema(maximum = 1_000_000_000)] // MAX_ARITHMETIC_OPERAND
        max_operand: u32,
        /// Any of `+`, `-`, `*`.
        #[serde(default = "default_operations")]
        operations: String,
        /// Seeds the problems drawn, their order and the rejected answers (the run's own
        /// `seed` does not change them).
        #[serde(default)]
        seed: u64,
        /// Which part of the problem space: every (a, op, b) problem falls, by a fixed hash,
        /// in `validation` (a quarter), `test` (a quarter) or `train` (the other half);
        /// `held_out` is validation and test together. No problem of one is in another,
        /// whatever the seeds.
        #[serde(default)]
        split: ArithmeticSplit,
    },
}

/// Which part of the arithmetic problem space a dataset draws from: every (a, op, b) problem
/// falls, by a fixed hash, in `train` (half of them), `validation` (a quarter) or `test` (a
/// quarter); `held_out` is `validation` and `test` together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ArithmeticSplit {
    #[default]
    Train,
    HeldOut,
    Validation,
    Test,
}

/// The most problems `size: 0` enumerates (operand pairs times operations).
pub const MAX_ARITHMETIC_ENUMERATED: u64 = 1_000_000;

/// The most records the arithmetic generator makes (they are held in memory).
pub const MAX_ARITHMETIC_SIZE: usize = 10_000_000;
/// The largest arithmetic operand: products stay exact in 64 bits.
pub const MAX_ARITHMETIC_OPERAND: u32 = 1_000_000_000;

fn default_arithmetic_size() -> usize {
    1000
}

fn default_max_operand() -> u32 {
    20
}

fn default_operations() -> String {
    "+-".into()
}

/// The datasets a run reads (NeMo-RL's `data`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DataSpec {
    /// The training set (for `eval`, what is scored when there is no `validation`).
    pub train: DatasetSpec,
    /// Held-out prompts for validation (and what `eval` scores when given).
    #[serde(default)]
    pub validation: Option<DatasetSpec>,
    /// Shuffle the training set every epoch (seeded by the run's seed).
    #[serde(default = "default_true")]
    pub shuffle: bool,
}

/// How a record becomes the prompt the model sees.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct PromptSpec {
    /// A system message put first.
    pub system: Option<String>,
    /// `{prompt}` is replaced by the record's prompt (e.g. `{prompt} Put the answer in \boxed{}.`).
    pub template: String,
    /// Render with the tokenizer's chat template (else the plain text is the prompt).
    pub use_chat_template: bool,
}

impl Default for PromptSpec {
    fn default() -> Self {
        Self { system: None, template: "{prompt}".into(), use_chat_template: true }
    }
}

/// Which environment scores each task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EnvironmentsSpec {
    /// For records without a task, or a task not listed in `tasks`.
    pub default: EnvConfig,
    /// Task name → the environment that scores the records whose task key (`keys.task`)
    /// names it.
    #[serde(default)]
    pub tasks: BTreeMap<String, EnvConfig>,
    /// A sample whose scoring failed: reward 0 (`zero`), left out of training (`skip`), or
    /// the step fails (`fail`).
    #[serde(default)]
    pub on_error: OnError,
}

impl EnvironmentsSpec {
    /// Whether every environment of the run rewards 0 or 1 ([`EnvConfig::binary_rewards`]).
    pub fn binary_rewards(&self) -> bool {
        self.default.binary_rewards() && self.tasks.values().all(EnvConfig::binary_rewards)
    }
}

/// Sampling for rollouts (validation decodes greedily unless `validation.temperature` says).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct GenerationSpec {
    /// Tokens the model may generate per turn, in rollouts, validation and `eval` (NeMo-RL's
    /// `policy.generation.max_new_tokens`); at least 1 and below `max_total_sequence_length`,
    /// to leave room for the prompt.
    pub max_new_tokens: usize,
    /// Sampling temperature of rollouts (NeMo-RL's `policy.generation.temperature`); positive.
    /// The trainer divides its logits by it too, so it scores the distribution sampled from.
    pub temperature: f64,
    /// Nucleus sampling: each token is drawn from the most likely tokens whose probabilities
    /// add up to this (NeMo-RL's `policy.generation.top_p`); in (0, 1], 1 is off.
    pub top_p: f64,
    /// Each token is drawn from the k most likely only (NeMo-RL's
    /// `policy.generation.top_k`); unset: off.
    pub top_k: Option<usize>,
    /// Strings that end the model's turn, kept in its output (NeMo-RL's
    /// `policy.generation.stop_strings`); an environment may set others for its later turns.
    pub stop: Vec<String>,
    /// How a GRPO step's new weights reach the generators: `memory` (the trainer exports the
    /// weights only, in buckets through the object store), `shared_memory` (the same buckets
    /// as files in `/dev/shm` on the trainer's host: for generators on the same host),
    /// `cuda_ipc` (the buckets stay in the trainer's GPU memory and the generators, on the
    /// same host's GPUs, copy them from there through CUDA IPC: the transfer for colocated
    /// runs on a GPU; a CPU trainer refuses it), `collective` (the buckets stay in the
    /// trainer's memory and each generator receives them over a two-rank communicator it
    /// forms with the trainer for the refit: NCCL between GPUs, on one machine or several;
    /// TCP between CPU processes) or `directory` (the trainer saves a whole
    /// checkpoint to the run's directory on the disk the generators share, which they load:
    /// the fallback, and the way it was done before).
    pub weight_transfer: WeightTransfer,
    /// Training and generation taking turns on the same GPUs (NeMo-RL's
    /// `policy.generation.colocated`).
    pub colocated: Colocated,
    /// Generator processes the run holds while it runs (each loads the run's model and
    /// serves only this run; the run waits `queued` until that many are free). Runs that
    /// generate nothing (SFT without generation validation, DPO, RM) hold none.
    pub replicas: usize,
    /// The generators' dtype: `f32`, `bf16` or `f16` (NeMo-RL's
    /// `policy.generation.vllm_cfg.precision`). Default: each generator's own (f32 on the
    /// CPU, bf16 on CUDA).
    pub dtype: Option<String>,
    /// Tokens per sequence the generators hold, prompt included (NeMo-RL's
    /// `policy.generation.vllm_cfg.max_model_len`). Default: `max_total_sequence_length`.
    pub max_model_len: Option<usize>,
    /// Ranks each generator splits the model over (NeMo-RL's
    /// `policy.generation.vllm_cfg.tensor_parallel_size`). Default: each generator's own.
    pub tensor_parallel_size: Option<usize>,
}

/// Colocated training and generation. Each GRPO step the orchestrator sequences the turns:
/// after the rollouts the generators sleep (their KV pools freed; their weights moved to
/// host memory with `generator_offload_weights`) and the trainer moves its state back onto
/// the device; after training the trainer moves its optimiser's state (and its weights with
/// `trainer_offload_weights`) to host memory, the new weights are refit, and the generators
/// wake. Each turn's time is recorded (`timing/train/generator_sleep`, `trainer_onload`,
/// `trainer_offload`, `generator_wake`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct Colocated {
    /// Turn colocation on (NeMo-RL's `policy.generation.colocated.enabled`); not with
    /// `grpo.async_grpo.enabled`.
    pub enabled: bool,
    /// Sleeping generators also move their weights to host memory (else only their KV pools
    /// are freed).
    pub generator_offload_weights: bool,
    /// After training, the trainer also moves its weights and gradients to host memory (else
    /// only its optimiser's state).
    pub trainer_offload_weights: bool,
}

/// How a GRPO step's new weights reach the generators: `memory` (the weights in buckets
/// through the object store), `shared_memory` (the same buckets as files in `/dev/shm` on
/// the trainer's host, for generators on that host), `cuda_ipc` (the buckets stay in the
/// trainer's GPU memory and generators on the same host's GPUs copy them through CUDA IPC;
/// refused with `device: cpu`), `collective` (each generator receives the buckets over a
/// two-rank communicator with the trainer: NCCL between GPUs, TCP between CPU processes) or
/// `directory` (a whole checkpoint saved to the run's directory on the shared disk, which
/// the generators load).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WeightTransfer {
    #[default]
    Memory,
    SharedMemory,
    CudaIpc,
    Collective,
    Directory,
}

impl Default for GenerationSpec {
    fn default() -> Self {
        Self {
            max_new_tokens: 256,
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            stop: Vec::new(),
            weight_transfer: WeightTransfer::Memory,
            colocated: Colocated::default(),
            replicas: 1,
            dtype: None,
            max_model_len: None,
            tensor_parallel_size: None,
        }
    }
}

/// DAPO's dynamic sampling: groups whose rewards all agree carry no signal; they are dropped
/// and more prompts are drawn, up to `max_rounds` generation rounds per step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct DynamicSampling {
    /// Drop the groups whose rewards all agree and draw more prompts in their place
    /// (NeMo-RL's `grpo.use_dynamic_sampling`).
    pub enabled: bool,
    /// Generation rounds per step at most; when they run out, dropped groups fill the step
    /// (NeMo-RL's `grpo.dynamic_sampling_max_gen_batches`). At least 1.
    pub max_rounds: u32,
}

impl Default for DynamicSampling {
    fn default() -> Self {
        Self { enabled: false, max_rounds: 3 }
    }
}

/// DAPO's soft overlong punishment: over the last `buffer` tokens of `max_new_tokens` the
/// reward falls linearly by up to `penalty`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OverlongShaping {
    /// Tokens at the end of `generation.max_new_tokens` over which the penalty grows from 0
    /// (NeMo-RL's `grpo.reward_shaping.overlong_buffer_length`); 1 to
    /// `generation.max_new_tokens`.
    pub buffer: usize,
    /// The most the reward falls, reached at `generation.max_new_tokens` generated tokens
    /// (NeMo-RL's `grpo.reward_shaping.overlong_buffer_penalty`); finite and ≥ 0.
    #[serde(default = "one_f64")]
    pub penalty: f64,
}

fn one_f64() -> f64 {
    1.0
}

/// How rewards become advantages: `grpo` (reward minus the group baseline, divided by the
/// group's standard deviation when `normalize_rewards`) or `reinforce_plus_plus` (REINFORCE++:
/// the group mean subtracted when `normalize_rewards`, then whitened over every valid token
/// of the batch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageEstimator {
    /// Reward minus the group baseline (`use_leave_one_out_baseline`), divided by the group's
    /// std when `normalize_rewards`.
    #[default]
    Grpo,
    /// REINFORCE++: the group mean subtracted (when `normalize_rewards`), then whitened over
    /// every valid token of the batch.
    ReinforcePlusPlus,
}

/// GRPO's settings (NeMo-RL's `grpo`), read by `grpo` runs; `max_rollout_turns` also by
/// validation and `eval`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct GrpoSpec {
    /// Prompts drawn from the training set per step (NeMo-RL's `grpo.num_prompts_per_step`);
    /// at least 1, and `num_prompts_per_step × num_generations_per_prompt` at most 1,048,576.
    pub num_prompts_per_step: usize,
    /// Samples generated per prompt: the group whose rewards the advantages compare
    /// (NeMo-RL's `grpo.num_generations_per_prompt`); 2 to 4096.
    pub num_generations_per_prompt: usize,
    /// How each sample's reward becomes its advantage; `turn_level_advantages` needs `grpo`,
    /// `training.loss.use_kl_in_reward` needs `reinforce_plus_plus`.
    pub advantage_estimator: AdvantageEstimator,
    /// Environment turns per sample (1 = single-turn).
    pub max_rollout_turns: u32,
    /// Multi-turn credit: each assistant turn's tokens get the advantage of the rewards from
    /// that turn on (its reward-to-go), against the group's samples at the same turn, instead
    /// of one advantage for the whole sample (GRPO's estimator; the same as it on one turn).
    pub turn_level_advantages: bool,
    /// Divide by the group's standard deviation (`grpo`) or subtract the group mean
    /// (`reinforce_plus_plus`) (NeMo-RL's `grpo.normalize_rewards`).
    pub normalize_rewards: bool,
    /// `grpo`'s baseline is the mean of the group's other samples, else the mean of the whole
    /// group (NeMo-RL's `grpo.use_leave_one_out_baseline`).
    pub use_leave_one_out_baseline: bool,
    /// Truncated samples are left out of the loss (they still count in the baselines).
    pub overlong_filtering: bool,
    /// DAPO's soft overlong punishment (NeMo-RL's `grpo.reward_shaping`); unset: off.
    pub overlong_shaping: Option<OverlongShaping>,
    /// DAPO's dynamic sampling (NeMo-RL's `grpo.use_dynamic_sampling` and
    /// `grpo.dynamic_sampling_max_gen_batches`).
    pub dynamic_sampling: DynamicSampling,
    /// Rollouts of later steps generated while a step trains (NeMo-RL's `async_grpo`).
    pub async_grpo: AsyncGrpo,
    /// Samples stored per step for `GET /v1/runs/{id}/samples`.
    pub samples_to_record: usize,
}

/// Asynchronous GRPO: the generators roll out the prompts of the next steps on the weights
/// they serve while the trainer trains, so neither waits for the other. A step's
/// trajectories may come from weights up to `max_trajectory_age_steps` updates old (the
/// policy trained at step t is version t−1; a trajectory from version v has age t−1−v);
/// older ones are dropped and counted. New weights reach the generators between requests
/// (`drain`: a sample never mixes versions) or, with `in_flight_weight_updates`, at the next
/// token (running samples continue on the new weights). The importance-sampling options of
/// the loss (`tis`, `icepop`, `seq-mask-tis`) correct with the logprobs recorded at
/// generation. Needs generators of their own: not with `generation.colocated`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct AsyncGrpo {
    /// Turn async GRPO on (NeMo-RL's `grpo.async_grpo.enabled`); not with
    /// `generation.colocated.enabled`.
    pub enabled: bool,
    /// How many weight updates old a trajectory may be when it trains (NeMo-RL's
    /// `grpo.async_grpo.max_trajectory_age_steps`); at least 1.
    pub max_trajectory_age_steps: u64,
    /// New weights take effect at the next token, running samples continuing on them, instead
    /// of between requests (NeMo-RL's `grpo.async_grpo.in_flight_weight_updates`).
    pub in_flight_weight_updates: bool,
}

impl Default for AsyncGrpo {
    fn default() -> Self {
        Self { enabled: false, max_trajectory_age_steps: 1, in_flight_weight_updates: false }
    }
}

impl Default for GrpoSpec {
    fn default() -> Self {
        Self {
            num_prompts_per_step: 32,
            num_generations_per_prompt: 16,
            advantage_estimator: AdvantageEstimator::Grpo,
            max_rollout_turns: 1,
            turn_level_advantages: false,
            normalize_rewards: true,
            use_leave_one_out_baseline: true,
            overlong_filtering: false,
            overlong_shaping: None,
            dynamic_sampling: DynamicSampling::default(),
            async_grpo: AsyncGrpo::default(),
            samples_to_record: 8,
        }
    }
}

/// Validation during a run, and what `eval` does: generation on the held-out prompts, scored
/// by the environments (accuracy or mean reward, pass@k); for `dpo`, `rm` and `sft` without
/// `environments`, the loss on the held-out records instead.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ValidationSpec {
    /// Validate every this many steps (0 = only at the end).
    pub period: u64,
    /// Held-out prompts per validation (0 = all).
    pub num_prompts: usize,
    /// Samples per prompt; pass@k is reported for every k in `pass_at_k` (≤ this).
    pub num_samples: usize,
    /// The k of each pass@k recorded (`validation/pass@k`, or `eval/pass@k`), by the unbiased
    /// estimator; each in 1..=`num_samples`.
    pub pass_at_k: Vec<usize>,
    /// 0 = greedy.
    pub temperature: f64,
}

impl Default for ValidationSpec {
    fn default() -> Self {
        Self { period: 10, num_prompts: 0, num_samples: 1, pass_at_k: vec![1], temperature: 0.0 }
    }
}

/// When checkpoints are saved to the checkpoint service and which are kept (NeMo-RL's
/// `checkpointing`). A run that restarts resumes from its latest checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointingSpec {
    /// Save checkpoints (NeMo-RL's `checkpointing.enabled`); off, a restarted run starts over.
    pub enabled: bool,
    /// Save every this many steps (the last step is always saved).
    pub save_period: u64,
    /// Keep the best k by `metric_name` (and always the latest); unset keeps every one.
    pub keep_top_k: Option<u32>,
    /// The metric retention ranks by (e.g. `validation/accuracy`).
    pub metric_name: Option<String>,
    /// Whether a higher `metric_name` ranks a checkpoint better (NeMo-RL's
    /// `checkpointing.higher_is_better`).
    pub higher_is_better: bool,
}

impl Default for CheckpointingSpec {
    fn default() -> Self {
        Self { enabled: true, save_period: 10, keep_top_k: None, metric_name: None, higher_is_better: true }
    }
}

/// A run: the document `POST /v1/runs` takes, in YAML or JSON. Keys follow NeMo-RL's where
/// one exists; unknown fields are refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunSpec {
    /// A name for the run, shown in run lists, and the loggers' default run name.
    #[serde(default)]
    pub name: Option<String>,
    /// What the run does; it decides the `training.loss.type` the run needs and whether it
    /// needs `environments`.
    pub algorithm: Algorithm,
    /// The starting weights: exactly one of `path`, `name` or `checkpoint`.
    pub model: ModelRef,
    /// The training set and the held-out set.
    pub data: DataSpec,
    /// How a record becomes the prompt the model sees (NeMo-RL's `prompt_file` and
    /// `system_prompt_file`, written inline).
    #[serde(default)]
    pub prompt: PromptSpec,
    /// Needed by `grpo` and `eval`.
    #[serde(default)]
    pub environments: Option<EnvironmentsSpec>,
    /// Loss, optimiser, schedule and batching (every algorithm but `eval`).
    #[serde(default)]
    pub training: Option<TrainingConfig>,
    /// Group sizes, advantages and GRPO's DAPO and async options.
    #[serde(default)]
    pub grpo: GrpoSpec,
    /// On-policy distillation (with `grpo`): a teacher's logprobs on the student's own
    /// samples give every generated token its advantage (NeMo-RL's `distillation`).
    #[serde(default)]
    pub distillation: Option<DistillationSpec>,
    /// PPO (with `grpo`): a critic trained beside the policy, and advantages by generalised
    /// advantage estimation from its values instead of the group baseline.
    #[serde(default)]
    pub ppo: Option<PpoSpec>,
    /// How rollouts are sampled, and how new weights reach the generators.
    #[serde(default)]
    pub generation: GenerationSpec,
    /// Prompt plus everything generated (or the answer, for SFT) is cut to this.
    #[serde(default = "default_max_total_sequence_length")]
    pub max_total_sequence_length: usize,
    /// Steps to run at most (NeMo-RL's `grpo.max_num_steps`, `sft.max_num_steps`,
    /// `dpo.max_num_steps`); at least 1. A step is one global batch for `sft`, `dpo` and `rm`,
    /// and `num_prompts_per_step` prompts' rollouts and their training for `grpo`.
    #[serde(default = "default_max_num_steps")]
    pub max_num_steps: u64,
    /// Passes over the training set at most (NeMo-RL's `*.max_num_epochs`): the run ends when
    /// they are used up, even before `max_num_steps`. At least 1.
    #[serde(default = "default_max_num_epochs")]
    pub max_num_epochs: u64,
    /// When the run validates on `data.validation`, and how.
    #[serde(default)]
    pub validation: ValidationSpec,
    /// When checkpoints are saved and which are kept.
    #[serde(default)]
    pub checkpointing: CheckpointingSpec,
    /// Seeds the training set's order, the sampling of rollouts and validation, and the
    /// trainer's random state (NeMo-RL's `grpo.seed`, `sft.seed`, `dpo.seed`).
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// The trainer's device for this run: `cpu`, `cuda` or `cuda:N` (default: the trainer
    /// worker's configured device).
    #[serde(default)]
    pub device: Option<String>,
    /// The trainer's compute dtype: `f32`, `bf16` or `f16`, master weights and optimiser state
    /// staying f32 (NeMo-RL's `policy.precision`). Default: f32 on the CPU, bf16 on CUDA.
    #[serde(default)]
    pub dtype: Option<String>,
    /// Tensor-parallel ranks the trainer splits the policy and reference over (1: none).
    #[serde(default = "default_parallel_size")]
    pub tensor_parallel_size: usize,
    /// Data-parallel replicas of the trainer (1: none): each trains on its share of every
    /// global batch's rows, gradients are summed over them and the optimiser's state is
    /// sharded over them (ZeRO stage 1). The trainer runs `data_parallel_size ×
    /// tensor_parallel_size` ranks (on CUDA, one GPU each from `device` on).
    #[serde(default = "default_parallel_size")]
    pub data_parallel_size: usize,
    /// Where recorded metrics go besides Keel's own store (NeMo-RL's `logger`).
    #[serde(default)]
    pub logger: LoggerSpec,
}

/// On-policy distillation: the student (the run's `model`) samples with the run's generators
/// as in GRPO; the trainer scores each sample with the teacher too, and token t the student
/// generated gets the advantage −kl_weight · (log π_student(x_t) − log π_teacher(x_t)) (the
/// per-token reverse KL, estimated on the student's own sample) plus reward_weight times the
/// sample's GRPO advantage from its environment's reward. The clipped policy-gradient loss then
/// moves the student towards the teacher where it samples. `train/teacher_kl` is the mean of
/// log π_student − log π_teacher over the generated tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DistillationSpec {
    /// The teacher: exactly one of `path`, `name` or `checkpoint`, with the student's
    /// tokenizer (a teacher with another one is refused); larger than the student or not.
    pub teacher: ModelRef,
    /// The reverse KL's weight in each token's advantage.
    #[serde(default = "default_kl_weight")]
    pub kl_weight: f64,
    /// The task reward's GRPO advantage, weighted and added to every generated token's (0:
    /// distillation alone; the environment's rewards are still recorded).
    #[serde(default)]
    pub reward_weight: f64,
}

fn default_kl_weight() -> f64 {
    1.0
}

/// PPO with a critic. The rollouts are made and scored as in GRPO; then the critic scores
/// each sample's state before every generated token (V_t), each sample's reward is put on its
/// last generated token, and generalised advantage estimation gives every generated token its
/// advantage A_t (δ_t = r_t + γ·V_{t+1} − V_t, A_t = δ_t + γ·λ·A_{t+1}) and the critic its
/// target R_t = A_t + V_t. The advantages are whitened over the batch's generated tokens and
/// train the policy with `training.loss` (clipped policy gradient); the critic is trained on
/// the same batch, `training`'s batch sizes and gradient clipping applying to it too, with the
/// loss ½·(V − R)² (or, with `value_clip`, the larger of that and ½·(clip(V, V_old ± ε) − R)²)
/// averaged over the generated tokens. Prompt and environment tokens are not steps: a
/// multi-turn sample's generated tokens follow each other in one chain. Metrics:
/// `train/value_loss`, `train/value_clip_fraction`, `train/values_mean`, `train/returns_mean`,
/// `train/critic_grad_norm`, `train/critic_lr`, `train/value_explained_variance` (of the
/// returns, by the values before the update).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PpoSpec {
    /// The model the critic starts from (exactly one of `path`, `name` or `checkpoint`); its
    /// value head starts at zero. Default: the run's `model`. A resumed run loads the critic
    /// its checkpoint saved.
    #[serde(default)]
    pub critic: Option<ModelRef>,
    /// The critic's optimiser. Default: `training.optimizer` (its learning rate is not
    /// scheduled).
    #[serde(default)]
    pub optimizer: Option<OptimizerConfig>,
    /// The discount γ per generated token, in [0, 1].
    #[serde(default = "default_gamma")]
    pub gamma: f64,
    /// GAE's λ, in [0, 1]: 1 trains on the discounted reward-to-go, 0 on the one-step target.
    #[serde(default = "default_gae_lambda")]
    pub lambda: f64,
    /// The value-clipping range ε (> 0), in the reward's units; leave it out for none.
    #[serde(default = "default_value_clip")]
    pub value_clip: Option<f64>,
    /// The critic trains alone for this many optimiser steps before the policy is updated
    /// (the policy still samples and is scored).
    #[serde(default)]
    pub critic_warmup_steps: u64,
}

fn default_gamma() -> f64 {
    1.0
}

fn default_gae_lambda() -> f64 {
    0.95
}

fn default_value_clip() -> Option<f64> {
    Some(0.2)
}

/// NeMo-RL's `logger` section: every metric the run records (each step's, and validation's
/// baseline at step 0) also goes to the loggers enabled here.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct LoggerSpec {
    /// The loggers' directory on the orchestrator's disk (inside its path roots); each run
    /// writes under `<log_dir>/<run id>/`. Default: `logs` in the orchestrator's `work_dir`.
    pub log_dir: Option<String>,
    /// TensorBoard event files in `<log_dir>/<run id>/tensorboard/` (one scalar per metric
    /// and step, under the metric's name).
    pub tensorboard_enabled: bool,
    /// An MLflow run (see `mlflow`) with every metric at its step.
    pub mlflow_enabled: bool,
    /// The MLflow run the metrics go to (NeMo-RL's `logger.mlflow`).
    pub mlflow: MlflowSpec,
    /// W&B's offline run files in `<log_dir>/<run id>/wandb/offline-run-<time>-<id>/` (see
    /// `wandb`), as `wandb offline` writes them: `wandb sync <that directory>` uploads them.
    pub wandb_enabled: bool,
    /// The W&B run the offline files make (NeMo-RL's `logger.wandb`).
    pub wandb: WandbSpec,
}

/// NeMo-RL's `logger.wandb`: the W&B run the offline files make when `wandb_enabled`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct WandbSpec {
    /// Default `keel`.
    pub project: Option<String>,
    /// The W&B run's name; default the Keel run's name, else its id.
    pub name: Option<String>,
    /// The team or user (default: the one `wandb sync` logs in as).
    pub entity: Option<String>,
    /// Tags of the W&B run.
    pub tags: Vec<String>,
}

/// NeMo-RL's `logger.mlflow`: where the run's metrics go when `mlflow_enabled`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct MlflowSpec {
    /// The tracking server's URL (`http://host:5000`); required by `mlflow_enabled`.
    pub tracking_uri: Option<String>,
    /// The experiment (made when missing); default `keel`.
    pub experiment_name: Option<String>,
    /// The MLflow run's name; default the Keel run's name, else its id.
    pub run_name: Option<String>,
}

fn default_parallel_size() -> usize {
    1
}

fn default_true() -> bool {
    true
}

fn default_max_total_sequence_length() -> usize {
    512
}

fn default_max_num_steps() -> u64 {
    100
}

fn default_max_num_epochs() -> u64 {
    1
}

fn default_seed() -> u64 {
    42
}

impl ModelRef {
    /// Exactly one of `path`, `name` and `checkpoint`, and a `revision` only with a `name`.
    fn check(&self, field: &str, p: &mut Vec<FieldError>) {
        match (&self.path, &self.name, &self.checkpoint) {
            (Some(path), None, None) => {
                check(p, !path.trim().is_empty(), &format!("{field}.path"), "must not be empty")
            }
            (None, Some(name), None) => {
                check(p, !name.trim().is_empty(), &format!("{field}.name"), "must not be empty")
            }
            (None, None, Some(_)) => {}
            _ => p.push(FieldError::new(field, "give exactly one of `path`, `name` or `checkpoint`")),
        }
        check(
            p,
            self.revision.is_none() || self.name.is_some(),
            &format!("{field}.revision"),
            format!("names a revision of `{field}.name`: give `name` too"),
        );
    }
}

fn check(problems: &mut Vec<FieldError>, ok: bool, field: &str, message: impl Into<String>) {
    if !ok {
        problems.push(FieldError::new(field, message));
    }
}

/// `value` must lie in `range`: "must be A to B, got value" otherwise.
fn check_range<T>(problems: &mut Vec<FieldError>, value: T, range: std::ops::RangeInclusive<T>, field: &str)
where
    T: PartialOrd + std::fmt::Display,
{
    let message = format!("must be {} to {}, got {value}", range.start(), range.end());
    check(problems, range.contains(&value), field, message);
}

/// One part of a run spec checked in the context of the whole spec (some limits depend on
/// another part); what is wrong goes into `p`, each problem with its field's path.
trait Validate {
    fn validate(&self, run: &RunSpec, p: &mut Vec<FieldError>);
}

impl RunSpec {
    /// Every problem of the spec, each with the path of its field: the parts' own checks
    /// ([`Validate`]) and those across parts (the algorithm and its training, parallel
    /// sizes, batch sizes), in the order a reader of the spec meets the fields.
    pub fn problems(&self) -> Vec<FieldError> {
        let mut p = Vec::new();
        let alg = self.algorithm;
        let tp = self.tensor_parallel_size;
        check_range(&mut p, tp, 1..=64, "tensor_parallel_size");
        let dp = self.data_parallel_size;
        check(
            &mut p,
            (1..=64).contains(&dp) && dp * tp <= 64,
            "data_parallel_size",
            format!("must be 1 to 64, with data_parallel_size × tensor_parallel_size at most 64; got {dp} × {tp}"),
        );
        self.logger.validate(self, &mut p);
        self.model.check("model", &mut p);
        if let Some(ppo) = &self.ppo {
            ppo.validate(self, &mut p);
        }
        if let Some(d) = &self.distillation {
            d.validate(self, &mut p);
        }
        match (&self.training, alg.loss_name()) {
            (None, Some(loss)) => p.push(FieldError::new(
                "training",
                format!("required for `{}` (with `loss: {{type: {loss}}}`)", alg.name()),
            )),
            (Some(_), None) => p.push(FieldError::new("training", "`eval` trains nothing: leave it out")),
            (Some(training), Some(loss)) => {
                check(
                    &mut p,
                    training.loss.name() == loss,
                    "training.loss.type",
                    format!("`{}` trains with `{loss}`, not `{}`", alg.name(), training.loss.name()),
                );
                p.extend(training.problems("training"));
                check(
                    &mut p,
                    !(training.lora.enabled && tp > 1),
                    "training.lora.enabled",
                    format!("LoRA trains on one rank: tensor_parallel_size must be 1, got {tp}"),
                );
                self.batch_problems(training, &mut p);
            }
            (None, None) => {}
        }
        if alg.generates() {
            check(&mut p, self.environments.is_some(), "environments", format!("required for `{}`", alg.name()));
            if let Some(envs) = &self.environments {
                envs.validate(self, &mut p);
            }
            self.generation.validate(self, &mut p);
        }
        if alg == Algorithm::Grpo {
            self.grpo.validate(self, &mut p);
        }
        check_range(
            &mut p,
            self.max_total_sequence_length,
            2..=limits::MAX_SEQUENCE_LENGTH,
            "max_total_sequence_length",
        );
        check(&mut p, self.max_num_steps >= 1, "max_num_steps", "must be at least 1");
        check(&mut p, self.max_num_epochs >= 1, "max_num_epochs", "must be at least 1");
        self.prompt.validate(self, &mut p);
        self.validation.validate(self, &mut p);
        self.checkpointing.validate(self, &mut p);
        self.data.validate(self, &mut p);
        p
    }

    fn batch_problems(&self, training: &TrainingConfig, p: &mut Vec<FieldError>) {
        let (global, micro) = (training.global_batch_size, training.micro_batch_size);
        match self.algorithm {
            Algorithm::Grpo => {
                let rows = self.grpo.num_prompts_per_step.saturating_mul(self.grpo.num_generations_per_prompt);
                check(
                    p,
                    global > 0 && rows.is_multiple_of(global.max(1)),
                    "training.global_batch_size",
                    format!(
                        "must divide num_prompts_per_step × num_generations_per_prompt ({rows}) so every sample trains once"
                    ),
                );
            }
            Algorithm::Dpo | Algorithm::Rm => {
                check(
                    p,
                    global % 2 == 0 && micro % 2 == 0,
                    "training.global_batch_size",
                    "pairwise losses take rows in (chosen, rejected) pairs: global and micro batch sizes must be even",
                );
            }
            Algorithm::Sft | Algorithm::Eval => {}
        }
        check(
            p,
            !(self.generation.weight_transfer == WeightTransfer::CudaIpc && self.device.as_deref() == Some("cpu")),
            "generation.weight_transfer",
            "cuda_ipc shares the trainer's GPU memory, and `device` is cpu: use memory or shared_memory",
        );
        let asynchronous = &self.grpo.async_grpo;
        if asynchronous.enabled {
            check(
                p,
                !self.generation.colocated.enabled,
                "grpo.async_grpo.enabled",
                "generates while the trainer trains, which needs generators of their own: turn generation.colocated off",
            );
            check(
                p,
                asynchronous.max_trajectory_age_steps >= 1,
                "grpo.async_grpo.max_trajectory_age_steps",
                "must be at least 1 (0 is synchronous GRPO: turn async_grpo off)",
            );
        }
        check(
            p,
            !self.grpo.turn_level_advantages || self.grpo.advantage_estimator == AdvantageEstimator::Grpo,
            "grpo.turn_level_advantages",
            "credits each turn with GRPO's group baseline: needs grpo.advantage_estimator: grpo",
        );
        if let LossConfig::ClippedPg(c) = &training.loss {
            check(
                p,
                !c.use_kl_in_reward || self.grpo.advantage_estimator == AdvantageEstimator::ReinforcePlusPlus,
                "training.loss.use_kl_in_reward",
                "puts the KL into per-token REINFORCE++ advantages: needs grpo.advantage_estimator: reinforce_plus_plus",
            );
        }
    }
}

impl Validate for LoggerSpec {
    fn validate(&self, _: &RunSpec, p: &mut Vec<FieldError>) {
        if let Some(project) = &self.wandb.project {
            check(p, !project.trim().is_empty(), "logger.wandb.project", "must not be empty (leave it out for `keel`)");
        }
        if self.mlflow_enabled {
            let uri = self.mlflow.tracking_uri.as_deref().unwrap_or_default();
            check(
                p,
                uri.starts_with("http://") || uri.starts_with("https://"),
                "logger.mlflow.tracking_uri",
                format!("mlflow_enabled needs the tracking server's http(s) URL, got `{uri}`"),
            );
        }
        if let Some(dir) = &self.log_dir {
            check(p, !dir.trim().is_empty(), "logger.log_dir", "must not be empty (leave it out for the default)");
        }
    }
}

impl Validate for PpoSpec {
    fn validate(&self, run: &RunSpec, p: &mut Vec<FieldError>) {
        check(p, run.algorithm == Algorithm::Grpo, "ppo", "trains on rollouts: needs algorithm: grpo");
        if let Some(critic) = &self.critic {
            critic.check("ppo.critic", p);
        }
        for (field, value) in [("gamma", self.gamma), ("lambda", self.lambda)] {
            check(p, (0.0..=1.0).contains(&value), &format!("ppo.{field}"), format!("must be in [0, 1], got {value}"));
        }
        if let Some(clip) = self.value_clip {
            check(
                p,
                clip.is_finite() && clip > 0.0,
                "ppo.value_clip",
                format!("must be a finite number > 0 (leave it out for no clipping), got {clip}"),
            );
        }
        if let Some(optimizer) = &self.optimizer {
            p.extend(optimizer.problems("ppo.optimizer"));
        }
        check(p, run.distillation.is_none(), "ppo", "ppo and distillation each make the advantages: choose one");
        check(
            p,
            !run.grpo.turn_level_advantages && run.grpo.advantage_estimator == AdvantageEstimator::Grpo,
            "ppo",
            "makes every token's advantage from the critic: leave grpo.advantage_estimator at grpo and \
             turn_level_advantages off",
        );
        if let Some(training) = &run.training {
            check(
                p,
                !training.lora.enabled,
                "training.lora.enabled",
                "ppo trains the whole policy and critic, not LoRA adapters",
            );
            match &training.loss {
                LossConfig::ClippedPg(c) => check(
                    p,
                    !c.use_kl_in_reward,
                    "training.loss.use_kl_in_reward",
                    "ppo puts only the task reward into its token rewards: keep the KL penalty in the loss",
                ),
                _ => check(p, false, "training.loss.type", "ppo trains the policy with clipped_pg"),
            }
        }
    }
}

impl Validate for DistillationSpec {
    fn validate(&self, run: &RunSpec, p: &mut Vec<FieldError>) {
        check(
            p,
            run.algorithm == Algorithm::Grpo,
            "distillation",
            "distils on the student's samples: needs algorithm: grpo",
        );
        self.teacher.check("distillation.teacher", p);
        for (field, value) in [("kl_weight", self.kl_weight), ("reward_weight", self.reward_weight)] {
            check(
                p,
                value.is_finite() && value >= 0.0,
                &format!("distillation.{field}"),
                format!("must be a finite number ≥ 0, got {value}"),
            );
        }
        check(
            p,
            self.kl_weight > 0.0 || self.reward_weight > 0.0,
            "distillation",
            "kl_weight and reward_weight are both 0",
        );
        check(
            p,
            !run.grpo.turn_level_advantages && run.grpo.advantage_estimator == AdvantageEstimator::Grpo,
            "distillation",
            "gives every token its own advantage: needs grpo.advantage_estimator: grpo and no turn_level_advantages",
        );
        if let Some(training) = &run.training {
            check(
                p,
                !training.lora.enabled,
                "training.lora.enabled",
                "distillation trains the whole student, not LoRA adapters",
            );
            if let LossConfig::ClippedPg(c) = &training.loss {
                check(
                    p,
                    c.reference_policy_kl_penalty == 0.0 && !c.use_kl_in_reward,
                    "training.loss.reference_policy_kl_penalty",
                    "with distillation the teacher takes the reference's place: leave the KL penalty at 0",
                );
            }
        }
    }
}

impl Validate for EnvironmentsSpec {
    fn validate(&self, _: &RunSpec, p: &mut Vec<FieldError>) {
        let named = std::iter::once(("environments.default".to_string(), &self.default))
            .chain(self.tasks.iter().map(|(task, env)| (format!("environments.tasks.{task}"), env)));
        for (field, env) in named {
            let problems = match env {
                EnvConfig::Http(http) => http.problems(),
                EnvConfig::Agent(agent) => agent.problems(),
                _ => Vec::new(),
            };
            p.extend(problems.into_iter().map(|e| FieldError::new(format!("{field}.{}", e.field), e.message)));
        }
    }
}

impl Validate for GenerationSpec {
    fn validate(&self, run: &RunSpec, p: &mut Vec<FieldError>) {
        check(p, self.max_new_tokens >= 1, "generation.max_new_tokens", "must be at least 1");
        check(
            p,
            self.max_new_tokens < run.max_total_sequence_length,
            "generation.max_new_tokens",
            format!(
                "must leave room for the prompt below max_total_sequence_length ({})",
                run.max_total_sequence_length
            ),
        );
        check(
            p,
            self.temperature.is_finite() && self.temperature > 0.0,
            "generation.temperature",
            format!("must be positive for sampling, got {}", self.temperature),
        );
        check(
            p,
            self.top_p > 0.0 && self.top_p <= 1.0,
            "generation.top_p",
            format!("must be in (0, 1], got {}", self.top_p),
        );
        check_range(p, self.replicas, 1..=limits::MAX_GENERATOR_REPLICAS, "generation.replicas");
        check(
            p,
            self.stop.len() <= limits::MAX_STOP_STRINGS,
            "generation.stop",
            format!("at most {} stop strings, got {}", limits::MAX_STOP_STRINGS, self.stop.len()),
        );
        check(
            p,
            self.stop.iter().all(|s| !s.is_empty() && s.len() <= limits::MAX_STOP_STRING_BYTES),
            "generation.stop",
            format!("each stop string must be 1 to {} bytes", limits::MAX_STOP_STRING_BYTES),
        );
        if let Some(dtype) = &self.dtype {
            check(
                p,
                ["f32", "bf16", "f16"].contains(&dtype.as_str()),
                "generation.dtype",
                format!("must be f32, bf16 or f16, got `{dtype}`"),
            );
        }
        if let Some(len) = self.max_model_len {
            check(
                p,
                len >= run.max_total_sequence_length,
                "generation.max_model_len",
                format!(
                    "must hold a whole sequence: at least max_total_sequence_length ({}), got {len}",
                    run.max_total_sequence_length
                ),
            );
        }
        if let Some(tp) = self.tensor_parallel_size {
            check_range(p, tp, 1..=64, "generation.tensor_parallel_size");
        }
    }
}

impl Validate for GrpoSpec {
    fn validate(&self, run: &RunSpec, p: &mut Vec<FieldError>) {
        check(p, self.num_prompts_per_step >= 1, "grpo.num_prompts_per_step", "must be at least 1");
        check(
            p,
            (2..=limits::MAX_GENERATIONS_PER_PROMPT).contains(&self.num_generations_per_prompt),
            "grpo.num_generations_per_prompt",
            format!(
                "must be at least 2 (advantages compare samples of one prompt) and at most {}, got {}",
                limits::MAX_GENERATIONS_PER_PROMPT,
                self.num_generations_per_prompt
            ),
        );
        let samples = self.num_prompts_per_step.checked_mul(self.num_generations_per_prompt);
        check(
            p,
            samples.is_some_and(|n| n <= limits::MAX_SAMPLES_PER_STEP),
            "grpo.num_prompts_per_step",
            format!(
                "num_prompts_per_step × num_generations_per_prompt must be at most {} samples per step",
                limits::MAX_SAMPLES_PER_STEP
            ),
        );
        check_range(p, self.max_rollout_turns, 1..=limits::MAX_ROLLOUT_TURNS, "grpo.max_rollout_turns");
        if let Some(shaping) = &self.overlong_shaping {
            check(
                p,
                shaping.buffer >= 1 && shaping.buffer <= run.generation.max_new_tokens,
                "grpo.overlong_shaping.buffer",
                format!("must be in 1..=generation.max_new_tokens ({})", run.generation.max_new_tokens),
            );
            check(
                p,
                shaping.penalty.is_finite() && shaping.penalty >= 0.0,
                "grpo.overlong_shaping.penalty",
                "must be finite and ≥ 0",
            );
        }
        check(p, self.dynamic_sampling.max_rounds >= 1, "grpo.dynamic_sampling.max_rounds", "must be at least 1");
    }
}

impl Validate for PromptSpec {
    fn validate(&self, _: &RunSpec, p: &mut Vec<FieldError>) {
        check(p, self.template.contains("{prompt}"), "prompt.template", "must contain `{prompt}`");
    }
}

impl Validate for ValidationSpec {
    fn validate(&self, _: &RunSpec, p: &mut Vec<FieldError>) {
        check_range(p, self.num_samples, 1..=limits::MAX_VALIDATION_SAMPLES, "validation.num_samples");
        for (i, k) in self.pass_at_k.iter().enumerate() {
            check(
                p,
                *k >= 1 && *k <= self.num_samples,
                &format!("validation.pass_at_k[{i}]"),
                format!("must be in 1..=validation.num_samples ({}), got {k}", self.num_samples),
            );
        }
        check(
            p,
            self.temperature.is_finite() && self.temperature >= 0.0,
            "validation.temperature",
            "must be finite and ≥ 0",
        );
    }
}

impl Validate for CheckpointingSpec {
    fn validate(&self, _: &RunSpec, p: &mut Vec<FieldError>) {
        if self.enabled {
            check(p, self.save_period >= 1, "checkpointing.save_period", "must be at least 1");
            if let Some(k) = self.keep_top_k {
                check(p, k >= 1, "checkpointing.keep_top_k", "must be at least 1 (leave it out to keep all)");
                check(
                    p,
                    self.metric_name.is_some(),
                    "checkpointing.metric_name",
                    "keep_top_k ranks checkpoints by a metric: name it",
                );
            }
        }
    }
}

impl Validate for DataSpec {
    fn validate(&self, _: &RunSpec, p: &mut Vec<FieldError>) {
        for (field, dataset) in
            std::iter::once(("data.train", &self.train)).chain(self.validation.iter().map(|d| ("data.validation", d)))
        {
            match dataset {
                DatasetSpec::Jsonl { path, .. } | DatasetSpec::Parquet { path, .. } => {
                    check(p, !path.trim().is_empty(), &format!("{field}.path"), "must not be empty")
                }
                DatasetSpec::Arithmetic { size, operations, max_operand, .. } => {
                    check(
                        p,
                        *max_operand <= MAX_ARITHMETIC_OPERAND,
                        &format!("{field}.max_operand"),
                        format!("must be at most {MAX_ARITHMETIC_OPERAND}, got {max_operand}"),
                    );
                    check(
                        p,
                        *size <= MAX_ARITHMETIC_SIZE,
                        &format!("{field}.size"),
                        format!("must be 0 (every problem of the split) to {MAX_ARITHMETIC_SIZE}, got {size}"),
                    );
                    // Saturating: `max_operand` may be any u32, whose square overflows a u64.
                    let problems =
                        (u64::from(*max_operand) + 1).saturating_pow(2).saturating_mul(operations.len().max(1) as u64);
                    check(
                        p,
                        *size > 0 || problems <= MAX_ARITHMETIC_ENUMERATED,
                        &format!("{field}.size"),
                        format!(
                            "0 lists every problem, and max_operand {max_operand} makes {problems} (at most \
                             {MAX_ARITHMETIC_ENUMERATED}): give a size"
                        ),
                    );
                    check(
                        p,
                        !operations.is_empty() && operations.chars().all(|c| "+-*".contains(c)),
                        &format!("{field}.operations"),
                        format!("must be made of `+`, `-` and `*`, got `{operations}`"),
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grpo() -> RunSpec {
        serde_json::from_value(serde_json::json!({
            "algorithm": "grpo",
            "model": {"path": "/m"},
            "data": {"train": {"kind": "arithmetic"}},
            "environments": {"default": {"name": "math"}},
            "training": {"loss": {"type": "clipped_pg"}, "global_batch_size": 64, "micro_batch_size": 8},
            "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 8},
            "checkpointing": {"metric_name": "validation/accuracy"},
        }))
        .unwrap()
    }

    #[test]
    fn a_sound_spec_has_no_problems() {
        assert_eq!(grpo().problems(), vec![]);
    }

    #[test]
    fn ppo_defaults_and_what_it_refuses_by_field() {
        let mut spec = grpo();
        spec.ppo = Some(serde_json::from_value(serde_json::json!({})).unwrap());
        assert_eq!(spec.problems(), vec![]);
        let ppo = spec.ppo.clone().unwrap();
        assert_eq!((ppo.gamma, ppo.lambda, ppo.value_clip, ppo.critic_warmup_steps), (1.0, 0.95, Some(0.2), 0));
        let fields = |spec: &RunSpec| spec.problems().into_iter().map(|p| p.field).collect::<Vec<_>>();
        let mut bad = spec.clone();
        bad.ppo = Some(PpoSpec {
            gamma: 1.5,
            lambda: -0.1,
            value_clip: Some(0.0),
            optimizer: Some(OptimizerConfig { lr: 0.0, ..Default::default() }),
            ..ppo.clone()
        });
        assert_eq!(fields(&bad), ["ppo.gamma", "ppo.lambda", "ppo.value_clip", "ppo.optimizer.lr"]);
        let mut bad = spec.clone();
        bad.grpo.turn_level_advantages = true;
        assert_eq!(fields(&bad), ["ppo"]);
        // The critic is split over tensor-parallel ranks as the policy is.
        let mut split = spec.clone();
        split.tensor_parallel_size = 2;
        assert_eq!(split.problems(), vec![]);
        let mut bad = spec.clone();
        bad.algorithm = Algorithm::Sft;
        assert!(fields(&bad).contains(&"ppo".to_string()), "{:?}", bad.problems());
    }

    /// The largest operand the schema allows (`u32::MAX`) is refused by name, not by an
    /// overflow (the fuzzer sent it once the document gave `u32`'s true range).
    #[test]
    fn the_largest_operand_is_refused_without_overflow() {
        let mut spec = grpo();
        spec.data.train = DatasetSpec::Arithmetic {
            size: 0,
            max_operand: u32::MAX,
            operations: "+-*".into(),
            seed: 0,
            split: ArithmeticSplit::Train,
        };
        let fields: Vec<String> = spec.problems().into_iter().map(|p| p.field).collect();
        assert_eq!(fields, ["data.train.max_operand", "data.train.size"]);
        // The document states the same limits.
        let schema = serde_json::to_value(<DatasetSpec as utoipa::PartialSchema>::schema()).unwrap();
        let variants = schema["oneOf"].as_array().unwrap();
        let arithmetic =
            &variants.iter().find(|v| v["properties"]["kind"]["enum"][0] == "arithmetic").unwrap()["properties"];
        assert_eq!(arithmetic["max_operand"]["maximum"], MAX_ARITHMETIC_OPERAND, "{schema}");
        assert_eq!(arithmetic["size"]["maximum"], MAX_ARITHMETIC_SIZE, "{schema}");
    }

    /// An `http` environment's URL and bounds are checked at submit, under its field path.
    #[test]
    fn http_environments_are_checked_at_submit() {
        let mut spec = grpo();
        let http = |url: &str, timeout_ms: u64| {
            EnvConfig::Http(crate::reward::HttpRewardConfig { url: url.into(), timeout_ms, ..Default::default() })
        };
        let envs = spec.environments.as_mut().unwrap();
        envs.default = http("reward.example/score", 10_000);
        envs.tasks.insert("poems".into(), http("ftp://reward.example/score", 0));
        envs.tasks.insert("proofs".into(), http("https://reward.example/score", 10_000));
        let fields: Vec<String> = spec.problems().into_iter().map(|p| p.field).collect();
        assert_eq!(
            fields,
            ["environments.default.url", "environments.tasks.poems.url", "environments.tasks.poems.timeout_ms"]
        );
    }

    #[test]
    fn kl_in_the_reward_needs_reinforce_plus_plus() {
        let mut spec = grpo();
        let Some(TrainingConfig { loss: LossConfig::ClippedPg(loss), .. }) = spec.training.as_mut() else {
            unreachable!()
        };
        loss.use_kl_in_reward = true;
        let fields: Vec<String> = spec.problems().into_iter().map(|p| p.field).collect();
        assert_eq!(fields, ["training.loss.use_kl_in_reward"]);
        spec.grpo.advantage_estimator = AdvantageEstimator::ReinforcePlusPlus;
        assert_eq!(spec.problems(), vec![]);
    }

    /// Async GRPO generates while the trainer trains: it cannot share the GPUs with it.
    #[test]
    fn async_grpo_refuses_colocated_generation_and_an_age_of_zero() {
        let mut spec = grpo();
        spec.grpo.async_grpo.enabled = true;
        assert_eq!(spec.problems(), vec![]);
        spec.generation.colocated.enabled = true;
        spec.grpo.async_grpo.max_trajectory_age_steps = 0;
        let fields: Vec<String> = spec.problems().into_iter().map(|p| p.field).collect();
        assert_eq!(fields, ["grpo.async_grpo.enabled", "grpo.async_grpo.max_trajectory_age_steps"]);
    }

    /// CUDA IPC shares GPU memory: a run on the CPU is told to choose another transfer.
    #[test]
    fn cuda_ipc_refuses_a_cpu_trainer() {
        let mut spec = grpo();
        spec.generation = serde_json::from_value(serde_json::json!({"weight_transfer": "cuda_ipc"})).unwrap();
        assert_eq!(spec.problems(), vec![]);
        spec.device = Some("cpu".into());
        let problems = spec.problems();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(problems[0].field, "generation.weight_transfer");
        assert!(problems[0].message.contains("cuda_ipc"), "{problems:?}");
    }

    /// NeMo-RL's logger keys: TensorBoard, MLflow and W&B on, a bad MLflow URL or W&B
    /// project refused, LoRA refused with tensor parallelism.
    #[test]
    fn logger_and_lora_settings_are_checked() {
        let mut spec = grpo();
        spec.logger = serde_json::from_value(serde_json::json!({
            "log_dir": "logs", "tensorboard_enabled": true, "mlflow_enabled": false, "wandb_enabled": true,
            "wandb": {"project": "arithmetic", "name": "first", "tags": ["grpo"]},
        }))
        .unwrap();
        assert_eq!(spec.problems(), vec![]);
        spec.logger.mlflow_enabled = true;
        spec.logger.mlflow.tracking_uri = Some("http://127.0.0.1:5000".into());
        assert_eq!(spec.problems(), vec![]);
        spec.logger.mlflow.tracking_uri = Some("127.0.0.1:5000".into());
        spec.logger.wandb.project = Some(" ".into());
        spec.logger.log_dir = Some(" ".into());
        spec.tensor_parallel_size = 2;
        spec.training.as_mut().unwrap().lora.enabled = true;
        let fields: Vec<String> = spec.problems().into_iter().map(|p| p.field).collect();
        assert_eq!(
            fields,
            ["logger.wandb.project", "logger.mlflow.tracking_uri", "logger.log_dir", "training.lora.enabled"]
        );
    }

    /// Validation reports accuracy only where every environment rewards right or wrong.
    #[test]
    fn binary_rewards_come_from_the_environments() {
        let mut envs = grpo().environments.unwrap();
        assert!(envs.binary_rewards());
        envs.tasks.insert("code".into(), EnvConfig::Code(Default::default()));
        assert!(!envs.binary_rewards(), "code gives partial credit unless all_or_nothing");
        let all_or_nothing = crate::reward::CodeConfig { all_or_nothing: true, ..Default::default() };
        envs.tasks.insert("code".into(), EnvConfig::Code(all_or_nothing));
        assert!(envs.binary_rewards());
        envs.default = EnvConfig::Http(Default::default());
        assert!(!envs.binary_rewards());
    }

    #[test]
    fn every_problem_is_listed_with_its_field() {
        let mut spec = grpo();
        spec.grpo.num_generations_per_prompt = 1;
        spec.training.as_mut().unwrap().global_batch_size = 3;
        spec.validation.pass_at_k = vec![4];
        spec.model = ModelRef { path: None, name: None, revision: None, checkpoint: None };
        let fields: Vec<String> = spec.problems().into_iter().map(|p| p.field).collect();
        assert_eq!(
            fields,
            [
                "model",
                "training.micro_batch_size",
                "training.global_batch_size",
                "grpo.num_generations_per_prompt",
                "validation.pass_at_k[0]"
            ]
        );
    }

    #[test]
    fn the_loss_must_match_the_algorithm() {
        let mut spec = grpo();
        spec.algorithm = Algorithm::Sft;
        let problems = spec.problems();
        assert_eq!(problems[0].field, "training.loss.type");
        assert!(problems[0].message.contains("nll"), "{problems:?}");
    }
}
