//! SFT: the negative log-likelihood of the loss-masked tokens, averaged over the global
//! batch's valid tokens.

use super::{GlobalCounts, LossInput, LossOutput, masked_mean, shifted, value};
use crate::error::Result;
use crate::metrics::Metrics;

pub fn nll(input: &LossInput<'_>, global: &GlobalCounts) -> Result<LossOutput> {
    let loss = masked_mean(&shifted(input.logprobs)?.f_neg()?, &input.mask, global.tokens)?;
    let mut metrics = Metrics::default();
    metrics.sum("loss", value(&loss)?);
    metrics.global("num_unmasked_tokens", global.tokens);
    metrics.global("num_valid_samples", global.sequences);
    Ok((loss, metrics))
}
