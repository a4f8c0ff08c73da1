//! Single-sequence generation with the KV cache, for the CLI and tests: prefill the prompt,
//! then decode one token at a time.
//!
//! Sampling: logits are divided by the temperature (0 = greedy); top-k keeps the k most
//! likely tokens; top-p then keeps the smallest prefix of those whose probability,
//! renormalised over the top k, reaches p (as transformers and vLLM apply them); min-p then
//! drops tokens less likely than min_p × the most likely one; the kept probabilities are
//! renormalised and sampled with a ChaCha RNG seeded by `seed`. The
//! reported logprob of each token is under the temperature-scaled distribution *before*
//! top-k/top-p renormalisation, which is what the trainer recomputes (for greedy decoding,
//! under the unscaled distribution).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::model::SlotModel;

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
}

/// The most likely tokens with their logprobs, most likely first.
pub type TopLogprobs = Vec<(i64, f32)>;

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

/// A sampler over one row of logits.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = ChaCha8Rng::seed_from_u64(params.seed);
        Ok(Self { params, rng })
    }

    /// Picks a token from `logits` [vocab] and returns it with its logprob.
    pub fn sample(&mut self, logits: &Tensor) -> Result<(i64, f32)> {
        let (token, logprob, _) = self.sample_with_top(logits, 0)?;
        Ok((token, logprob))
    }

    /// [`Sampler::sample`], plus the `top` most likely tokens with their logprobs (under the
    /// same distribution as the sampled token's logprob), most likely first.
    pub fn sample_with_top(&mut self, logits: &Tensor, top: usize) -> Result<(i64, f32, TopLogprobs)> {
        let scaled = logits.f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?;
        let scaled = scaled.f_div_scalar(self.logit_divisor())?;
        let logprobs = Vec::<f32>::try_from(scaled.f_log_softmax(-1, Kind::Float)?)?;
        self.sample_logprobs(&logprobs, top)
    }

    /// What the logits are divided by before the log-softmax: the temperature, or 1 when
    /// greedy.
    pub fn logit_divisor(&self) -> f64 {
        if self.params.temperature == 0.0 { 1.0 } else { self.params.temperature }
    }

    /// [`Sampler::sample_with_top`] from `logprobs`, the log-softmax of the logits divided by
    /// [`Sampler::logit_divisor`] (callers that batch rows compute it once for all of them).
    pub fn sample_logprobs(&mut self, logprobs: &[f32], top: usize) -> Result<(i64, f32, TopLogprobs)> {
        if logprobs.is_empty() {
            return Err(Error::InvalidInput("no logits to sample from".into()));
        }
        let greedy = self.params.temperature == 0.0;
        let needs_order = !greedy || top > 0;
        let mut order: Vec<usize> = Vec::new();
        if needs_order {
            order = (0..logprobs.len()).collect();
            order.sort_unstable_by(|&a, &b| logprobs[b].total_cmp(&logprobs[a]).then(a.cmp(&b)));
        }
        let best: Vec<(i64, f32)> = order.iter().take(top).map(|&i| (i as i64, logprobs[i])).collect();
        let token = if greedy {
            argmax(logprobs)
        } else {
            order.truncate(self.params.top_k.unwrap_or(order.len()));
            let probs: Vec<(usize, f64)> = order.into_iter().map(|i| (i, f64::from(logprobs[i]).exp())).collect();
            let top_k_mass: f64 = probs.iter().map(|(_, p)| p).sum();
            let floor = self.params.min_p * probs.first().map_or(0.0, |(_, p)| *p);
            let mut kept = Vec::with_capacity(probs.len());
            let mut mass = 0.0f64;
            for (index, p) in probs {
                if p < floor {
                    break;
                }
                kept.push((index, p));
                mass += p;
                if mass >= self.params.top_p * top_k_mass {
                    break;
                }
            }
            let mut target = self.rng.random::<f64>() * mass;
            let mut chosen = kept[kept.len() - 1].0;
            for (index, p) in kept {
                if target < p {
                    chosen = index;
                    break;
                }
                target -= p;
            }
            chosen
        };
        Ok((token as i64, logprobs[token], best))
    }
}

fn argmax(values: &[f32]) -> usize {
    values.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0))).map_or(0, |(i, _)| i)
}

