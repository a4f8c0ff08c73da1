//! What a trainer is configured with for a run: the loss, the optimiser, the learning-rate
//! schedule and the batching. Names and defaults follow NeMo-RL's configuration, so
//! a NeMo-RL user recognises every key. [`TrainingConfig::validate`] refuses bad combinations
//! when the run is configured, listing every problem with its field path, so nothing fails
//! mid-run.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::FieldError;

/// The loss a run trains with (`{"type": "clipped_pg", ...}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LossConfig {
    /// GRPO / PPO family: clipped policy gradient with a KL penalty to the reference.
    ClippedPg(ClippedPgConfig),
    /// Supervised fine-tuning: negative log-likelihood of the loss-masked tokens.
    Nll,
    /// Direct preference optimisation on (chosen, rejected) pairs.
    Dpo(DpoConfig),
    /// Reward model: Bradley–Terry on a scalar value head.
    BradleyTerry,
}

impl LossConfig {
    pub fn name(&self) -> &'static str {
        match self {
            Self::ClippedPg(_) => "clipped_pg",
            Self::Nll => "nll",
            Self::Dpo(_) => "dpo",
            Self::BradleyTerry => "bradley_terry",
        }
    }

    /// Losses whose batches hold (chosen, rejected) pairs in consecutive rows.
    pub fn is_pairwise(&self) -> bool {
        matches!(self, Self::Dpo(_) | Self::BradleyTerry)
    }

    /// Whether training needs reference-policy logprobs.
    pub fn needs_reference(&self) -> bool {
        match self {
            Self::ClippedPg(c) => c.reference_policy_kl_penalty != 0.0,
            Self::Dpo(_) => true,
            Self::Nll | Self::BradleyTerry => false,
        }
    }
}

/// Which estimator of KL(policy ‖ reference) the penalty uses, per token with
/// log r = log(ref / policy): `k1` (−log r), `k2` ((log r)² / 2) or `k3` (r − 1 − log r).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum KlType {
    K1,
    K2,
    #[default]
    K3,
}

/// How the importance weight exp(prev − gen) is truncated: `tis` clamps it to [min, max],
/// `icepop` zeroes it outside [min, max], `seq-mask-tis` drops whole sequences whose
/// exp(mean(prev − gen)) is outside [min, max].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub enum TruncationType {
    /// Clamp the weight to [min, max].
    #[serde(rename = "tis")]
    Tis,
    /// Zero the weight outside [min, max].
    #[serde(rename = "icepop")]
    Icepop,
    /// Drop whole sequences whose exp(mean(prev − gen)) is outside [min, max].
    #[serde(rename = "seq-mask-tis")]
    SeqMaskTis,
}

/// GRPO's loss: the clipped policy gradient (PPO's surrogate on the ratio of the policy to
/// the policy before the update) with a KL penalty to the reference policy; NeMo-RL's
/// `loss_fn` options and defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ClippedPgConfig {
    /// ε_low: the ratio is clamped below at 1 − ε_low.
    pub ratio_clip_min: f64,
    /// ε_high: the ratio is clamped above at 1 + ε_high.
    pub ratio_clip_max: f64,
    /// Dual-clip constant c > 1 (None = off).
    pub ratio_clip_c: Option<f64>,
    /// β of the KL penalty (0 = no reference needed).
    pub reference_policy_kl_penalty: f64,
    /// The KL penalty goes into the per-token advantages (REINFORCE++: A_t − β·KL_t of the
    /// policy before the update against the reference) instead of the loss.
    pub use_kl_in_reward: bool,
    /// The per-token KL estimator (NeMo-RL's `loss_fn.reference_policy_kl_type`).
    pub reference_policy_kl_type: KlType,
    /// Clamp of log(ref / policy) before the estimator (None = no clamp).
    pub kl_input_clamp_value: Option<f64>,
    /// Clamp of the per-token KL value (None = no clamp).
    pub kl_output_clamp_value: Option<f64>,
    /// Weight each token's loss by exp(prev − gen), the trainer's logprob before the update
    /// against the generator's: corrects their mismatch, and async GRPO's older trajectories
    /// (NeMo-RL's `loss_fn.use_importance_sampling_correction`).
    pub use_importance_sampling_correction: bool,
    /// How that weight is truncated; unset: not at all. Needs
    /// `use_importance_sampling_correction`.
    pub truncated_importance_sampling_type: Option<TruncationType>,
    /// The truncation's lower bound; required by `icepop` and `seq-mask-tis` (`tis` takes 0
    /// without it); finite, ≥ 0 and at most `truncated_importance_sampling_ratio_max`.
    pub truncated_importance_sampling_ratio_min: Option<f64>,
    /// The truncation's upper bound; required by every truncation type; finite and ≥ 0.
    pub truncated_importance_sampling_ratio_max: Option<f64>,
    /// Token-level loss (mean over all valid tokens) or sequence-level (mean of per-sequence means).
    pub token_level_loss: bool,
    /// GSPO: one ratio per sequence, exp(mean over its tokens of lp − prev).
    pub sequence_level_importance_ratios: bool,
    /// REINFORCE: ℓ = −A·lp, no ratio and no clipping.
    pub disable_ppo_ratio: bool,
    /// r = exp(lp − stopgrad(lp)): value 1, policy-gradient gradient.
    pub force_on_policy_ratio: bool,
    /// CISPO (MiniMax-M1): ℓ = −A · stopgrad(clamp(r, 1 − ε_low, 1 + ε_high)) · lp. The ratio
    /// is clipped as a weight, not as the update: every token keeps its gradient.
    pub cispo: bool,
}

