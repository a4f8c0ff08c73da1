//! Prompt logprobs: for every prompt token after the first, its logprob under the model
//! (temperature 1, the distribution the trainer scores), its rank among the vocabulary, and
//! the most likely tokens at its position — what `echo` and vLLM's `prompt_logprobs` return,
//! and what lm-eval's loglikelihood tasks sum. One function serves the whole model and a
//! tensor-parallel rank; they differ only in how a chunk of hidden states becomes logits.

use tch::{Kind, Tensor};

use super::{CausalLm, LOGPROB_CHUNK_ELEMENTS};
use crate::error::{Error, Result};

/// The scores of a prompt's tokens 1..S (token 0 has none), in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PromptLogprobs {
    pub logprobs: Vec<f32>,
    /// 1 for the most likely token.
    pub ranks: Vec<i64>,
    /// The most likely tokens at each position, most likely first, with their logprobs.
    pub top: Vec<Vec<(i64, f32)>>,
}

/// [`PromptLogprobs`] of `ids` [1, S] from their final hidden states [1, S, hidden]:
/// `logits_of` turns a chunk of hidden states [1, L, hidden] into full logits [1, L, vocab],
/// at most [`LOGPROB_CHUNK_ELEMENTS`] of them at once.
pub(crate) fn prompt_logprobs_of(
    hidden: &Tensor,
    ids: &Tensor,
    vocab: i64,
    top: usize,
    logits_of: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<PromptLogprobs> {
    let _no_grad = tch::no_grad_guard();
    let scored = ids.size()[1] - 1;
    let chunk = (LOGPROB_CHUNK_ELEMENTS / vocab.max(1)).max(1);
    let top = i64::try_from(top).map_err(|_| Error::InvalidInput("too many top logprobs".into()))?.min(vocab);
    let mut out = PromptLogprobs::default();
    let mut start = 0;
    while start < scored {
        let len = chunk.min(scored - start);
        let logits = logits_of(&hidden.f_narrow(1, start, len)?)?;
        let logprobs = logits.f_to_kind(Kind::Float)?.f_log_softmax(-1, Kind::Float)?.f_squeeze_dim(0)?;
        let targets = ids.f_narrow(1, start + 1, len)?.f_squeeze_dim(0)?.f_unsqueeze(-1)?;
        let picked = logprobs.f_gather(-1, &targets.f_to_device(logprobs.device())?, false)?;
        let ranks = logprobs.f_gt_tensor(&picked)?.f_sum_dim_intlist(&[-1][..], false, Kind::Int64)?.f_add_scalar(1)?;
        out.logprobs.extend(Vec::<f32>::try_from(picked.f_flatten(0, -1)?.f_to_device(tch::Device::Cpu)?)?);
        out.ranks.extend(Vec::<i64>::try_from(ranks.f_to_device(tch::Device::Cpu)?)?);
        if top > 0 {
            let (values, indices) = logprobs.f_topk(top, -1, true, true)?;
            let values = Vec::<f32>::try_from(values.f_flatten(0, -1)?.f_to_device(tch::Device::Cpu)?)?;
            let indices = Vec::<i64>::try_from(indices.f_flatten(0, -1)?.f_to_device(tch::Device::Cpu)?)?;
            let rows = indices.chunks(top as usize).zip(values.chunks(top as usize));
            out.top.extend(rows.map(|(ids, values)| ids.iter().copied().zip(values.iter().copied()).collect()));
        } else {
            out.top.extend((0..len).map(|_| Vec::new()));
        }
        start += len;
    }
    Ok(out)
}

impl CausalLm {
    /// [`PromptLogprobs`] of `prompt` (at least one token), with the `top` most likely tokens
    /// at each position.
    pub fn prompt_logprobs(&self, prompt: &[i64], top: usize) -> Result<PromptLogprobs> {
        let _no_grad = tch::no_grad_guard();
        let ids = Tensor::from_slice(prompt).f_unsqueeze(0)?;
        self.check_input(&ids, None)?;
        let ids = ids.f_to_device(self.device())?;
        let hidden = self.hidden_states(&ids, None)?;
        prompt_logprobs_of(&hidden, &ids, self.cfg.vocab_size, top, |chunk| self.lm_logits(chunk))
    }
}
