//! DPO: implicit reward r = Σ (lp − ref) over the masked tokens (or their mean with
//! `preference_average_log_probs`); loss = mean over valid pairs of −log σ(β (r_c − r_r)),
//! weighted by `preference_loss_weight`, plus `sft_loss_weight` × the SFT term: each chosen
//! answer's NLL (summed over its tokens, or their mean with `sft_average_log_probs`),
//! averaged over the valid pairs. Rows 2i and 2i + 1 are the chosen and rejected answers of
//! pair i. With the policy equal to the reference, the preference loss is ln 2; with uniform
//! logits over V tokens and chosen answers of T tokens, the SFT term is T·ln V (ln V averaged).

use tch::{Kind, Tensor};

use super::{EPS, GlobalCounts, LossInput, LossOutput, pair_rows, row_mean, shifted, value};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use keel_protocol::training::DpoConfig;

pub fn dpo(config: &DpoConfig, input: &LossInput<'_>, global: &GlobalCounts) -> Result<LossOutput> {
    let reference =
        input.reference_logprobs.as_ref().ok_or_else(|| Error::Internal("dpo needs reference logprobs".into()))?;
    let beta = config.reference_policy_kl_penalty;
    let lp = shifted(input.logprobs)?;
    let diff = lp.f_sub(&shifted(reference)?)?;
    let rewards = if config.preference_average_log_probs {
        row_mean(&diff, &input.mask)?.f_squeeze_dim(1)?
    } else {
        diff.f_mul(&input.mask)?.f_sum_dim_intlist(1, false, Kind::Float)?
    };
    let (chosen, rejected) = pair_rows(&rewards)?;
    let (chosen_valid, rejected_valid) = pair_rows(&input.sample_mask)?;
    let pair_mask = chosen_valid.f_mul(&rejected_valid)?;
    let n = global.pairs + EPS;
    let pair_mean = |x: &Tensor| -> Result<Tensor> { Ok(x.f_mul(&pair_mask)?.f_sum(Kind::Float)?.f_div_scalar(n)?) };

    let margin = chosen.f_sub(&rejected)?.f_mul_scalar(beta)?;
    let preference = pair_mean(&margin.f_log_sigmoid()?.f_neg()?)?;
    // The SFT term: each chosen answer's NLL, averaged over the valid pairs like the
    // preference loss (so both normalise by the same global count).
    let (chosen_lp, _) = pair_rows(&lp)?;
    let (chosen_mask, _) = pair_rows(&input.mask)?;
    let nll = if config.sft_average_log_probs {
        row_mean(&chosen_lp.f_neg()?, &chosen_mask)?.f_squeeze_dim(1)?
    } else {
        chosen_lp.f_neg()?.f_mul(&chosen_mask)?.f_sum_dim_intlist(1, false, Kind::Float)?
    };
    let sft = pair_mean(&nll)?;
    let loss =
        preference.f_mul_scalar(config.preference_loss_weight)?.f_add(&sft.f_mul_scalar(config.sft_loss_weight)?)?;

    let detached = |x: &Tensor| -> Result<f64> { value(&pair_mean(&x.f_detach()?.f_to_kind(Kind::Float)?)?) };
    let mut metrics = Metrics::default();
    metrics.sum("loss", value(&loss)?);
    metrics.sum("preference_loss", value(&preference)?);
    metrics.sum("sft_loss", value(&sft)?);
    metrics.sum("accuracy", detached(&chosen.f_gt_tensor(&rejected)?)?);
    metrics.sum("rewards_chosen_mean", detached(&chosen.f_mul_scalar(beta)?)?);
    metrics.sum("rewards_rejected_mean", detached(&rejected.f_mul_scalar(beta)?)?);
    metrics.sum("rewards_margin_mean", detached(&margin)?);
    metrics.global("num_valid_samples", global.pairs);
    Ok((loss, metrics))
}
