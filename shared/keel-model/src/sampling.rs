//! Sampling on the model's device, batched over rows, and single-sequence generation for
//! the CLI and tests.
//!
//! [`sample`] turns logits [R, vocab] into one token per row without copying the logits off
//! the device: only the token, its logprob and the requested top logprobs come back. Per
//! row: logits are divided by the temperature (0 = greedy) and log-softmaxed; stop tokens
//! that may not end the sample yet (`banned`) are masked; top-k keeps the k most likely
//! tokens; top-p then keeps the smallest prefix of those whose probability, renormalised
//! over the top k, reaches p (as transformers and vLLM apply them); min-p drops tokens less
//! likely than min_p × the most likely one. The token is the argmax of the kept logprobs
//! plus Gumbel noise — an exact draw from the renormalised kept distribution — where the
//! noise of token t is a hash of (seed, step, t): a row's draw depends on its own seed and
//! step only, never on the other rows, the batch size or the device's random state, so a
//! seeded sample is the same alone, in any batch, and after its sequence is recomputed.
//!
//! The reported logprob of each token is under the temperature-scaled distribution
//! *before* masking and truncation, which is what the trainer recomputes (for greedy
//! decoding, under the unscaled distribution); top logprobs are under the same
//! distribution, most likely first.

use tch::{Device, Kind, Tensor};

use crate::cache::{BLOCK_SIZE, SeqChunk};
use crate::error::{Error, Result};
use crate::model::CausalLm;
#[derive(Debug, Clone)]
pub struct SamplingParams {
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: Option<usize>,
    pub min_p: f64,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { temperature: 1.0, top_p: 1.0, top_k: None, min_p: 0.0, seed: 0 }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::InvalidInput(format!("temperature must be ≥ 0, got {}", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::InvalidInput(format!("top_p must be in (0, 1], got {}", self.top_p)));
        }
        if self.top_k == Some(0) {
            return Err(Error::InvalidInput("top_k must be at least 1".into()));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(Error::InvalidInput(format!("min_p must be in [0, 1], got {}", self.min_p)));
        }
        Ok(())
    }

    /// What the logits are divided by before the log-softmax: the temperature, or 1 when
    /// greedy.
    pub fn logit_divisor(&self) -> f64 {
        if self.temperature == 0.0 { 1.0 } else { self.temperature }
    }

    fn greedy(&self) -> bool {
        self.temperature == 0.0
    }

    fn truncates(&self) -> bool {
        !self.greedy() && (self.top_k.is_some() || self.top_p < 1.0)
    }
}

/// The most likely tokens with their logprobs, most likely first.
pub type TopLogprobs = Vec<(i64, f32)>;

/// One row of a batched draw.
#[derive(Debug, Clone, Copy)]
pub struct Draw<'a> {
    pub params: &'a SamplingParams,
    /// The row's seed (a request's sample i uses its seed + i).
    pub seed: u64,
    /// Which token of the sample this draw is (0 for the first generated token).
    pub step: u64,
    /// How many top logprobs to report.
    pub top_logprobs: usize,
    /// Tokens that may not be drawn (stop tokens before `min_tokens`).
    pub banned: &'a [i64],
}

/// What one row drew.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: i64,
    pub logprob: f32,
    pub top: TopLogprobs,
}

