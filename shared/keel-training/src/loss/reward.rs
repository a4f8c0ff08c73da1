//! Reward model: Bradley–Terry, −log σ(s_chosen − s_rejected) averaged over the global
//! batch's valid pairs. Scores come from the scalar value head on each row's last token.

use tch::Kind;

use super::{EPS, GlobalCounts, LossInput, LossOutput, pair_rows, value};
use crate::error::{Error, Result};
use crate::metrics::Metrics;

pub fn bradley_terry(input: &LossInput<'_>, global: &GlobalCounts) -> Result<LossOutput> {
    let scores = input.scores.as_ref().ok_or_else(|| Error::Internal("bradley_terry needs scores".into()))?;
    let (chosen, rejected) = pair_rows(scores)?;
    let (chosen_valid, rejected_valid) = pair_rows(&input.sample_mask)?;
    let pair_mask = chosen_valid.f_mul(&rejected_valid)?;
    let n = global.pairs + EPS;
    let margin = chosen.f_sub(&rejected)?;
    let per_pair = margin.f_log_sigmoid()?.f_neg()?;
    let loss = per_pair.f_mul(&pair_mask)?.f_sum(Kind::Float)?.f_div_scalar(n)?;
    let pair_mean = |x: &tch::Tensor| -> Result<f64> {
        value(&x.f_detach()?.f_to_kind(Kind::Float)?.f_mul(&pair_mask)?.f_sum(Kind::Float)?.f_div_scalar(n)?)
    };
    let mut metrics = Metrics::default();
    metrics.sum("loss", value(&loss)?);
    metrics.sum("accuracy", pair_mean(&margin.f_gt(0.0)?)?);
    metrics.sum("chosen_score_mean", pair_mean(&chosen)?);
    metrics.sum("rejected_score_mean", pair_mean(&rejected)?);
    metrics.sum("score_margin", pair_mean(&margin)?);
    metrics.global("num_valid_samples", global.pairs);
    Ok((loss, metrics))
}
