//! PPO's critic loss: ½·(V − R)² over the generated tokens, or with value clipping the larger
//! of that and ½·(clip(V, V_old − ε, V_old + ε) − R)², averaged over the global batch's valid
//! tokens (LOSSES.md, "Value loss").

use tch::{Kind, Tensor};

use super::{GlobalCounts, LossOutput, masked_mean, shifted, value};
use crate::error::Result;
use crate::metrics::Metrics;

/// One microbatch as the value loss sees it; every tensor [b, S] laid out like the
/// logprobs (position 0 unused) but `mask`, which is [b, S − 1] like [`super::LossInput::mask`].
#[derive(Debug)]
pub struct ValueInput<'a> {
    /// The critic's values now (carry the gradient).
    pub values: &'a Tensor,
    /// The values the batch was scored with.
    pub old_values: Tensor,
    pub returns: Tensor,
    pub mask: Tensor,
}

pub fn value_loss(clip: Option<f64>, input: &ValueInput<'_>, global: &GlobalCounts) -> Result<LossOutput> {
    let values = shifted(input.values)?;
    let returns = shifted(&input.returns)?;
    let unclipped = values.f_sub(&returns)?.f_square()?;
    let mut metrics = Metrics::default();
    let per_token = match clip {
        None => unclipped,
        Some(epsilon) => {
            let old = shifted(&input.old_values)?;
            let moved = values.f_sub(&old)?.f_clamp(-epsilon, epsilon)?;
            let clipped = old.f_add(&moved)?.f_sub(&returns)?.f_square()?;
            let fraction = clipped.f_gt_tensor(&unclipped)?.f_to_kind(Kind::Float)?;
            metrics.sum("value_clip_fraction", value(&masked_mean(&fraction, &input.mask, global.tokens)?)?);
            unclipped.f_maximum(&clipped)?
        }
    };
    let loss = masked_mean(&per_token, &input.mask, global.tokens)?.f_mul_scalar(0.5)?;
    metrics.sum("value_loss", value(&loss)?);
    metrics.sum("values_mean", value(&masked_mean(&values.f_detach()?, &input.mask, global.tokens)?)?);
    metrics.sum("returns_mean", value(&masked_mean(&returns, &input.mask, global.tokens)?)?);
    Ok((loss, metrics))
}