impl Default for ClippedPgConfig {
    fn default() -> Self {
        Self {
            ratio_clip_min: 0.2,
            ratio_clip_max: 0.2,
            ratio_clip_c: None,
            reference_policy_kl_penalty: 0.01,
            use_kl_in_reward: false,
            reference_policy_kl_type: KlType::K3,
            kl_input_clamp_value: Some(20.0),
            kl_output_clamp_value: Some(10.0),
            use_importance_sampling_correction: false,
            truncated_importance_sampling_type: None,
            truncated_importance_sampling_ratio_min: None,
            truncated_importance_sampling_ratio_max: None,
            token_level_loss: true,
            sequence_level_importance_ratios: false,
            disable_ppo_ratio: false,
            force_on_policy_ratio: false,
            cispo: false,
        }
    }
}

/// DPO on (chosen, rejected) pairs in consecutive rows: −log σ(β·(r_chosen − r_rejected)),
/// r being an answer's log-probability under the policy minus under the reference, plus an
/// optional SFT term on the chosen answers; NeMo-RL's `dpo` options and defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct DpoConfig {
    /// β.
    pub reference_policy_kl_penalty: f64,
    /// Implicit reward as the per-token mean of lp − ref instead of the sum.
    pub preference_average_log_probs: bool,
    /// Weight of the SFT term: the negative log-likelihood of each chosen answer, averaged
    /// over the valid pairs.
    pub sft_loss_weight: f64,
    /// The SFT term takes each chosen answer's per-token mean NLL instead of its sum
    /// (NeMo-RL's default is the sum).
    pub sft_average_log_probs: bool,
    /// Weight of the preference loss (NeMo-RL's `dpo.preference_loss_weight`); finite and ≥ 0,
    /// and not 0 together with `sft_loss_weight`.
    pub preference_loss_weight: f64,
}

impl Default for DpoConfig {
    fn default() -> Self {
        Self {
            reference_policy_kl_penalty: 0.05,
            preference_average_log_probs: false,
            sft_loss_weight: 0.0,
            sft_average_log_probs: false,
            preference_loss_weight: 1.0,
        }
    }
}

/// AdamW (decoupled weight decay; norms and biases are not decayed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerConfig {
    /// The learning rate, which the scheduler scales (NeMo-RL's
    /// `policy.optimizer.kwargs.lr`); positive.
    pub lr: f64,
    /// Adam's β1 and β2: the decay rates of the running means of the gradient and of its
    /// square; each in [0, 1).
    pub betas: [f64; 2],
    /// Adam's ε, added to the denominator for numerical stability; positive.
    pub eps: f64,
    /// Decoupled weight decay (NeMo-RL's `policy.optimizer.kwargs.weight_decay`); finite and
    /// ≥ 0.
    pub weight_decay: f64,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self { lr: 5e-6, betas: [0.9, 0.999], eps: 1e-8, weight_decay: 0.01 }
    }
}

