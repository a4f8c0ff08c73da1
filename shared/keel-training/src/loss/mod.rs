//! The loss functions, computing what NeMo-RL computes. The exact
//! formulas, metric definitions included, are written out in `shared/keel-training/LOSSES.md`;
//! `tests/reference/loss_reference.py` implements the same text independently in PyTorch and
//! the unit tests compare the two, values and gradients.
//!
//! Every loss sees one microbatch ([`LossInput`]) and the counts of the whole global batch
//! ([`GlobalCounts`]). Each divides its sums by the global counts, so the microbatch losses
//! (and their gradients) add up to the full-batch loss whatever the split.
//!
//! - [`policy`]: clipped policy gradient (GRPO/PPO, dual clip, KL k1/k2/k3, importance
//!   sampling tis/icepop/seq-mask-tis, GSPO, REINFORCE, force-on-policy).
//! - [`nll`]: SFT negative log-likelihood.
//! - [`dpo`]: DPO with an optional SFT term.
//! - [`reward`]: Bradley–Terry on reward-model scores.
//! - [`value`]: PPO's critic loss, clipped or not.

pub mod dpo;
pub mod nll;
pub mod policy;
pub mod reward;
pub mod value;

use tch::{Kind, Tensor};

use crate::error::Result;
use crate::metrics::Metrics;

/// Added to every denominator, as in NeMo-RL's `masked_mean`.
pub const EPS: f64 = 1e-8;

/// One microbatch as the losses see it. Logprob tensors are [b, S] with position 0 = 0;
/// the losses use positions 1.. (`shifted`).
#[derive(Debug)]
pub struct LossInput<'a> {
    /// Current policy logprobs (carry the gradient); unused by Bradley–Terry.
    pub logprobs: &'a Tensor,
    /// token_mask[:, 1:] · sample_mask, [b, S − 1] f32.
    pub mask: Tensor,
    /// [b] f32.
    pub sample_mask: Tensor,
    /// [b, S] like the logprobs (position 0 unused).
    pub advantages: Option<Tensor>,
    pub prev_logprobs: Option<Tensor>,
    pub generation_logprobs: Option<Tensor>,
    pub reference_logprobs: Option<Tensor>,
    /// Reward-model scores [b] (Bradley–Terry only).
    pub scores: Option<Tensor>,
}

/// Counts over the whole global batch that every microbatch divides by.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GlobalCounts {
    /// Σ mask: valid tokens.
    pub tokens: f64,
    /// Σ sample_mask: valid sequences.
    pub sequences: f64,
    /// Pairs with both rows valid (pairwise losses).
    pub pairs: f64,
}

impl GlobalCounts {
    /// Counts of a global batch from its token mask [B, S] and sample mask [B].
    pub fn of(token_mask: &Tensor, sample_mask: &Tensor) -> Result<Self> {
        let mask = shifted_mask(token_mask, sample_mask)?;
        let per_row: Vec<f64> = Vec::try_from(mask.f_sum_dim_intlist(1, false, Kind::Double)?)?;
        let samples: Vec<f64> = Vec::try_from(sample_mask.f_to_kind(Kind::Double)?)?;
        let pairs = samples.chunks_exact(2).map(|rows| rows[0] * rows[1]).sum();
        Ok(Self { tokens: per_row.iter().sum(), sequences: samples.iter().sum(), pairs })
    }
}

/// token_mask[:, 1:] · sample_mask[:, None].
pub fn shifted_mask(token_mask: &Tensor, sample_mask: &Tensor) -> Result<Tensor> {
    let s = token_mask.size()[1];
    Ok(token_mask.f_narrow(1, 1, s - 1)?.f_mul(&sample_mask.f_unsqueeze(1)?)?)
}

/// Positions 1.. of a [b, S] tensor.
pub fn shifted(x: &Tensor) -> Result<Tensor> {
    let s = x.size()[1];
    Ok(x.f_narrow(1, 1, s - 1)?)
}

/// Σ x·mask / (n + EPS).
pub fn masked_mean(x: &Tensor, mask: &Tensor, n: f64) -> Result<Tensor> {
    Ok(x.f_mul(mask)?.f_sum(Kind::Float)?.f_div_scalar(n + EPS)?)
}

/// Each row's masked mean, [b, 1].
pub fn row_mean(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let total = x.f_mul(mask)?.f_sum_dim_intlist(1, true, Kind::Float)?;
    Ok(total.f_div(&mask.f_sum_dim_intlist(1, true, Kind::Float)?.f_add_scalar(EPS)?)?)
}

/// Min and max of `x` where `mask` is set (None when nothing is).
pub fn masked_min_max(x: &Tensor, mask: &Tensor) -> Result<Option<(f64, f64)>> {
    let values = x.f_detach()?.f_masked_select(&mask.f_gt(0.0)?)?;
    if values.numel() == 0 {
        return Ok(None);
    }
    Ok(Some((values.f_min()?.f_double_value(&[])?, values.f_max()?.f_double_value(&[])?)))
}

/// The value of a scalar tensor, detached.
pub fn value(x: &Tensor) -> Result<f64> {
    Ok(x.f_detach()?.f_double_value(&[])?)
}

/// Splits rows into (chosen, rejected) pairs: rows 2i and 2i + 1 (of a [b] or [b, S] tensor).
pub fn pair_rows(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let mut shape = x.size();
    let b = shape[0];
    shape.splice(0..1, [b / 2, 2]);
    let pairs = x.f_reshape(shape.as_slice())?;
    Ok((pairs.f_select(1, 0)?, pairs.f_select(1, 1)?))
}

/// A loss on one microbatch: the scalar to back-propagate and its metrics (sums already
/// divided by the global counts, so they add up over microbatches).
pub type LossOutput = (Tensor, Metrics);
