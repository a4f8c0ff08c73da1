//! Single-sequence generation with the KV cache, for the CLI and tests: prefill the prompt,
//! then decode one token at a time.
//!
//! Sampling: logits are divided by the temperature (0 = greedy); top-k keeps the k most
//! likely tokens; top-p keeps the smallest set whose probability reaches p; the kept
//! probabilities are renormalised and sampled with a ChaCha RNG seeded by `seed`. The
//! reported logprob of each token is under the temperature-scaled distribution *before*
//! top-k/top-p renormalisation, which is what the trainer recomputes (for greedy decoding,
//! under the unscaled distribution).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{Device, Kind, Tensor};

use crate::cache::KvCache;
use crate::error::{Error, Result};
use crate::model::CausalLm;

#[derive(Debug, Clone)]
pub struct SamplingParams {
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: Option<usize>,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { temperature: 1.0, top_p: 1.0, top_k: None, seed: 0 }
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
        Ok(())
    }
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
        let greedy = self.params.temperature == 0.0;
        let scaled = logits.f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?;
        let scaled = if greedy || self.params.temperature == 1.0 {
            scaled
        } else {
            scaled.f_div_scalar(self.params.temperature)?
        };
        let logprobs = Vec::<f32>::try_from(scaled.f_log_softmax(-1, Kind::Float)?)?;
        let token = if greedy {
            argmax(&logprobs)
        } else {
            let mut order: Vec<usize> = (0..logprobs.len()).collect();
            order.sort_unstable_by(|&a, &b| logprobs[b].total_cmp(&logprobs[a]));
            order.truncate(self.params.top_k.unwrap_or(order.len()));
            let mut kept = Vec::with_capacity(order.len());
            let mut mass = 0.0f64;
            for index in order {
                let p = f64::from(logprobs[index]).exp();
                kept.push((index, p));
                mass += p;
                if mass >= self.params.top_p {
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
        Ok((token as i64, logprobs[token]))
    }
}

fn argmax(values: &[f32]) -> usize {
    values.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0))).map_or(0, |(i, _)| i)
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
    let limit = model.config().max_position_embeddings;
    let needed = (prompt.len() + max_tokens) as i64;
    if needed > limit {
        return Err(Error::InvalidInput(format!(
            "prompt ({} tokens) plus max_tokens ({max_tokens}) exceeds the model's context of {limit}",
            prompt.len()
        )));
    }
    let mut sampler = Sampler::new(params)?;
    let _no_grad = tch::no_grad_guard();
    let mut cache = KvCache::new(model.config(), 1, needed, model.kind(), model.device())?;
    let mut input = Tensor::from_slice(prompt).f_unsqueeze(0)?;
    let mut generation = Generation { tokens: Vec::new(), logprobs: Vec::new(), finish_reason: FinishReason::Length };
    while generation.tokens.len() < max_tokens {
        let logits = model.forward(&input, Some(&mut cache))?;
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