/// What the learning rate does after warm-up: `constant` (stays at `lr`), `cosine` (falls
/// along half a cosine to `min_lr_ratio × lr` at `total_steps`) or `linear` (falls in a
/// straight line to it); it stays there after `total_steps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Decay {
    #[default]
    Constant,
    Cosine,
    Linear,
}

/// Linear warm-up from `warmup_start_factor × lr` over `warmup_steps`, then `decay` to
/// `min_lr_ratio × lr` at `total_steps` (needed by cosine and linear).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Optimiser steps of linear warm-up, 0 for none (the `total_iters` of NeMo-RL's
    /// `LinearLR` warm-up).
    pub warmup_steps: u64,
    /// The warm-up's first learning rate, as a fraction of `lr` (the `start_factor` of
    /// NeMo-RL's `LinearLR` warm-up); in (0, 1].
    pub warmup_start_factor: f64,
    /// The decay after warm-up; `cosine` and `linear` need `total_steps`.
    pub decay: Decay,
    /// The optimiser step at which the decay reaches `min_lr_ratio × lr`; required by
    /// `cosine` and `linear`, and above `warmup_steps`.
    pub total_steps: Option<u64>,
    /// The learning rate the decay ends at, as a fraction of `lr`; in [0, 1].
    pub min_lr_ratio: f64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self { warmup_steps: 0, warmup_start_factor: 0.1, decay: Decay::Constant, total_steps: None, min_lr_ratio: 0.0 }
    }
}

/// How the trainer trains: the loss, the optimiser, the learning-rate schedule and the
/// batching. Required by every algorithm but `eval`, refused for `eval`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TrainingConfig {
    /// The loss, by `type`: `clipped_pg` for `grpo`, `nll` for `sft`, `dpo` for `dpo`,
    /// `bradley_terry` for `rm` (NeMo-RL's `loss_fn`, and the loss options of its `dpo`).
    pub loss: LossConfig,
    /// AdamW's settings (NeMo-RL's `policy.optimizer`).
    #[serde(default)]
    pub optimizer: OptimizerConfig,
    /// The learning-rate schedule (NeMo-RL's `policy.scheduler`).
    #[serde(default)]
    pub scheduler: SchedulerConfig,
    /// Gradient-norm clipping (None = off).
    #[serde(default = "default_max_grad_norm")]
    pub max_grad_norm: Option<f64>,
    /// Samples per optimiser step (rows; for pairwise losses, 2 per pair).
    pub global_batch_size: usize,
    /// Samples per forward/backward pass.
    pub micro_batch_size: usize,
    /// NeMo-RL's `sequence_packing`: the sequences of a global batch packed end to end into
    /// microbatches of up to `train_mb_tokens` tokens (first-fit decreasing), each sequence
    /// attending to itself with its own positions; losses and their normalisation unchanged.
    #[serde(default)]
    pub sequence_packing: TokenBatching,
    /// NeMo-RL's `dynamic_batching`: sequences sorted by length and cut into padded
    /// microbatches of up to `train_mb_tokens` tokens (rows × their longest).
    #[serde(default)]
    pub dynamic_batching: TokenBatching,
    /// LoRA (NeMo-RL's `lora_cfg`, PEFT's `LoraConfig`): low-rank adapters on the chosen
    /// linear layers train while the base model stays frozen.
    #[serde(default, skip_serializing_if = "LoraConfig::is_off")]
    pub lora: LoraConfig,
}

/// The linear layers of a decoder layer that LoRA can adapt, by their Hugging Face names.
pub const LORA_TARGETS: [&str; 7] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

/// The fused projections of Phi-3 and GLM-4 checkpoints, by their Hugging Face names, and the
/// [`LORA_TARGETS`] each stands for: naming one targets its parts.
pub const FUSED_LORA_TARGETS: [(&str, &[&str]); 2] =
    [("qkv_proj", &["q_proj", "k_proj", "v_proj"]), ("gate_up_proj", &["gate_proj", "up_proj"])];