/// Generates up to `max_tokens` after `prompt`, stopping after any of `stop_ids`.
pub fn generate<M: SlotModel + ?Sized>(
    model: &M,
    prompt: &[i64],
    max_tokens: usize,
    stop_ids: &[i64],
    params: SamplingParams,
) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(Error::InvalidInput("the prompt is empty".into()));
    }
    let limit = model.config().max_position_embeddings;
    let needed = prompt.len().checked_add(max_tokens).and_then(|n| i64::try_from(n).ok()).unwrap_or(i64::MAX);
    if needed > limit {
        return Err(Error::InvalidInput(format!(
            "prompt ({} tokens) plus max_tokens ({max_tokens}) exceeds the model's context of {limit}",
            prompt.len()
        )));
    }
    let mut sampler = Sampler::new(params)?;
    let _no_grad = tch::no_grad_guard();
    let mut cache = model.slot_cache(1, needed)?;
    let mut input = Tensor::from_slice(prompt).f_unsqueeze(0)?;
    let mut generation = Generation { tokens: Vec::new(), logprobs: Vec::new(), finish_reason: FinishReason::Length };
    while generation.tokens.len() < max_tokens {
        let logits = model.forward_slots(&input, &mut cache, &[0])?;
        let last = logits.f_select(0, 0)?.f_select(0, -1)?;
        let (token, logprob) = sampler.sample(&last)?;
        generation.tokens.push(token);
        generation.logprobs.push(logprob);
        if stop_ids.contains(&token) {
            generation.finish_reason = FinishReason::Stop;
            break;
        }
        input = Tensor::from_slice(&[token]).f_unsqueeze(0)?;
    }
    Ok(generation)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(temperature: f64, top_p: f64, top_k: Option<usize>, seed: u64) -> Sampler {
        Sampler::new(SamplingParams { temperature, top_p, top_k, min_p: 0.0, seed }).unwrap()
    }

    /// Token frequencies over many draws.
    fn frequencies(s: &mut Sampler, logits: &Tensor, draws: usize) -> Vec<f64> {
        let mut counts = vec![0.0; logits.size()[0] as usize];
        for _ in 0..draws {
            counts[s.sample(logits).unwrap().0 as usize] += 1.0 / draws as f64;
        }
        counts
    }

    #[test]
    fn greedy_picks_the_maximum_with_its_logprob() {
        let logits = Tensor::from_slice(&[0.5f32, 2.0, 1.0]);
        let (token, logprob) = sampler(0.0, 1.0, None, 0).sample(&logits).unwrap();
        assert_eq!(token, 1);
        let expected = 2.0 - (0.5f64.exp() + 2.0f64.exp() + 1.0f64.exp()).ln();
        assert!((f64::from(logprob) - expected).abs() < 1e-6);
    }

    #[test]
    fn top_k_and_top_p_restrict_and_renormalise() {
        // Probabilities 0.5, 0.3, 0.15, 0.05.
        let logits = Tensor::from_slice(&[0.5f32, 0.3, 0.15, 0.05]).log();
        let f = frequencies(&mut sampler(1.0, 1.0, Some(2), 1), &logits, 4000);
        assert_eq!((f[2], f[3]), (0.0, 0.0));
        assert!((f[0] - 0.625).abs() < 0.03, "{f:?}");
        // top_p 0.8 alone keeps {0.5, 0.3}.
        let f = frequencies(&mut sampler(1.0, 0.8, None, 2), &logits, 4000);
        assert_eq!((f[2], f[3]), (0.0, 0.0));
        // top_k 3 then top_p 0.8 over the renormalised top 3 (0.526, 0.316, 0.158): keeps two.
        let f = frequencies(&mut sampler(1.0, 0.8, Some(3), 3), &logits, 4000);
        assert_eq!((f[2], f[3]), (0.0, 0.0));
        // top_k 2 then top_p 0.6: the renormalised first token (0.625) already reaches p.
        let f = frequencies(&mut sampler(1.0, 0.6, Some(2), 5), &logits, 500);
        assert_eq!((f[1], f[2], f[3]), (0.0, 0.0, 0.0), "{f:?}");
        // top_p 0.9 over the top 3 needs all three.
        let f = frequencies(&mut sampler(1.0, 0.9, Some(3), 4), &logits, 4000);
        assert!(f[2] > 0.1 && f[3] == 0.0, "{f:?}");
    }

    #[test]
    fn min_p_drops_unlikely_tokens_and_top_logprobs_are_ordered() {
        // Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.4 keeps tokens with p ≥ 0.2.
        let logits = Tensor::from_slice(&[0.15f32, 0.5, 0.05, 0.3]).log();
        let mut s = Sampler::new(SamplingParams { min_p: 0.4, seed: 3, ..Default::default() }).unwrap();
        let f = frequencies(&mut s, &logits, 2000);
        assert_eq!((f[0], f[2]), (0.0, 0.0), "{f:?}");
        assert!((f[1] - 0.625).abs() < 0.04, "{f:?}");
        let (_, _, top) = s.sample_with_top(&logits, 3).unwrap();
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3, 0]);
        assert!((top[0].1 - 0.5f32.ln()).abs() < 1e-6);
    }

    #[test]
    fn same_seed_same_draws_and_logprobs_follow_temperature() {
        let logits = Tensor::from_slice(&[0.1f32, 0.4, 0.2, 0.3]);
        let draw = |seed| {
            (0..20)
                .map(|_| 0)
                .scan(sampler(0.7, 1.0, None, seed), |s, _| Some(s.sample(&logits).unwrap().0))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(9), draw(9));
        let (token, logprob) = sampler(0.5, 1.0, None, 0).sample(&logits).unwrap();
        let scaled = Vec::<f32>::try_from((&logits / 0.5).log_softmax(-1, Kind::Float)).unwrap();
        assert!((logprob - scaled[token as usize]).abs() < 1e-6);
    }

    #[test]
    fn invalid_parameters_are_refused() {
        for params in [
            SamplingParams { temperature: -1.0, ..Default::default() },
            SamplingParams { top_p: 0.0, ..Default::default() },
            SamplingParams { top_k: Some(0), ..Default::default() },
            SamplingParams { min_p: 1.5, ..Default::default() },
        ] {
            assert!(Sampler::new(params).is_err());
        }
    }
}