/// A 64-bit mix (SplitMix64's finaliser).
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Uniform noise in (0, 1) [R, vocab]: entry (r, t) hashes row r's seed and step with t.
/// 32-bit arithmetic in i64 tensors, multipliers below 2³¹ so that no product overflows.
fn uniform_noise(draws: &[Draw<'_>], vocab: i64, device: Device) -> Result<Tensor> {
    const LOW: i64 = 0xffff_ffff;
    let keys: Vec<u64> =
        draws.iter().map(|d| mix64(d.seed ^ mix64(d.step.wrapping_add(0x9e37_79b9_7f4a_7c15)))).collect();
    let column =
        |values: Vec<i64>| -> Result<Tensor> { Ok(Tensor::from_slice(&values).f_to_device(device)?.f_view([-1, 1])?) };
    let first = column(keys.iter().map(|k| (k & 0xffff_ffff) as i64).collect())?;
    let second = column(keys.iter().map(|k| (k >> 32) as i64).collect())?;
    let round = |h: Tensor, shift: i64, multiplier: i64| -> Result<Tensor> {
        let h = h.f_bitwise_xor_tensor(&h.f_bitwise_right_shift_tensor_scalar(shift)?)?;
        Ok(h.f_mul_scalar(multiplier)?.f_bitwise_and(LOW)?)
    };
    let tokens = Tensor::f_arange(vocab, (Kind::Int64, device))?.f_view([1, -1])?;
    let mut h = tokens.f_mul_scalar(0x2545_f491_i64)?.f_add(&first)?.f_bitwise_and(LOW)?;
    h = round(h, 16, 0x7feb_352d)?;
    h = round(h, 15, 0x2c1b_3c6d)?.f_bitwise_xor_tensor(&second)?;
    h = round(h, 12, 0x297a_2d39)?;
    h = round(h, 15, 0x4f6c_dd1d)?;
    let top24 = h.f_bitwise_right_shift_tensor_scalar(8)?.f_to_kind(Kind::Float)?;
    Ok(top24.f_add_scalar(0.5)?.f_div_scalar(16_777_216.0)?)
}

/// A [R, 1] column of per-row values on `device`.
fn per_row(values: Vec<f32>, device: Device) -> Result<Tensor> {
    Ok(Tensor::from_slice(&values).f_to_device(device)?.f_view([-1, 1])?)
}

/// Which tokens top-k, top-p and min-p keep, from `choice` (logprobs, −inf where banned)
/// [R, vocab]; `None` when no row truncates.
fn kept(choice: &Tensor, draws: &[Draw<'_>], vocab: i64) -> Result<Option<Tensor>> {
    let device = choice.device();
    let sampled = |d: &Draw<'_>| !d.params.greedy();
    let min_p = draws.iter().any(|d| sampled(d) && d.params.min_p > 0.0);
    let min_ps =
        || per_row(draws.iter().map(|d| if sampled(d) { d.params.min_p as f32 } else { 0.0 }).collect(), device);
    if !draws.iter().any(|d| d.params.truncates()) {
        if !min_p {
            return Ok(None);
        }
        let probs = choice.f_exp()?;
        let floor = probs.f_amax(&[-1i64][..], true)?.f_mul(&min_ps()?)?;
        return Ok(Some(probs.f_ge_tensor(&floor)?));
    }
    let (sorted, order) = choice.f_sort(-1, true)?;
    let probs = sorted.f_exp()?;
    let rank = Tensor::f_arange(vocab, (Kind::Int64, device))?.f_view([1, -1])?;
    let limit = |d: &Draw<'_>| if sampled(d) { d.params.top_k.map_or(vocab, |k| k as i64) } else { vocab };
    let top_k =
        Tensor::from_slice(&draws.iter().map(limit).collect::<Vec<_>>()).f_to_device(device)?.f_view([-1, 1])?;
    let in_top_k = rank.f_lt_tensor(&top_k)?;
    let top_k_probs = probs.f_mul(&in_top_k)?;
    let mass = top_k_probs.f_sum_dim_intlist(&[-1i64][..], true, Kind::Float)?;
    let before = top_k_probs.f_cumsum(-1, Kind::Float)?.f_sub(&top_k_probs)?;
    let top_p = per_row(draws.iter().map(|d| if sampled(d) { d.params.top_p as f32 } else { 1.0 }).collect(), device)?;
    let mut keep = in_top_k.f_logical_and(&before.f_lt_tensor(&mass.f_mul(&top_p)?)?)?;
    if min_p {
        let floor = probs.f_narrow(-1, 0, 1)?.f_mul(&min_ps()?)?;
        keep = keep.f_logical_and(&probs.f_ge_tensor(&floor)?)?;
    }
    // The most likely token always stays (top-p and min-p never drop it; top-k keeps ≥ 1).
    Ok(Some(keep.f_zeros_like()?.f_scatter(-1, &order, &keep)?))
}

/// One token per row of `logits` [R, vocab] (see the module documentation), drawn on the
/// logits' device; row r follows `draws[r]`.
pub fn sample(logits: &Tensor, draws: &[Draw<'_>]) -> Result<Vec<Sampled>> {
    let size = logits.size();
    let [rows, vocab] = size[..] else {
        return Err(Error::InvalidInput(format!("logits to sample must be [rows, vocab], got {size:?}")));
    };
    if rows != draws.len() as i64 || vocab == 0 {
        return Err(Error::InvalidInput(format!("{} draws for logits of shape {size:?}", draws.len())));
    }
    if rows == 0 {
        return Ok(Vec::new());
    }
    for draw in draws {
        draw.params.validate()?;
    }
    let device = logits.device();
    let mut scaled = logits.f_to_kind(Kind::Float)?;
    if draws.iter().any(|d| d.params.logit_divisor() != 1.0) {
        scaled = scaled.f_div(&per_row(draws.iter().map(|d| d.params.logit_divisor() as f32).collect(), device)?)?;
    }
    let logprobs = scaled.f_log_softmax(-1, Kind::Float)?;
    let mut choice = logprobs.shallow_clone();
    let bans: Vec<(i64, i64)> = draws
        .iter()
        .enumerate()
        .flat_map(|(r, d)| d.banned.iter().filter(|&&t| (0..vocab).contains(&t)).map(move |&t| (r as i64, t)))
        .collect();
    if !bans.is_empty() {
        let (ban_rows, ban_tokens): (Vec<i64>, Vec<i64>) = bans.into_iter().unzip();
        let at = [
            Some(Tensor::from_slice(&ban_rows).f_to_device(device)?),
            Some(Tensor::from_slice(&ban_tokens).f_to_device(device)?),
        ];
        choice = choice.f_index_put(&at, &Tensor::from(f32::NEG_INFINITY).f_to_device(device)?, false)?;
    }
    if draws.iter().any(|d| !d.params.greedy()) {
        if let Some(keep) = kept(&choice, draws, vocab)? {
            choice = choice.f_masked_fill(&keep.f_logical_not()?, f64::NEG_INFINITY)?;
        }
        let gumbel = uniform_noise(draws, vocab, device)?.f_log()?.f_neg()?.f_log()?.f_neg()?;
        let on = per_row(draws.iter().map(|d| if d.params.greedy() { 0.0 } else { 1.0 }).collect(), device)?;
        choice = choice.f_add(&gumbel.f_mul(&on)?)?;
    }
    let tokens = choice.f_argmax(-1, true)?;
    let mut parts =
        vec![tokens.f_to_kind(Kind::Double)?, logprobs.f_gather(-1, &tokens, false)?.f_to_kind(Kind::Double)?];
    let top = draws.iter().map(|d| d.top_logprobs).max().unwrap_or(0).min(vocab as usize) as i64;
    if top > 0 {
        let (values, indices) = logprobs.f_topk(top, -1, true, true)?;
        parts.push(values.f_to_kind(Kind::Double)?);
        parts.push(indices.f_to_kind(Kind::Double)?);
    }
    let width = 2 + 2 * top as usize;
    let table = Vec::<f64>::try_from(Tensor::f_cat(&parts, 1)?.f_to_device(Device::Cpu)?.f_flatten(0, -1)?)?;
    Ok(table
        .chunks(width)
        .zip(draws)
        .map(|(row, draw)| {
            let k = draw.top_logprobs.min(top as usize);
            let top = (0..k).map(|i| (row[2 + top as usize + i] as i64, row[2 + i] as f32)).collect();
            Sampled { token: row[0] as i64, logprob: row[1] as f32, top }
        })
        .collect())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was generated (it is included in the output).
    Stop,
    /// `max_tokens` was reached.
    Length,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<i64>,
    pub logprobs: Vec<f32>,
    pub finish_reason: FinishReason,
}

/// Generates up to `max_tokens` after `prompt`, stopping after any of `stop_ids`.
pub fn generate(
    model: &CausalLm,
    prompt: &[i64],
    max_tokens: usize,
    stop_ids: &[i64],
    params: SamplingParams,
) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(Error::InvalidInput("the prompt is empty".into()));
    }
    params.validate()?;
    let limit = model.config().max_position_embeddings;
    let needed = prompt.len().checked_add(max_tokens).and_then(|n| i64::try_from(n).ok()).unwrap_or(i64::MAX);
    if needed > limit {
        return Err(Error::InvalidInput(format!(
            "prompt ({} tokens) plus max_tokens ({max_tokens}) exceeds the model's context of {limit}",
            prompt.len()
        )));
    }
    let blocks = (needed as usize).div_ceil(BLOCK_SIZE);
    let mut cache = model.paged_cache(blocks)?;
    let mut chunk =
        SeqChunk { tokens: prompt.to_vec(), context: 0, blocks: (0..blocks as u32).collect(), logits: true };
    let mut generation = Generation { tokens: Vec::new(), logprobs: Vec::new(), finish_reason: FinishReason::Length };
    while generation.tokens.len() < max_tokens {
        let logits = model.forward_paged(std::slice::from_ref(&chunk), &mut cache)?;
        let draw = Draw {
            params: &params,
            seed: params.seed,
            step: generation.tokens.len() as u64,
            top_logprobs: 0,
            banned: &[],
        };
        let Sampled { token, logprob, .. } = sample(&logits, &[draw])?.remove(0);
        generation.tokens.push(token);
        generation.logprobs.push(logprob);
        if stop_ids.contains(&token) {
            generation.finish_reason = FinishReason::Stop;
            break;
        }
        chunk.context += chunk.tokens.len();
        chunk.tokens = vec![token];
    }
    Ok(generation)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f64, top_p: f64, top_k: Option<usize>, min_p: f64) -> SamplingParams {
        SamplingParams { temperature, top_p, top_k, min_p, seed: 0 }
    }

    /// Draws `draws` tokens from `probs` (one row each, seeds 0..draws) and returns the
    /// chi-square statistic against `expected` (probabilities; zeros must never be drawn).
    fn chi_square(probs: &[f64], params: &SamplingParams, expected: &[f64], draws: usize) -> f64 {
        let logits = Tensor::from_slice(&probs.iter().map(|p| p.ln() as f32).collect::<Vec<_>>())
            .view([1, -1])
            .expand([draws as i64, probs.len() as i64], false)
            .contiguous();
        let rows: Vec<Draw<'_>> =
            (0..draws as u64).map(|seed| Draw { params, seed, step: 3, top_logprobs: 0, banned: &[] }).collect();
        let mut counts = vec![0.0; probs.len()];
        for s in sample(&logits, &rows).unwrap() {
            counts[s.token as usize] += 1.0;
        }
        let mut statistic = 0.0;
        for (count, &p) in counts.iter().zip(expected) {
            if p == 0.0 {
                assert_eq!(*count, 0.0, "a token outside the kept set was drawn: {counts:?}");
            } else {
                let e = p * draws as f64;
                statistic += (count - e) * (count - e) / e;
            }
        }
        statistic
    }

    fn normalised(p: &[f64]) -> Vec<f64> {
        let total: f64 = p.iter().sum();
        p.iter().map(|x| x / total).collect()
    }

    /// Draws follow the distribution that temperature, top-k, top-p and min-p leave (a
    /// chi-square test at p = 0.001 over 20,000 draws each).
    #[test]
    fn draws_follow_the_truncated_distribution() {
        let probs = [0.05, 0.3, 0.02, 0.15, 0.25, 0.08, 0.1, 0.05];
        // 99.9th percentile of chi-square with 7, 3, 2 and 1 degrees of freedom.
        let critical = [24.32, 16.27, 13.82, 10.83];
        let cases: Vec<(SamplingParams, Vec<f64>)> = vec![
            (params(1.0, 1.0, None, 0.0), probs.to_vec()),
            (params(0.5, 1.0, None, 0.0), normalised(&probs.map(|p: f64| p * p))),
            (params(1.0, 1.0, Some(3), 0.0), normalised(&[0.0, 0.3, 0.0, 0.15, 0.25, 0.0, 0.0, 0.0])),
            // top-p 0.6: 0.3 + 0.25 falls short, so the prefix reaching 0.6 takes 0.15 too.
            (params(1.0, 0.6, None, 0.0), normalised(&[0.0, 0.3, 0.0, 0.15, 0.25, 0.0, 0.0, 0.0])),
            // min-p 0.6 keeps p ≥ 0.18.
            (params(1.0, 1.0, None, 0.6), normalised(&[0.0, 0.3, 0.0, 0.0, 0.25, 0.0, 0.0, 0.0])),
            // top-k 2 then top-p 0.5 over the renormalised pair (0.545, 0.455): one token.
            (params(1.0, 0.5, Some(2), 0.0), vec![0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
        ];
        for (params, expected) in cases {
            let dof = expected.iter().filter(|&&p| p > 0.0).count() - 1;
            let statistic = chi_square(&probs, &params, &expected, 20_000);
            let bound = match dof {
                0 => 0.0,
                1 => critical[3],
                2 => critical[2],
                3 => critical[1],
                _ => critical[0],
            };
            assert!(statistic <= bound, "{params:?}: chi-square {statistic:.2} over {bound} ({dof} dof)");
        }
    }

    /// A seeded row draws the same token alone, in any batch, in any position, whatever
    /// the other rows ask for.
    #[test]
    fn seeded_draws_do_not_depend_on_the_batch() {
        tch::manual_seed(3);
        let logits = Tensor::randn([6, 50], (Kind::Float, Device::Cpu));
        let plain = params(0.8, 0.9, Some(20), 0.0);
        let others = [params(0.0, 1.0, None, 0.0), params(1.3, 1.0, None, 0.2), params(1.0, 0.5, Some(4), 0.0)];
        for step in 0..20u64 {
            let alone = sample(
                &logits.narrow(0, 2, 1),
                &[Draw { params: &plain, seed: 11, step, top_logprobs: 3, banned: &[] }],
            )
            .unwrap()
            .remove(0);
            let mut rows: Vec<Draw<'_>> = (0..6)
                .map(|r| Draw {
                    params: &others[r % 3],
                    seed: r as u64,
                    step: step + 5,
                    top_logprobs: r,
                    banned: &[1, 2],
                })
                .collect();
            rows[2] = Draw { params: &plain, seed: 11, step, top_logprobs: 3, banned: &[] };
            let batched = sample(&logits, &rows).unwrap();
            assert_eq!(batched[2], alone, "step {step}");
        }
    }

    #[test]
    fn greedy_logprobs_top_logprobs_and_bans() {
        let logits = Tensor::from_slice(&[0.5f32, 2.0, 1.0, -1.0]).view([1, 4]);
        let greedy = params(0.0, 1.0, None, 0.0);
        let got = sample(&logits, &[Draw { params: &greedy, seed: 0, step: 0, top_logprobs: 2, banned: &[] }]).unwrap();
        let norm = [0.5f64, 2.0, 1.0, -1.0].iter().map(|x| x.exp()).sum::<f64>().ln();
        assert_eq!(got[0].token, 1);
        assert!((f64::from(got[0].logprob) - (2.0 - norm)).abs() < 1e-6);
        assert_eq!(got[0].top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2]);
        assert!((f64::from(got[0].top[1].1) - (1.0 - norm)).abs() < 1e-6);
        // A banned token is not drawn but its logprob is still the unmasked one.
        let banned =
            sample(&logits, &[Draw { params: &greedy, seed: 0, step: 0, top_logprobs: 0, banned: &[1] }]).unwrap();
        assert_eq!(banned[0].token, 2);
        assert!((f64::from(banned[0].logprob) - (1.0 - norm)).abs() < 1e-6);
        // Logprobs follow the temperature.
        let warm = params(0.5, 1.0, None, 0.0);
        let drawn = sample(&logits, &[Draw { params: &warm, seed: 4, step: 0, top_logprobs: 0, banned: &[] }]).unwrap();
        let scaled = Vec::<f32>::try_from((&logits / 0.5).log_softmax(-1, Kind::Float).view([-1])).unwrap();
        assert!((drawn[0].logprob - scaled[drawn[0].token as usize]).abs() < 1e-6);
    }

    #[test]
    fn invalid_parameters_are_refused() {
        let logits = Tensor::zeros([1, 4], (Kind::Float, Device::Cpu));
        for params in [
            SamplingParams { temperature: -1.0, ..Default::default() },
            SamplingParams { top_p: 0.0, ..Default::default() },
            SamplingParams { top_k: Some(0), ..Default::default() },
            SamplingParams { min_p: 1.5, ..Default::default() },
        ] {
            assert!(
                sample(&logits, &[Draw { params: &params, seed: 0, step: 0, top_logprobs: 0, banned: &[] }]).is_err()
            );
        }
        let ok = SamplingParams::default();
        assert!(sample(&logits, &[]).is_err(), "no draws for one row");
        assert!(sample(&logits, &[Draw { params: &ok, seed: 0, step: 0, top_logprobs: 0, banned: &[] }; 2]).is_err());
    }
}