/// Low-rank adapters: every targeted linear `y = W·x` becomes `y = W·x + s·B·A·dropout(x)`
/// with A [rank, in] (Kaiming-uniform at the start), B [out, rank] (zeros, so training starts
/// from the base model) and `s = alpha / rank` (`alpha / √rank` with `use_rslora`). Only A and
/// B train and sit in the optimiser; the reference policy is the base model itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct LoraConfig {
    /// Train LoRA adapters instead of the whole model (NeMo-RL's `lora_cfg.enabled`); needs
    /// `tensor_parallel_size: 1`, and not for `rm`.
    pub enabled: bool,
    /// The adapters' rank (NeMo-RL's `dim`, PEFT's `r`).
    #[serde(alias = "dim", alias = "r")]
    pub rank: i64,
    /// The scale's numerator (PEFT's `lora_alpha`).
    #[serde(alias = "lora_alpha")]
    pub alpha: f64,
    /// Dropout on the adapters' input while training (PEFT's `lora_dropout`).
    #[serde(alias = "lora_dropout")]
    pub dropout: f64,
    /// Which linear layers get adapters (names from `q_proj`, `k_proj`, `v_proj`, `o_proj`,
    /// `gate_proj`, `up_proj`, `down_proj`, and `qkv_proj` and `gate_up_proj`, which name their
    /// parts); empty means all of them (NeMo-RL's `match_all_linear`).
    pub target_modules: Vec<String>,
    /// Rank-stabilised scaling `alpha / √rank` (PEFT's `use_rslora`).
    pub use_rslora: bool,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self { enabled: false, rank: 8, alpha: 32.0, dropout: 0.0, target_modules: Vec::new(), use_rslora: false }
    }
}

impl LoraConfig {
    pub fn is_off(&self) -> bool {
        !self.enabled
    }

    /// The factor `s` of `s·B·A`.
    pub fn scale(&self) -> f64 {
        if self.use_rslora { self.alpha / (self.rank as f64).sqrt() } else { self.alpha / self.rank as f64 }
    }

    /// Whether adapters made with `other` are the same shape and scale as these (dropout,
    /// which only training uses, may differ).
    pub fn same_adapters(&self, other: &LoraConfig) -> bool {
        (self.rank, self.alpha, self.use_rslora, self.targets())
            == (other.rank, other.alpha, other.use_rslora, other.targets())
    }

    /// The targeted module names, in [`LORA_TARGETS`] order (all of them when none are named;
    /// a fused name stands for its parts).
    pub fn targets(&self) -> Vec<&'static str> {
        let named = |t: &str| {
            self.target_modules
                .iter()
                .any(|m| m == t || FUSED_LORA_TARGETS.iter().any(|(fused, parts)| m == fused && parts.contains(&t)))
        };
        LORA_TARGETS.into_iter().filter(|t| self.target_modules.is_empty() || named(t)).collect()
    }

    /// Every problem of an enabled configuration, with its field path under `at`.
    pub fn problems(&self, at: &str) -> Vec<FieldError> {
        let mut problems = Vec::new();
        self.validate(at, &mut problems);
        problems
    }

    fn validate(&self, at: &str, problems: &mut Vec<FieldError>) {
        if !self.enabled {
            return;
        }
        let field = |name: &str| format!("{at}.{name}");
        check(
            problems,
            (1..=4096).contains(&self.rank),
            &field("rank"),
            format!("must be 1 to 4096, got {}", self.rank),
        );
        check(problems, finite_positive(self.alpha), &field("alpha"), format!("must be positive, got {}", self.alpha));
        check(
            problems,
            (0.0..1.0).contains(&self.dropout),
            &field("dropout"),
            format!("must be in [0, 1), got {}", self.dropout),
        );
        for (i, name) in self.target_modules.iter().enumerate() {
            let known = LORA_TARGETS.contains(&name.as_str()) || FUSED_LORA_TARGETS.iter().any(|(f, _)| f == name);
            check(
                problems,
                known,
                &field(&format!("target_modules[{i}]")),
                format!(
                    "`{name}` is not a linear layer LoRA can adapt (one of {}, qkv_proj, gate_up_proj)",
                    LORA_TARGETS.join(", ")
                ),
            );
        }
    }
}

