//! Clipped policy gradient (GRPO / PPO family) as NeMo-RL computes it:
//! r = exp(lp − prev), ℓ = max(−A·r, −A·clamp(r, 1 − ε_low, 1 + ε_high)), dual clip
//! min(ℓ, −A·c) where A < 0, an importance weight w = exp(prev − gen) for the
//! generator/trainer mismatch (tis / icepop / seq-mask-tis), token- or sequence-level
//! reduction, plus β × a k1/k2/k3 estimate of KL(policy ‖ reference) unless the KL is in the
//! reward (`use_kl_in_reward`). Advantages are per token ([b, S], per-sample ones broadcast
//! when the batch is made). Variants: GSPO
//! (one ratio per sequence), REINFORCE (ℓ = −A·lp), force-on-policy (r = exp(lp − sg(lp))),
//! CISPO (ℓ = −A·sg(clamp(r))·lp: the clipped ratio weighs the policy gradient of every token).
//! `LOSSES.md` has the exact text.

use tch::{Kind, Tensor};

use super::{EPS, GlobalCounts, LossInput, LossOutput, masked_mean, masked_min_max, row_mean, shifted, value};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use keel_protocol::training::{ClippedPgConfig, KlType, TruncationType};

/// Token-level: Σ x·mask / N_tok; sequence-level: Σ over rows of the row's masked mean / N_seq.
fn reduce(config: &ClippedPgConfig, x: &Tensor, input: &LossInput<'_>, global: &GlobalCounts) -> Result<Tensor> {
    if config.token_level_loss {
        masked_mean(x, &input.mask, global.tokens)
    } else {
        let rows = row_mean(x, &input.mask)?.f_squeeze_dim(1)?.f_mul(&input.sample_mask)?;
        Ok(rows.f_sum(Kind::Float)?.f_div_scalar(global.sequences + EPS)?)
    }
}

/// The detached importance weight exp(prev − gen), truncated as configured (1 when off).
fn importance_weight(config: &ClippedPgConfig, prev: &Tensor, generation: &Tensor, mask: &Tensor) -> Result<Tensor> {
    if !config.use_importance_sampling_correction {
        return Ok(Tensor::f_ones_like(prev)?);
    }
    let log_w = prev.f_sub(generation)?;
    let w = log_w.f_exp()?.f_nan_to_num(0.0, 0.0, 0.0)?;
    let min = config.truncated_importance_sampling_ratio_min.unwrap_or(0.0);
    let max = config.truncated_importance_sampling_ratio_max.unwrap_or(f64::INFINITY);
    Ok(match config.truncated_importance_sampling_type {
        None => w,
        Some(TruncationType::Tis) => w.f_clamp(min, max)?,
        Some(TruncationType::Icepop) => {
            let inside = w.f_ge(min)?.f_logical_and(&w.f_le(max)?)?;
            w.f_where_self(&inside, &Tensor::f_zeros_like(&w)?)?
        }
        Some(TruncationType::SeqMaskTis) => {
            let seq = row_mean(&log_w, mask)?.f_exp()?;
            let inside = seq.f_ge(min)?.f_logical_and(&seq.f_le(max)?)?;
            w.f_mul(&inside.f_to_kind(Kind::Float)?)?
        }
    })
}

/// Per-token KL(policy ‖ reference) estimate with the score-function factor exp(lp − sg(lp)).
fn kl_per_token(config: &ClippedPgConfig, lp: &Tensor, reference: &Tensor) -> Result<Tensor> {
    let mut log_r = reference.f_sub(lp)?;
    if let Some(c) = config.kl_input_clamp_value {
        log_r = log_r.f_clamp(-c, c)?;
    }
    let k = match config.reference_policy_kl_type {
        KlType::K1 => log_r.f_neg()?,
        KlType::K2 => log_r.f_square()?.f_mul_scalar(0.5)?,
        KlType::K3 => log_r.f_exp()?.f_sub_scalar(1.0)?.f_sub(&log_r)?,
    };
    let mut kl = k.f_mul(&lp.f_sub(&lp.f_detach()?)?.f_exp()?)?;
    if let Some(c) = config.kl_output_clamp_value {
        kl = kl.f_clamp(-c, c)?;
    }
    Ok(kl)
}

