//! Pure math the orchestrator needs between rollouts and training, as NeMo-RL computes it
//! (the definitions are written out in ARCHITECTURE.md, "What Keel computes").
//!
//! Layout:
//! - [`advantages`]: per-prompt baselines and std (mean or leave-one-out), GRPO advantages
//!   (per sample, or per turn with each turn's reward-to-go),
//!   REINFORCE++ whitening (per sample, or per token with the KL in the reward), the
//!   per-token KL estimates k1/k2/k3.
//! - [`gae`]: generalised advantage estimation over a sample's tokens (PPO with a critic) and
//!   whitening over a batch's tokens, and how much of the returns a critic explains.
//! - [`pass_at_k`]: the unbiased pass@k estimator.
//!
//! Inputs are validated here (equal lengths, finite rewards, k ≤ n) and refused with an
//! [`Error`] naming the problem.

pub mod advantages;
pub mod gae;
pub mod pass_at_k;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    #[error("{what} has {found} entries, expected {expected} (one per sample)")]
    LengthMismatch { what: &'static str, expected: usize, found: usize },
    #[error("reward of sample {index} is not finite ({value})")]
    NonFiniteReward { index: usize, value: f64 },
    #[error("value of token {index} is not finite ({value})")]
    NonFiniteValue { index: usize, value: f64 },
    #[error("KL penalty of sample {index} is not finite ({value})")]
    NonFinitePenalty { index: usize, value: f64 },
    #[error("pass@k needs 1 ≤ k ≤ n and c ≤ n, got n = {n}, c = {c}, k = {k}")]
    InvalidPassAtK { n: usize, c: usize, k: usize },
    #[error("no prompts to average pass@k over")]
    Empty,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub use advantages::{
    Baseline, GroupStats, KlEstimator, group_baseline_and_std, grpo_advantages, kl_estimate, reinforce_pp_advantages,
    reinforce_pp_token_advantages, turn_grpo_advantages,
};
pub use gae::{Estimates, explained_variance, gae, whiten};
pub use pass_at_k::{mean_pass_at_k, pass_at_k};