/// Microbatches made by a token budget instead of `micro_batch_size` rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TokenBatching {
    /// Make the microbatches by this token budget (NeMo-RL's `policy.sequence_packing.enabled`
    /// or `policy.dynamic_batching.enabled`). `sequence_packing` and `dynamic_batching`
    /// exclude each other, and `bradley_terry` takes only `dynamic_batching`.
    pub enabled: bool,
    /// Tokens per training microbatch.
    pub train_mb_tokens: usize,
    /// Tokens per microbatch of the logprob passes (the policy's before the update, the
    /// reference's); 0 takes `train_mb_tokens`.
    pub logprob_mb_tokens: usize,
}

impl Default for TokenBatching {
    fn default() -> Self {
        Self { enabled: false, train_mb_tokens: 4096, logprob_mb_tokens: 0 }
    }
}

impl OptimizerConfig {
    /// Every problem, each with its field path under `at` (e.g. `training.optimizer`).
    pub fn problems(&self, at: &str) -> Vec<FieldError> {
        let mut problems = Vec::new();
        let field = |name: &str| format!("{at}.{name}");
        check(&mut problems, finite_positive(self.lr), &field("lr"), format!("must be positive, got {}", self.lr));
        for (i, b) in self.betas.iter().enumerate() {
            check(
                &mut problems,
                (0.0..1.0).contains(b),
                &field(&format!("betas[{i}]")),
                format!("must be in [0, 1), got {b}"),
            );
        }
        check(&mut problems, finite_positive(self.eps), &field("eps"), format!("must be positive, got {}", self.eps));
        check(
            &mut problems,
            self.weight_decay.is_finite() && self.weight_decay >= 0.0,
            &field("weight_decay"),
            format!("must be finite and ≥ 0, got {}", self.weight_decay),
        );
        problems
    }
}

impl TrainingConfig {
    /// The token budget microbatches are made by, when one is on: (budget for training,
    /// budget for logprob passes, packed or padded).
    pub fn token_budget(&self) -> Option<(usize, usize, bool)> {
        let on = [(&self.sequence_packing, true), (&self.dynamic_batching, false)];
        on.into_iter().find(|(b, _)| b.enabled).map(|(b, packed)| {
            let logprobs = if b.logprob_mb_tokens == 0 { b.train_mb_tokens } else { b.logprob_mb_tokens };
            (b.train_mb_tokens, logprobs, packed)
        })
    }
}

fn default_max_grad_norm() -> Option<f64> {
    Some(1.0)
}

fn check(problems: &mut Vec<FieldError>, ok: bool, field: &str, message: impl Into<String>) {
    if !ok {
        problems.push(FieldError::new(field, message));
    }
}

fn finite_positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