pub fn clipped_pg(config: &ClippedPgConfig, input: &LossInput<'_>, global: &GlobalCounts) -> Result<LossOutput> {
    let lp = shifted(input.logprobs)?;
    let mask = &input.mask;
    let prev = match &input.prev_logprobs {
        Some(prev) => shifted(prev)?,
        None => lp.f_detach()?,
    };
    let generation = match &input.generation_logprobs {
        Some(generation) => shifted(generation)?,
        None => prev.shallow_clone(),
    };
    let advantages = input
        .advantages
        .as_ref()
        .ok_or_else(|| Error::Internal("clipped_pg needs advantages".into()))
        .and_then(shifted)?;
    let neg_a = advantages.f_neg()?;

    let log_ratio = if config.force_on_policy_ratio {
        lp.f_sub(&lp.f_detach()?)?
    } else if config.sequence_level_importance_ratios {
        row_mean(&lp.f_sub(&prev)?, mask)?.f_expand_as(&lp)?
    } else {
        lp.f_sub(&prev)?
    };
    let ratio = if config.disable_ppo_ratio { lp.f_sub(&prev)?.f_exp()? } else { log_ratio.f_exp()? };
    let clamped = ratio.f_clamp(1.0 - config.ratio_clip_min, 1.0 + config.ratio_clip_max)?;
    let per_token = if config.disable_ppo_ratio {
        neg_a.f_mul(&lp)?
    } else if config.cispo {
        neg_a.f_mul(&clamped.f_detach()?)?.f_mul(&lp)?
    } else {
        let clipped = neg_a.f_mul(&ratio)?.f_maximum(&neg_a.f_mul(&clamped)?)?;
        match config.ratio_clip_c {
            Some(c) => {
                let dual = clipped.f_minimum(&neg_a.f_mul_scalar(c)?)?;
                dual.f_where_self(&advantages.f_lt(0.0)?, &clipped)?
            }
            None => clipped,
        }
    };
    let weight = importance_weight(config, &prev, &generation, mask)?;
    let actor = reduce(config, &weight.f_mul(&per_token)?, input, global)?;

    // With the KL in the reward, the advantages already carry −β·KL and the loss adds none.
    let beta = if config.use_kl_in_reward { 0.0 } else { config.reference_policy_kl_penalty };
    let kl = match (&input.reference_logprobs, beta != 0.0) {
        (Some(reference), true) => reduce(config, &kl_per_token(config, &lp, &shifted(reference)?)?, input, global)?,
        (None, true) => return Err(Error::Internal("clipped_pg with β ≠ 0 needs reference logprobs".into())),
        (_, false) => Tensor::f_zeros([], (Kind::Float, lp.device()))?,
    };
    let loss = actor.f_add(&kl.f_mul_scalar(beta)?)?;

    let mut metrics = Metrics::default();
    let mean = |x: &Tensor| -> Result<f64> { value(&masked_mean(&x.f_detach()?, mask, global.tokens)?) };
    metrics.sum("loss", value(&loss)?);
    metrics.sum("actor_loss", value(&actor)?);
    metrics.sum("kl_penalty", beta * value(&kl)?);
    for (name, x) in [("probs_ratio", &ratio), ("probs_ratio_clamped", &clamped)] {
        metrics.sum(name, mean(x)?);
        if let Some((lo, hi)) = masked_min_max(x, mask)? {
            metrics.min(&format!("{name}_min"), lo);
            metrics.max(&format!("{name}_max"), hi);
        }
    }
    let gen_minus_prev = generation.f_sub(&prev)?;
    metrics.sum("token_mult_prob_error", mean(&gen_minus_prev.f_abs()?.f_exp()?)?);
    let k3 = |d: &Tensor| -> Result<Tensor> { Ok(d.f_exp()?.f_sub_scalar(1.0)?.f_sub(d)?) };
    let prev_minus_gen = gen_minus_prev.f_neg()?;
    metrics.sum("gen_kl_error", mean(&k3(&prev_minus_gen)?)?);
    metrics.sum("policy_kl_error", mean(&prev_minus_gen.f_exp()?.f_mul(&k3(&gen_minus_prev)?)?)?);
    metrics.sum("approx_entropy", -mean(&lp.f_sub(&generation)?.f_exp()?.f_mul(&lp)?)?);
    metrics.sum("sampling_importance_ratio", mean(&weight)?);
    metrics.global("num_valid_samples", global.sequences);
    Ok((loss, metrics))
}