impl ClippedPgConfig {
    fn validate(&self, at: &str, problems: &mut Vec<FieldError>) {
        let field = |name: &str| format!("{at}.{name}");
        for (name, eps) in [("ratio_clip_min", self.ratio_clip_min), ("ratio_clip_max", self.ratio_clip_max)] {
            check(problems, eps.is_finite() && eps >= 0.0, &field(name), format!("must be finite and ≥ 0, got {eps}"));
        }
        check(
            problems,
            self.ratio_clip_min < 1.0 || !self.ratio_clip_min.is_finite(),
            &field("ratio_clip_min"),
            format!("must be below 1 (the lower clip is 1 − ratio_clip_min), got {}", self.ratio_clip_min),
        );
        if let Some(c) = self.ratio_clip_c {
            check(
                problems,
                c.is_finite() && c > 1.0,
                &field("ratio_clip_c"),
                format!("dual clip needs c > 1, got {c}"),
            );
        }
        let beta = self.reference_policy_kl_penalty;
        check(
            problems,
            beta.is_finite() && beta >= 0.0,
            &field("reference_policy_kl_penalty"),
            format!("must be finite and ≥ 0, got {beta}"),
        );
        for (name, clamp) in
            [("kl_input_clamp_value", self.kl_input_clamp_value), ("kl_output_clamp_value", self.kl_output_clamp_value)]
        {
            if let Some(v) = clamp {
                check(problems, finite_positive(v), &field(name), format!("must be positive, got {v}"));
            }
        }
        let (min, max) = (self.truncated_importance_sampling_ratio_min, self.truncated_importance_sampling_ratio_max);
        if let Some(kind) = self.truncated_importance_sampling_type {
            check(
                problems,
                self.use_importance_sampling_correction,
                &field("truncated_importance_sampling_type"),
                "needs use_importance_sampling_correction: true",
            );
            let needs_min = !matches!(kind, TruncationType::Tis);
            check(
                problems,
                max.is_some(),
                &field("truncated_importance_sampling_ratio_max"),
                "is required by truncated_importance_sampling_type",
            );
            check(
                problems,
                !needs_min || min.is_some(),
                &field("truncated_importance_sampling_ratio_min"),
                "is required by icepop and seq-mask-tis",
            );
        } else if min.is_some() || max.is_some() {
            problems.push(FieldError::new(
                field("truncated_importance_sampling_type"),
                "truncation bounds are set but no truncation type (tis, icepop or seq-mask-tis)",
            ));
        }
        for (name, bound) in
            [("truncated_importance_sampling_ratio_min", min), ("truncated_importance_sampling_ratio_max", max)]
        {
            if let Some(v) = bound {
                check(problems, v.is_finite() && v >= 0.0, &field(name), format!("must be finite and ≥ 0, got {v}"));
            }
        }
        if let (Some(lo), Some(hi)) = (min, max) {
            check(
                problems,
                lo <= hi,
                &field("truncated_importance_sampling_ratio_min"),
                format!("min {lo} is greater than max {hi}"),
            );
        }
        check(
            problems,
            !(self.sequence_level_importance_ratios && self.token_level_loss),
            &field("sequence_level_importance_ratios"),
            "GSPO (sequence-level ratios) needs token_level_loss: false",
        );
        let exclusive =
            [self.sequence_level_importance_ratios, self.disable_ppo_ratio, self.force_on_policy_ratio, self.cispo];
        check(
            problems,
            exclusive.iter().filter(|&&x| x).count() <= 1,
            &field("disable_ppo_ratio"),
            "sequence_level_importance_ratios, disable_ppo_ratio, force_on_policy_ratio and cispo exclude each other",
        );
        check(
            problems,
            !(self.cispo && self.ratio_clip_c.is_some()),
            &field("ratio_clip_c"),
            "CISPO clips the ratio as a weight: dual clip (ratio_clip_c) does not apply; leave it unset",
        );
    }
}

impl DpoConfig {
    fn validate(&self, at: &str, problems: &mut Vec<FieldError>) {
        let beta = self.reference_policy_kl_penalty;
        check(
            problems,
            finite_positive(beta),
            &format!("{at}.reference_policy_kl_penalty"),
            format!("β must be positive, got {beta}"),
        );
        for (name, w) in
            [("sft_loss_weight", self.sft_loss_weight), ("preference_loss_weight", self.preference_loss_weight)]
        {
            check(
                problems,
                w.is_finite() && w >= 0.0,
                &format!("{at}.{name}"),
                format!("must be finite and ≥ 0, got {w}"),
            );
        }
        check(
            problems,
            self.sft_loss_weight > 0.0 || self.preference_loss_weight > 0.0,
            &format!("{at}.preference_loss_weight"),
            "sft_loss_weight and preference_loss_weight are both 0: nothing to train",
        );
    }
}

impl TrainingConfig {
    /// Every problem, each with its field path under `at` (e.g. `training`).
    pub fn problems(&self, at: &str) -> Vec<FieldError> {
        let mut problems = Vec::new();
        let field = |name: &str| format!("{at}.{name}");
        match &self.loss {
            LossConfig::ClippedPg(c) => c.validate(&field("loss"), &mut problems),
            LossConfig::Dpo(c) => c.validate(&field("loss"), &mut problems),
            LossConfig::Nll | LossConfig::BradleyTerry => {}
        }
        problems.extend(self.optimizer.problems(&field("optimizer")));
        let s = &self.scheduler;
        check(
            &mut problems,
            s.warmup_start_factor.is_finite() && s.warmup_start_factor > 0.0 && s.warmup_start_factor <= 1.0,
            &field("scheduler.warmup_start_factor"),
            format!("must be in (0, 1], got {}", s.warmup_start_factor),
        );
        check(
            &mut problems,
            (0.0..=1.0).contains(&s.min_lr_ratio),
            &field("scheduler.min_lr_ratio"),
            format!("must be in [0, 1], got {}", s.min_lr_ratio),
        );
        match (s.decay, s.total_steps) {
            (Decay::Constant, _) => {}
            (_, None) => {
                problems.push(FieldError::new(field("scheduler.total_steps"), "is required by cosine and linear decay"))
            }
            (_, Some(total)) => check(
                &mut problems,
                total > s.warmup_steps,
                &field("scheduler.total_steps"),
                format!("must exceed warmup_steps ({}), got {total}", s.warmup_steps),
            ),
        }
        if let Some(norm) = self.max_grad_norm {
            check(
                &mut problems,
                finite_positive(norm),
                &field("max_grad_norm"),
                format!("must be positive, got {norm}"),
            );
        }
        let (global, micro) = (self.global_batch_size, self.micro_batch_size);
        let most = crate::limits::MAX_SAMPLES_PER_STEP;
        check(
            &mut problems,
            (1..=most).contains(&global),
            &field("global_batch_size"),
            format!("must be 1 to {most}, got {global}"),
        );
        check(&mut problems, micro >= 1, &field("micro_batch_size"), "must be at least 1");
        check(
            &mut problems,
            micro <= global,
            &field("micro_batch_size"),
            format!("{micro} is larger than global_batch_size {global}"),
        );
        check(
            &mut problems,
            !(self.sequence_packing.enabled && self.dynamic_batching.enabled),
            &field("dynamic_batching.enabled"),
            "sequence_packing and dynamic_batching exclude each other",
        );
        check(
            &mut problems,
            !(self.sequence_packing.enabled && matches!(self.loss, LossConfig::BradleyTerry)),
            &field("sequence_packing.enabled"),
            "bradley_terry scores each sequence's last token with a value head: use dynamic_batching",
        );
        for (name, b) in [("sequence_packing", &self.sequence_packing), ("dynamic_batching", &self.dynamic_batching)] {
            check(
                &mut problems,
                (1..=crate::limits::MAX_SEQUENCE_LENGTH * 64).contains(&b.train_mb_tokens),
                &field(&format!("{name}.train_mb_tokens")),
                format!("must be 1 to {}, got {}", crate::limits::MAX_SEQUENCE_LENGTH * 64, b.train_mb_tokens),
            );
            check(
                &mut problems,
                b.logprob_mb_tokens <= crate::limits::MAX_SEQUENCE_LENGTH * 64,
                &field(&format!("{name}.logprob_mb_tokens")),
                format!("must be at most {}, got {}", crate::limits::MAX_SEQUENCE_LENGTH * 64, b.logprob_mb_tokens),
            );
        }
        self.lora.validate(&field("lora"), &mut problems);
        check(
            &mut problems,
            !(self.lora.enabled && matches!(self.loss, LossConfig::BradleyTerry)),
            &field("lora.enabled"),
            "LoRA trains adapters of the language model; a reward model's value head needs full training",
        );
        if self.loss.is_pairwise() {
            for (name, n) in [("global_batch_size", global), ("micro_batch_size", micro)] {
                check(
                    &mut problems,
                    n % 2 == 0,
                    &field(name),
                    format!("{} pairs (chosen, rejected) by rows, so it must be even, got {n}", self.loss.name()),
                );
            }
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(loss: serde_json::Value) -> TrainingConfig {
        serde_json::from_value(serde_json::json!({
            "loss": loss, "global_batch_size": 8, "micro_batch_size": 2,
        }))
        .unwrap()
    }

    #[test]
    fn defaults_follow_nemo_rl_and_are_valid() {
        let c = config(serde_json::json!({"type": "clipped_pg"}));
        let LossConfig::ClippedPg(pg) = &c.loss else { panic!() };
        assert_eq!((pg.ratio_clip_min, pg.ratio_clip_max, pg.reference_policy_kl_penalty), (0.2, 0.2, 0.01));
        assert_eq!((pg.kl_input_clamp_value, pg.kl_output_clamp_value), (Some(20.0), Some(10.0)));
        assert_eq!(c.max_grad_norm, Some(1.0));
        assert!(c.problems("training").is_empty(), "{:?}", c.problems("training"));
        let dpo = config(serde_json::json!({"type": "dpo"}));
        assert!(matches!(&dpo.loss, LossConfig::Dpo(d) if d.reference_policy_kl_penalty == 0.05));
    }

    #[test]
    fn every_bad_combination_is_listed_with_its_field() {
        let c = config(serde_json::json!({
            "type": "clipped_pg",
            "ratio_clip_c": 1.0,
            "sequence_level_importance_ratios": true,
            "use_importance_sampling_correction": true,
            "truncated_importance_sampling_type": "icepop",
            "truncated_importance_sampling_ratio_min": 2.0,
            "truncated_importance_sampling_ratio_max": 0.5,
        }));
        let fields: Vec<String> = c.problems("training").into_iter().map(|p| p.field).collect();
        assert_eq!(
            fields,
            [
                "training.loss.ratio_clip_c",
                "training.loss.truncated_importance_sampling_ratio_min",
                "training.loss.sequence_level_importance_ratios",
            ]
        );
        // CISPO clips its weight alone: no dual clip, and not with another ratio option.
        let c = config(serde_json::json!({"type": "clipped_pg", "cispo": true, "ratio_clip_c": 3.0}));
        let text = crate::join_problems(&c.problems("t"));
        assert!(text.contains("t.loss.ratio_clip_c: CISPO clips the ratio as a weight"), "{text}");
        let c = config(serde_json::json!({"type": "clipped_pg", "cispo": true, "disable_ppo_ratio": true}));
        let text = crate::join_problems(&c.problems("t"));
        assert!(text.contains("force_on_policy_ratio and cispo exclude each other"), "{text}");
        assert!(config(serde_json::json!({"type": "clipped_pg", "cispo": true})).problems("t").is_empty());
        let mut c = config(serde_json::json!({"type": "dpo"}));
        c.micro_batch_size = 3;
        c.global_batch_size = 2;
        c.scheduler.decay = Decay::Cosine;
        let text = crate::join_problems(&c.problems("t"));
        assert!(text.contains("t.micro_batch_size: 3 is larger"), "{text}");
        assert!(text.contains("t.micro_batch_size: dpo pairs"), "{text}");
        assert!(text.contains("t.scheduler.total_steps: is required"), "{text}");
    }

    #[test]
    fn lora_follows_nemo_rl_and_peft_names_and_refuses_bad_settings() {
        let mut c: TrainingConfig = serde_json::from_value(serde_json::json!({
            "loss": {"type": "nll"}, "global_batch_size": 2, "micro_batch_size": 1,
            "lora": {"enabled": true, "dim": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]},
        }))
        .unwrap();
        assert!(c.problems("t").is_empty());
        assert_eq!((c.lora.rank, c.lora.scale(), c.lora.targets()), (16, 2.0, vec!["q_proj", "v_proj"]));
        c.lora.use_rslora = true;
        assert_eq!(c.lora.scale(), 8.0);
        assert_eq!(LoraConfig::default().targets().len(), 7);
        c.lora = LoraConfig {
            enabled: true,
            rank: 0,
            alpha: -1.0,
            dropout: 1.0,
            target_modules: vec!["lm_head".into()],
            use_rslora: false,
        };
        c.loss = LossConfig::BradleyTerry;
        let text = crate::join_problems(&c.problems("t"));
        for expected in [
            "t.lora.rank: must be 1 to 4096, got 0",
            "t.lora.alpha: must be positive",
            "t.lora.dropout: must be in [0, 1)",
            "t.lora.target_modules[0]: `lm_head` is not a linear layer",
            "t.lora.enabled: LoRA trains adapters",
        ] {
            assert!(text.contains(expected), "{expected} in {text}");
        }
        let off = serde_json::to_value(config(serde_json::json!({"type": "nll"}))).unwrap();
        assert!(off.get("lora").is_none(), "a run without LoRA says nothing of it: {off}");
    }

    #[test]
    fn unknown_losses_and_keys_are_refused_by_name() {
        let err = serde_json::from_value::<TrainingConfig>(serde_json::json!({
            "loss": {"type": "ppo2"}, "global_batch_size": 1, "micro_batch_size": 1,
        }))
        .unwrap_err()
        .to_string();
        assert!(err.contains("ppo2"), "{err}");
        let err = serde_json::from_value::<TrainingConfig>(serde_json::json!({
            "loss": {"type": "clipped_pg", "ratio_clip": 0.1}, "global_batch_size": 1, "micro_batch_size": 1,
        }))
        .unwrap_err()
        .to_string();
        assert!(err.contains("ratio_clip"), "{err}");
    }
}
