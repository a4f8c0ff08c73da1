//! Tensor parallelism, Megatron style: one [`TpCausalLm`] per rank of a
//! [`keel_collective::Collective`], holding that rank's slices of the parameters.
//!
//! - q/k/v and gate/up are column-parallel (each rank computes its heads and its share of
//!   the intermediate size); o and down are row-parallel, their partial outputs summed with
//!   an all-reduce (biases added once, after it).
//! - Attention heads are split across ranks. KV heads are split too when there are at least
//!   as many as ranks; with fewer (GQA), each rank keeps the one KV head its query heads read
//!   (replication).
//! - The embedding and the LM head are vocab-parallel: a rank embeds only the ids in its
//!   vocabulary range (an all-reduce adds the rows up) and computes only its vocabulary's
//!   logits. Token logprobs use a vocab-parallel log-softmax (all-reduced max, sum of
//!   exponentials and target logit), so the full logits are never gathered.
//!
//! Training ([`TpCausalLm::train_logprobs`], then the loss's backward, then
//! [`TpCausalLm::backward`]): the collectives are not autograd operations, so the forward
//! pass is cut into segments at every point where replicated activations enter a rank's
//! slice (the input of attention and of the MLP after their norms, and the LM head). Within a
//! segment an all-reduce's output is `reduced + (partial − partial.detach())`: the reduced
//! value, with the identity as gradient, which is what a sum over ranks has. At the cut, the
//! rank's partial input gradient is all-reduced before the backward pass goes on through the
//! norm and the residual stream (Megatron's "f" operator). Every replicated value —
//! activations, their gradients, the loss — is bit-identical on every rank, so replicated
//! parameters stay identical under the same optimiser.
//!
//! Ranks must call the same methods with the same inputs, in the same order.

use std::cell::RefCell;

use keel_collective::{Collective, ReduceOp};
use tch::{Device, Kind, Tensor};

use super::{
    Attention, CausalLm, Linear, Mlp, Positions, RmsNorm, check_ids, check_temperature, chunked_token_logprobs,
    padded_ids,
    paged::{self, PagedModel},
    positions_for,
};
use crate::attention::Masks;
use crate::cache::{LayerCache, PagedCache, SeqChunk};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::packed::PackedRow;
use crate::rope::Rotary;
use crate::weights::SliceReader;

/// What one forward pass over a batch of rows needs besides the weights.
struct Pass {
    ids: Tensor,
    /// Positions without a logprob (a sequence's first token, padding).
    invalid: Tensor,
    cos: Tensor,
    sin: Tensor,
    masks: Masks,
}

/// The half-open range of `total` items that `rank` of `world` holds (as even as possible).
fn share(total: i64, rank: usize, world: usize) -> (i64, i64) {
    let (rank, world) = (rank as i64, world as i64);
    (total * rank / world, total * (rank + 1) / world)
}

/// How one parameter is spread over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Every rank holds the whole tensor (norms, and biases added after an all-reduce).
    Replicated,
    /// Every rank holds the whole tensor but applies it only to its own heads (the q/k
    /// norms): its gradient is the sum of the ranks' parts.
    PerHead,
    /// This rank holds `start..end` along `dim`; together the ranks hold the tensor once.
    Split { dim: i64, start: i64, end: i64 },
    /// Rows `start..end` of a K or V projection. With `copies` > 1 (fewer KV heads than
    /// ranks) that many ranks hold the same rows.
    KvRows { start: i64, end: i64, copies: i64 },
}

impl Layout {
    /// This rank's part of `full` (a tensor of the whole parameter's shape).
    pub fn local(&self, full: &Tensor) -> Result<Tensor> {
        Ok(match *self {
            Layout::Replicated | Layout::PerHead => full.shallow_clone(),
            Layout::Split { dim, start, end } => full.f_narrow(dim, start, end - start)?,
            Layout::KvRows { start, end, .. } => full.f_narrow(0, start, end - start)?,
        })
    }

    /// How much this rank's copy counts in a sum over ranks (the squared gradient norm):
    /// 1 for a split, 1/copies for replicated KV rows; `None` for a replicated tensor, which
    /// every rank counts once on its own.
    pub fn weight_in_sum(&self) -> Option<f64> {
        match *self {
            Layout::Replicated | Layout::PerHead => None,
            Layout::Split { .. } => Some(1.0),
            Layout::KvRows { copies, .. } => Some(1.0 / copies as f64),
        }
    }
}

/// Where a rank's parameters come from, by Hugging Face name: the whole tensor, or rows /
/// columns `start..end` of a tensor whose full shape is `shape`.
trait Source {
    fn slice(&self, name: &str, shape: &[i64], dim: usize, start: i64, end: i64) -> Result<Tensor>;

    fn whole(&self, name: &str, shape: &[i64]) -> Result<Tensor> {
        self.slice(name, shape, 0, 0, shape[0])
    }
}

/// Slices copied out of a model in memory.
struct FromModel(std::collections::HashMap<String, Tensor>);

impl Source for SliceReader {
    fn slice(&self, name: &str, shape: &[i64], dim: usize, start: i64, end: i64) -> Result<Tensor> {
        self.read(name, shape, dim, start, end)
    }
}

impl Source for FromModel {
    fn slice(&self, name: &str, shape: &[i64], dim: usize, start: i64, end: i64) -> Result<Tensor> {
        let tensor = self.0.get(name).ok_or_else(|| Error::InvalidInput(format!("the model has no `{name}`")))?;
        check_shape(name, shape, &tensor.size())?;
        Ok(tensor.f_narrow(dim as i64, start, end - start)?.detach().copy())
    }
}

fn check_shape(name: &str, expected: &[i64], found: &[i64]) -> Result<()> {
    if expected == found {
        return Ok(());
    }
    let problem =
        crate::error::WeightProblem::Shape { name: name.into(), expected: expected.to_vec(), found: found.to_vec() };
    Err(Error::Weights(vec![problem]))
}

#[derive(Debug)]
struct TpLayer {
    input_layernorm: RmsNorm,
    attention: Attention,
    o_bias: Option<Tensor>,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
    down_bias: Option<Tensor>,
    window: Option<i64>,
}

/// A parameter of this rank, by its Hugging Face name.
#[derive(Debug)]
struct Param {
    name: String,
    tensor: Tensor,
    layout: Layout,
}

/// One rank's slices of every parameter.
#[derive(Debug)]
struct Shards {
    embed_tokens: Tensor,
    layers: Vec<TpLayer>,
    norm: RmsNorm,
    lm_head: Tensor,
    /// Every parameter once (a tied LM head is the embedding), sharing storage with the
    /// fields above.
    params: Vec<Param>,
}

/// One rank's share of a [`CausalLm`].
#[derive(Debug)]
pub struct TpCausalLm<C: Collective> {
    cfg: ModelConfig,
    comm: C,
    /// This rank's vocabulary range.
    vocab: (i64, i64),
    /// This rank's KV heads.
    kv_heads: i64,
    shards: Shards,
    rotary: Rotary,
    kind: Kind,
    device: Device,
}

/// What [`TpCausalLm::train_logprobs`] keeps for [`TpCausalLm::backward`].
#[derive(Debug)]
pub struct Tape {
    /// The embedding's output (its graph reaches this rank's embedding rows).
    embedded: Tensor,
    /// The segments in forward order; the last one's output is the logprobs the loss uses.
    segments: Vec<Segment>,
}

/// One cut of the forward pass: `input` (a leaf of replicated activations) → norm →
/// `normed`, then `branch_input` (`normed` as a new leaf) → this rank's slice → `output`
/// (with the residual and the all-reduce). The final segment has no output here: its
/// branch ends in the logprobs.
#[derive(Debug)]
struct Segment {
    input: Tensor,
    normed: Tensor,
    branch_input: Tensor,
    output: Option<Tensor>,
}

/// A new leaf with the value of `x`, to collect the gradient that reaches it.
fn leaf(x: &Tensor) -> Result<Tensor> {
    Ok(x.f_detach()?.f_set_requires_grad(true)?)
}

/// Backward from `output` with `grad` as its gradient.
fn backward_with(output: &Tensor, grad: &Tensor) -> Result<()> {
    output.f_mul(&grad.f_to_kind(output.kind())?)?.f_sum(Kind::Float)?.f_backward()?;
    Ok(())
}

/// The gradient collected in `leaf`, or zeros when none reached it.
fn grad_of(leaf: &Tensor) -> Result<Tensor> {
    let grad = leaf.grad();
    if grad.defined() { Ok(grad) } else { Ok(leaf.f_zeros_like()?) }
}

impl<C: Collective> TpCausalLm<C> {
    /// The slices of `full` that rank `comm.rank()` of `comm.world_size()` holds (copied, so
    /// `full` may be dropped). Fails when the heads or the intermediate size do not divide.
    pub fn shard(full: &CausalLm, comm: C) -> Result<Self> {
        let source = FromModel(full.var_store().variables());
        Self::build(full.cfg.clone(), comm, full.device(), full.kind, &source)
    }

    /// Loads this rank's slices from a Hugging Face model directory, reading only the bytes
    /// of its slices from the (memory-mapped) safetensors files.
    pub fn load(dir: &std::path::Path, comm: C, device: Device, kind: Kind) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::MissingDirectory(dir.to_path_buf()));
        }
        if crate::lora::is_adapter_dir(dir) {
            let full = CausalLm::load(dir, device, kind)?;
            return Self::shard(&full, comm);
        }
        let cfg = ModelConfig::load(dir)?;
        let files = SliceReader::open(dir)?;
        Self::build(cfg, comm, device, kind, &files)
    }

    fn build(cfg: ModelConfig, comm: C, device: Device, kind: Kind, source: &dyn Source) -> Result<Self> {
        if !matches!(kind, Kind::Float | Kind::BFloat16 | Kind::Half) {
            return Err(Error::InvalidInput(format!("parameter dtype {kind:?} is not supported (f32, bf16, f16)")));
        }
        let (rank, world) = (comm.rank(), comm.world_size());
        let w = world as i64;
        let (heads, kv_heads) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let problem = |field: &str, value: i64, reason: String| Error::Unsupported {
            field: field.into(),
            value: value.to_string(),
            reason,
        };
        if heads % w != 0 {
            return Err(problem("num_attention_heads", heads, format!("does not split across {world} ranks")));
        }
        if kv_heads % w != 0 && w % kv_heads != 0 {
            let reason = format!("neither splits across nor replicates over {world} ranks");
            return Err(problem("num_key_value_heads", kv_heads, reason));
        }
        if cfg.vocab_size < w {
            return Err(problem("vocab_size", cfg.vocab_size, format!("is smaller than {world} ranks")));
        }
        if cfg.intermediate_size % w != 0 {
            let reason = format!("does not split across {world} ranks");
            return Err(problem("intermediate_size", cfg.intermediate_size, reason));
        }
        let shards = Shards::build(&cfg, rank, world, device, kind, source)?;
        let kv_range = if kv_heads % w == 0 { kv_heads / w } else { 1 };
        Ok(Self {
            vocab: share(cfg.vocab_size, rank, world),
            kv_heads: kv_range,
            shards,
            rotary: Rotary::new(&cfg.rope, cfg.head_dim, device)?,
            kind,
            device,
            cfg,
            comm,
        })
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn comm(&self) -> &C {
        &self.comm
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Moves this rank's parameters to `device` in place (see
    /// [`crate::device::move_in_place`]); `self.device()` brings them back.
    pub fn move_weights(&self, device: Device) -> Result<u64> {
        crate::device::move_in_place(self.shards.params.iter().map(|p| &p.tensor), device)
    }

    /// This rank's parameters (sharing storage with the model) with their HF names and
    /// layouts; a tied LM head appears once, as the embedding.
    pub fn parameters(&self) -> Vec<(String, Tensor, Layout)> {
        self.shards.params.iter().map(|p| (p.name.clone(), p.tensor.shallow_clone(), p.layout)).collect()
    }

    /// Makes every parameter collect gradients (or stop collecting them).
    pub fn set_trainable(&self, trainable: bool) -> Result<()> {
        for param in &self.shards.params {
            let _ = param.tensor.f_set_requires_grad(trainable)?;
        }
        Ok(())
    }

    /// Casts the parameters to `kind` (f32, bf16 or f16) in place.
    pub fn set_kind(&mut self, kind: Kind) -> Result<()> {
        if !matches!(kind, Kind::Float | Kind::BFloat16 | Kind::Half) {
            return Err(Error::InvalidInput(format!("parameter dtype {kind:?} is not supported (f32, bf16, f16)")));
        }
        let _no_grad = tch::no_grad_guard();
        for param in &mut self.shards.params {
            let cast = param.tensor.f_to_kind(kind)?;
            param.tensor.set_data(&cast);
        }
        self.kind = kind;
        Ok(())
    }

    fn all_reduce(&self, mut x: Tensor, op: ReduceOp) -> Result<Tensor> {
        self.comm.all_reduce(&mut x, op).map_err(Error::from)?;
        Ok(x)
    }

    /// The sum over ranks of `partial`, with the identity as its gradient with respect to
    /// `partial` (the value is exactly the all-reduced sum).
    fn reduce_sum(&self, partial: &Tensor) -> Result<Tensor> {
        let total = self.all_reduce(partial.f_detach()?.copy(), ReduceOp::Sum)?;
        if !partial.requires_grad() {
            return Ok(total);
        }
        Ok(total.f_add(&partial.f_sub(&partial.f_detach()?)?)?)
    }

    /// The vocab-parallel embedding: this rank's rows for ids in its range, zeros elsewhere,
    /// summed over the ranks.
    fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let (start, end) = self.vocab;
        let outside = ids.f_lt(start)?.f_logical_or(&ids.f_ge(end)?)?;
        let local = ids.f_sub_scalar(start)?.f_masked_fill(&outside, 0)?;
        let rows = Tensor::f_embedding(&self.shards.embed_tokens, &local, -1, false, false)?;
        let rows = rows.f_masked_fill(&outside.f_unsqueeze(-1)?, 0.0)?;
        self.reduce_sum(&rows)
    }

    /// Rotary tables and masks for `ids` [B, S] whose row b starts at `offsets[b]` and sees
    /// `visible` keys.
    fn positions(&self, ids: &Tensor, offsets: &[i64], visible: i64) -> Result<(Tensor, Tensor, Masks)> {
        positions_for(&self.rotary, self.kind, &self.windows(), ids, offsets, visible, self.device)
    }

    fn windows(&self) -> Vec<Option<i64>> {
        self.shards.layers.iter().map(|l| l.window).collect()
    }

    /// The decoder stack over `ids` with the rotary tables and masks of its positions.
    fn run_layers_at(
        &self,
        ids: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        masks: &Masks,
        mut cache: Option<&mut dyn LayerCache>,
    ) -> Result<Tensor> {
        let mut x = self.embed(ids)?;
        for (index, layer) in self.shards.layers.iter().enumerate() {
            let at = Positions::of(cos, sin, masks, layer.window);
            let normed = layer.input_layernorm.forward(&x, None)?;
            let attn = layer.attention.forward(&normed, &at, cache.as_deref_mut().map(|c| (c, index)))?;
            let attn = add_bias(self.all_reduce(attn, ReduceOp::Sum)?, layer.o_bias.as_ref())?;
            let h = x.f_add(&attn)?;
            let mlp = layer.mlp.forward(&layer.post_attention_layernorm.forward(&h, None)?, None)?;
            let mlp = add_bias(self.all_reduce(mlp, ReduceOp::Sum)?, layer.down_bias.as_ref())?;
            x = h.f_add(&mlp)?;
        }
        self.shards.norm.forward(&x, None)
    }

    /// The chunk length of the logprob loop: the same on every rank (each must make the same
    /// collective calls), from the largest vocabulary share, not this rank's.
    fn largest_vocab_share(&self) -> i64 {
        let world = self.world_size() as i64;
        (self.cfg.vocab_size + world - 1) / world
    }

    /// Token logprobs [B, S] (f32) of right-padded sequences, as
    /// [`CausalLm::token_logprobs`] computes them, on every rank. No gradients.
    pub fn token_logprobs(&self, input_ids: &Tensor, lengths: &[i64], temperature: f64) -> Result<Tensor> {
        check_temperature(temperature)?;
        let _no_grad = tch::no_grad_guard();
        let pass = self.padded_pass(input_ids, lengths)?;
        let hidden = self.run_layers_at(&pass.ids, &pass.cos, &pass.sin, &pass.masks, None)?;
        self.pass_logprobs(&hidden, &pass, temperature)
    }

    /// [`TpCausalLm::token_logprobs`] of the sequences packed in `row` (see
    /// [`CausalLm::packed_token_logprobs`]), right-padded [n, S]. No gradients.
    pub fn packed_token_logprobs(&self, row: &PackedRow, temperature: f64) -> Result<Tensor> {
        check_temperature(temperature)?;
        let _no_grad = tch::no_grad_guard();
        let pass = self.packed_pass(row)?;
        let hidden = self.run_layers_at(&pass.ids, &pass.cos, &pass.sin, &pass.masks, None)?;
        row.unpack(&self.pass_logprobs(&hidden, &pass, temperature)?)
    }

    /// Token logprobs as [`TpCausalLm::token_logprobs`], with gradients: the caller computes
    /// its loss from them, runs the loss's backward, then passes the tape to
    /// [`TpCausalLm::backward`] to carry the gradients through the rest of the model.
    pub fn train_logprobs(&self, input_ids: &Tensor, lengths: &[i64], temperature: f64) -> Result<(Tensor, Tape)> {
        check_temperature(temperature)?;
        let pass = self.padded_pass(input_ids, lengths)?;
        self.taped_logprobs(&pass, temperature)
    }

    /// [`TpCausalLm::train_logprobs`] of the sequences packed in `row`, right-padded [n, S].
    pub fn packed_train_logprobs(&self, row: &PackedRow, temperature: f64) -> Result<(Tensor, Tape)> {
        check_temperature(temperature)?;
        let pass = self.packed_pass(row)?;
        let (packed, tape) = self.taped_logprobs(&pass, temperature)?;
        Ok((row.unpack(&packed)?, tape))
    }

    /// Right-padded rows as a pass: ids (padding as token 0), the positions' rotary tables
    /// and causal masks, and the positions without a logprob (padding).
    fn padded_pass(&self, input_ids: &Tensor, lengths: &[i64]) -> Result<Pass> {
        let (ids, invalid) = padded_ids(self.cfg.vocab_size, self.device, input_ids, lengths)?;
        let (b, s) = (ids.size()[0], ids.size()[1]);
        let (cos, sin, masks) = self.positions(&ids, &vec![0; b as usize], s)?;
        Ok(Pass { ids, invalid, cos, sin, masks })
    }

    /// A packed row as a pass: each sequence at its own positions, attending to itself; its
    /// first token has no logprob.
    fn packed_pass(&self, row: &PackedRow) -> Result<Pass> {
        check_ids(self.cfg.vocab_size, &row.ids, None)?;
        let (cos, sin) = self.rotary.cos_sin(&row.positions(self.device)?, self.kind)?;
        let ids = row.ids.f_to_device(self.device)?;
        Ok(Pass { ids, invalid: row.starts(self.device)?, cos, sin, masks: row.masks(&self.windows()) })
    }

    /// The logprobs of a pass's tokens from its final hidden states, the vocabulary split
    /// over the ranks.
    fn pass_logprobs(&self, hidden: &Tensor, pass: &Pass, temperature: f64) -> Result<Tensor> {
        let logprobs = |logits: &Tensor, targets: &Tensor| self.vocab_parallel_logprobs(logits, targets);
        let share = self.largest_vocab_share();
        chunked_token_logprobs(hidden, &pass.ids, &pass.invalid, &self.shards.lm_head, share, temperature, logprobs)
    }

    /// A pass with gradients, cut into residual segments for [`TpCausalLm::backward`].
    fn taped_logprobs(&self, pass: &Pass, temperature: f64) -> Result<(Tensor, Tape)> {
        let embedded = self.embed(&pass.ids)?;
        let mut segments = Vec::with_capacity(2 * self.shards.layers.len() + 1);
        let mut x = embedded.shallow_clone();
        for layer in &self.shards.layers {
            let at = Positions::of(&pass.cos, &pass.sin, &pass.masks, layer.window);
            let attention = |a: &Tensor| layer.attention.forward(a, &at, None);
            x = self.segment(&x, &layer.input_layernorm, attention, layer.o_bias.as_ref(), &mut segments)?;
            let mlp = |a: &Tensor| layer.mlp.forward(a, None);
            x = self.segment(&x, &layer.post_attention_layernorm, mlp, layer.down_bias.as_ref(), &mut segments)?;
        }
        let input = leaf(&x)?;
        let normed = self.shards.norm.forward(&input, None)?;
        let branch_input = leaf(&normed)?;
        let result = self.pass_logprobs(&branch_input, pass, temperature)?;
        segments.push(Segment { input, normed, branch_input, output: None });
        Ok((result, Tape { embedded, segments }))
    }

    /// One residual block cut for training: x + all-reduce(branch(norm(x))) + bias.
    fn segment(
        &self,
        x: &Tensor,
        norm: &RmsNorm,
        branch: impl FnOnce(&Tensor) -> Result<Tensor>,
        bias: Option<&Tensor>,
        segments: &mut Vec<Segment>,
    ) -> Result<Tensor> {
        let input = leaf(x)?;
        let normed = norm.forward(&input, None)?;
        let branch_input = leaf(&normed)?;
        let partial = branch(&branch_input)?;
        let output = input.f_add(&add_bias(self.reduce_sum(&partial)?, bias)?)?;
        segments.push(Segment { input, normed, branch_input, output: Some(output.shallow_clone()) });
        Ok(output)
    }

    /// Carries the gradients of a [`TpCausalLm::train_logprobs`] pass back through the model,
    /// after the loss's own backward reached the logprobs: gradients accumulate into the
    /// parameters as `backward()` does. Every rank must call it.
    pub fn backward(&self, tape: Tape) -> Result<()> {
        let mut upstream: Option<Tensor> = None;
        for segment in tape.segments.into_iter().rev() {
            if let (Some(output), Some(grad)) = (&segment.output, &upstream) {
                backward_with(output, grad)?;
            }
            let partial = grad_of(&segment.branch_input)?;
            let full = self.all_reduce(partial.copy(), ReduceOp::Sum)?;
            backward_with(&segment.normed, &full)?;
            upstream = Some(grad_of(&segment.input)?);
        }
        if let Some(grad) = upstream
            && tape.embedded.requires_grad()
        {
            backward_with(&tape.embedded, &grad)?;
        }
        Ok(())
    }

    /// Completes the gradients of tensors several ranks apply to their own heads: the q/k
    /// norms (summed over all ranks) and, with fewer KV heads than ranks, the K/V rows each
    /// copy of a KV head holds (summed over the ranks sharing it). Call it once per
    /// optimiser step, after the last backward pass and before clipping.
    pub fn reduce_replicated_gradients(&self) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        for param in &self.shards.params {
            if param.layout == Layout::PerHead {
                let mut grad = param.tensor.grad();
                if grad.defined() {
                    let sum = self.all_reduce(grad.copy(), ReduceOp::Sum)?;
                    grad.f_copy_(&sum)?;
                }
                continue;
            }
            let Layout::KvRows { copies, .. } = param.layout else { continue };
            if copies == 1 {
                continue;
            }
            // Every rank ran the same passes, so either all have this gradient or none.
            let mut grad = param.tensor.grad();
            if !grad.defined() {
                continue;
            }
            let local = grad.shallow_clone();
            let gathered = self.gather(&local, 0)?;
            let rows = local.size()[0];
            let first = (self.rank() as i64 / copies) * copies;
            let sum = gathered.f_narrow(0, first * rows, copies * rows)?.f_view([copies, -1])?.f_sum_dim_intlist(
                &[0][..],
                false,
                local.kind(),
            )?;
            grad.f_copy_(&sum.f_view(local.size().as_slice())?)?;
        }
        Ok(())
    }

    /// log softmax(logits)[target] over the whole vocabulary from this rank's `logits`
    /// [B, L, local vocab] and the `targets` [B, L]: the maximum, the sum of exponentials
    /// and the target's logit are all-reduced, never the logits themselves.
    fn vocab_parallel_logprobs(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let (start, end) = self.vocab;
        // The maximum only keeps exp() in range: log-softmax does not depend on it.
        let local_max = logits.f_detach()?.f_amax(&[-1][..], false)?;
        let max = self.all_reduce(local_max, ReduceOp::Max)?;
        let shifted = logits.f_sub(&max.f_unsqueeze(-1)?)?;
        let sum_exp = self.reduce_sum(&shifted.f_exp()?.f_sum_dim_intlist(&[-1][..], false, Kind::Float)?)?;
        let outside = targets.f_lt(start)?.f_logical_or(&targets.f_ge(end)?)?;
        let local = targets.f_sub_scalar(start)?.f_masked_fill(&outside, 0)?;
        let picked = shifted.f_gather(-1, &local.f_unsqueeze(-1)?, false)?.f_squeeze_dim(-1)?;
        let picked = self.reduce_sum(&picked.f_masked_fill(&outside, 0.0)?)?;
        Ok(picked.f_sub(&sum_exp.f_log()?)?)
    }

    /// [`super::prompt::PromptLogprobs`] of `prompt`, as [`CausalLm::prompt_logprobs`]
    /// computes them, on every rank (each must call it).
    pub fn prompt_logprobs(&self, prompt: &[i64], top: usize) -> Result<super::prompt::PromptLogprobs> {
        let _no_grad = tch::no_grad_guard();
        let pass = self.padded_pass(&Tensor::from_slice(prompt).f_unsqueeze(0)?, &[prompt.len() as i64])?;
        let hidden = self.run_layers_at(&pass.ids, &pass.cos, &pass.sin, &pass.masks, None)?;
        let logits = |chunk: &Tensor| self.gather_vocab(&chunk.f_linear::<Tensor>(&self.shards.lm_head, None)?);
        super::prompt::prompt_logprobs_of(&hidden, &pass.ids, self.cfg.vocab_size, top, logits)
    }

    /// A paged cache of `blocks` blocks of this rank's KV heads (see [`PagedCache`]).
    pub fn paged_cache(&self, blocks: usize) -> Result<PagedCache> {
        PagedCache::with_kv_heads(&self.cfg, self.kv_heads, blocks, self.kind, self.device)
    }

    /// Logits [R, vocab] (inference) for `chunks` continuing their sequences in this rank's
    /// `cache`, as [`super::CausalLm::forward_paged`]. The vocabulary slices are gathered, so
    /// every rank gets the same full logits.
    pub fn forward_paged(&self, chunks: &[SeqChunk], cache: &mut PagedCache) -> Result<Tensor> {
        cache.check(self.shards.layers.len(), self.kv_heads, self.kind, self.device)?;
        let windows = self.windows();
        let vocab = self.cfg.vocab_size;
        let last = paged::last_hidden(
            chunks,
            cache,
            vocab,
            &windows,
            &self.rotary,
            self.kind,
            None,
            |ids, cos, sin, masks, step| self.run_layers_at(ids, cos, sin, masks, Some(step)),
        )?;
        self.gather_vocab(&last.f_linear::<Tensor>(&self.shards.lm_head, None)?)
    }

    /// Full logits from every rank's vocabulary slice [.., local vocab]: each slice is padded
    /// to the largest share so that every rank sends the same size, then the padding is cut.
    fn gather_vocab(&self, local: &Tensor) -> Result<Tensor> {
        let largest = self.largest_vocab_share();
        let width = self.vocab.1 - self.vocab.0;
        let dims = local.dim() as i64;
        let padded =
            if width < largest { local.f_constant_pad_nd([0, largest - width])? } else { local.shallow_clone() };
        let gathered = self.gather(&padded, dims - 1)?;
        let world = self.world_size();
        let parts = (0..world)
            .map(|rank| {
                let (start, end) = share(self.cfg.vocab_size, rank, world);
                gathered.f_narrow(dims - 1, rank as i64 * largest, end - start)
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Tensor::f_cat(&parts, dims - 1)?)
    }

    /// Copies the weights in `dir` (the same architecture and shapes) over this rank's
    /// slices; on any error the current weights are kept. Across ranks, prefer
    /// [`TpCausalLm::stage_weights`] on every rank and [`TpCausalLm::commit_weights`] only
    /// once all have staged, so that no rank swaps while another keeps the old weights.
    pub fn reload_weights(&self, dir: &std::path::Path) -> Result<()> {
        let staged = self.stage_weights(dir)?;
        self.commit_weights(staged)
    }

    /// Reads this rank's slices of the weights in `dir` and checks them against the
    /// model's, without touching the model.
    pub fn stage_weights(&self, dir: &std::path::Path) -> Result<StagedWeights> {
        if crate::lora::is_adapter_dir(dir) {
            let full = CausalLm::load(dir, self.device, self.kind)?;
            return self.stage(&self.cfg.clone(), &FromModel(full.var_store().variables()), &dir.display().to_string());
        }
        let cfg = ModelConfig::load(dir)?;
        let files = SliceReader::open(dir)?;
        self.stage(&cfg, &files, &dir.display().to_string())
    }

    /// [`TpCausalLm::stage_weights`] from whole tensors in memory, by Hugging Face name (a
    /// weights-only refit): this rank's slices are cut from them.
    pub fn stage_weights_from(&self, weights: std::collections::HashMap<String, Tensor>) -> Result<StagedWeights> {
        self.stage(&self.cfg.clone(), &FromModel(weights), "the new weights")
    }

    fn stage(&self, cfg: &ModelConfig, source: &dyn Source, what: &str) -> Result<StagedWeights> {
        let fresh = Shards::build(cfg, self.rank(), self.world_size(), self.device, self.kind, source)?;
        if fresh.params.len() != self.shards.params.len() {
            return Err(Error::InvalidInput(format!(
                "{what} have {} tensors for this rank, the model {}",
                fresh.params.len(),
                self.shards.params.len()
            )));
        }
        let problems: Vec<_> = fresh
            .params
            .iter()
            .zip(&self.shards.params)
            .filter(|(new, current)| new.name != current.name || new.tensor.size() != current.tensor.size())
            .map(|(new, current)| crate::error::WeightProblem::Shape {
                name: current.name.clone(),
                expected: current.tensor.size(),
                found: new.tensor.size(),
            })
            .collect();
        if !problems.is_empty() {
            return Err(Error::Weights(problems));
        }
        Ok(StagedWeights(fresh.params.into_iter().map(|p| Some(p.tensor)).collect()))
    }

    /// This rank's slices (copies, in the model's dtype and on its device) of the weights
    /// LoRA `adapters` target, cut from `full` (whole tensors by HF name, e.g. a model's
    /// variables): the base a generator keeps to merge each new version of the adapters into.
    pub fn targeted_weights(
        &self,
        full: &std::collections::HashMap<String, Tensor>,
        adapters: &std::collections::HashMap<String, Tensor>,
    ) -> Result<std::collections::HashMap<String, Tensor>> {
        let whole = crate::lora::targeted_weights(full, adapters, Device::Cpu)?;
        let mut local = std::collections::HashMap::new();
        for param in self.shards.params.iter().filter(|p| whole.contains_key(&p.name)) {
            let slice = param.layout.local(&whole[&param.name])?;
            check_shape(&param.name, &param.tensor.size(), &slice.size())?;
            local.insert(param.name.clone(), slice.f_to_kind(self.kind)?.f_to_device(self.device)?.copy());
        }
        Ok(local)
    }

    /// Stages this rank's slices of `base + s·B·A` for the linears `adapters` target (whole
    /// A and B; `base` from [`TpCausalLm::targeted_weights`]); the other parameters stay as
    /// they are. Commit with [`TpCausalLm::commit_weights`].
    pub fn stage_adapters(
        &self,
        base: &std::collections::HashMap<String, Tensor>,
        adapters: &std::collections::HashMap<String, Tensor>,
        scale: f64,
    ) -> Result<StagedWeights> {
        let layouts: std::collections::HashMap<&str, Layout> =
            self.shards.params.iter().map(|p| (p.name.as_str(), p.layout)).collect();
        let cut = |name: &str, delta: Tensor| match layouts.get(name) {
            Some(layout) => layout.local(&delta),
            None => Err(Error::InvalidInput(format!("the model has no `{name}`"))),
        };
        let mut merged = crate::lora::merged_weights(base, adapters, scale, cut)?;
        Ok(StagedWeights(self.shards.params.iter().map(|p| merged.remove(&p.name)).collect()))
    }

    /// Copies weights staged by [`TpCausalLm::stage_weights`] into the model (only those
    /// staged: an adapter refit stages the linears it targets).
    pub fn commit_weights(&self, staged: StagedWeights) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        for (new, current) in staged.0.iter().zip(&self.shards.params) {
            if let Some(new) = new {
                current.tensor.shallow_clone().f_copy_(new)?;
            }
        }
        Ok(())
    }
}

/// A rank's slices of new weights, read and checked, not yet in the model (`None`: the
/// parameter stays as it is).
#[derive(Debug)]
pub struct StagedWeights(Vec<Option<Tensor>>);

impl Shards {
    fn build(
        cfg: &ModelConfig,
        rank: usize,
        world: usize,
        device: Device,
        kind: Kind,
        source: &dyn Source,
    ) -> Result<Self> {
        let w = world as i64;
        let (heads, kv_heads, d) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let (hidden, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let (q_start, q_end) = share(heads, rank, world);
        // KV heads: split when there are enough, else the one this rank's query heads read.
        let (kv_start, kv_end, copies) = if kv_heads % w == 0 {
            let (start, end) = share(kv_heads, rank, world);
            (start, end, 1)
        } else {
            let kv = q_start / (heads / kv_heads);
            (kv, kv + 1, w / kv_heads)
        };
        let (i_start, i_end) = share(inter, rank, world);
        let params = RefCell::new(Vec::new());
        let keep = |name: String, tensor: Tensor, layout: Layout| -> Tensor {
            params.borrow_mut().push(Param { name, tensor: tensor.shallow_clone(), layout });
            tensor
        };
        let to = |t: Tensor| -> Result<Tensor> { Ok(t.f_to_kind(kind)?.f_to_device(device)?) };
        let norm_as = |name: String, size: i64, layout: Layout| -> Result<RmsNorm> {
            let weight = to(source.whole(&name, &[size])?)?;
            Ok(RmsNorm { weight: keep(name, weight, layout), eps: cfg.rms_norm_eps })
        };
        let norm = |name: String, size: i64| norm_as(name, size, Layout::Replicated);
        // Output rows start..end of `name` ([outputs, inputs]), with its bias when it has one.
        let column = |name: String, outputs: i64, inputs: i64, layout: Layout, bias: bool| -> Result<Linear> {
            let (start, end) = match layout {
                Layout::Split { start, end, .. } | Layout::KvRows { start, end, .. } => (start, end),
                Layout::Replicated | Layout::PerHead => (0, outputs),
            };
            let weight_name = format!("{name}.weight");
            let weight = to(source.slice(&weight_name, &[outputs, inputs], 0, start, end)?)?;
            let weight = keep(weight_name, weight, layout);
            let bias = bias
                .then(|| {
                    let bias_name = format!("{name}.bias");
                    let bias = to(source.slice(&bias_name, &[outputs], 0, start, end)?)?;
                    Ok::<_, Error>(keep(bias_name, bias, layout))
                })
                .transpose()?;
            Ok(Linear { weight, bias, adapter: None })
        };
        // Input columns start..end of `name`; its bias comes back apart (added after the all-reduce).
        let row = |name: String, outputs: i64, inputs: i64, start: i64, end: i64, bias: bool| {
            let weight_name = format!("{name}.weight");
            let weight = to(source.slice(&weight_name, &[outputs, inputs], 1, start, end)?)?;
            let weight = keep(weight_name, weight, Layout::Split { dim: 1, start, end });
            let bias = bias
                .then(|| {
                    let bias_name = format!("{name}.bias");
                    let bias = to(source.whole(&bias_name, &[outputs])?)?;
                    Ok::<_, Error>(keep(bias_name, bias, Layout::Replicated))
                })
                .transpose()?;
            Ok::<_, Error>((Linear { weight, bias: None, adapter: None }, bias))
        };
        let vocab = share(cfg.vocab_size, rank, world);
        let vocab_rows = Layout::Split { dim: 0, start: vocab.0, end: vocab.1 };
        let embedding = [cfg.vocab_size, hidden];
        let embed_name = "model.embed_tokens.weight".to_string();
        let embed_tokens = to(source.slice(&embed_name, &embedding, 0, vocab.0, vocab.1)?)?;
        let embed_tokens = keep(embed_name, embed_tokens, vocab_rows);
        let layers = (0..cfg.num_hidden_layers as usize)
            .map(|i| {
                let p = |name: &str| format!("model.layers.{i}.{name}");
                let q_rows = Layout::Split { dim: 0, start: q_start * d, end: q_end * d };
                let kv_rows = Layout::KvRows { start: kv_start * d, end: kv_end * d, copies };
                let input_layernorm = norm(p("input_layernorm.weight"), hidden)?;
                let (o_proj, o_bias) =
                    row(p("self_attn.o_proj"), hidden, heads * d, q_start * d, q_end * d, cfg.o_bias)?;
                let attention = Attention {
                    q_proj: column(p("self_attn.q_proj"), heads * d, hidden, q_rows, cfg.qkv_bias)?,
                    k_proj: column(p("self_attn.k_proj"), kv_heads * d, hidden, kv_rows, cfg.qkv_bias)?,
                    v_proj: column(p("self_attn.v_proj"), kv_heads * d, hidden, kv_rows, cfg.qkv_bias)?,
                    o_proj,
                    q_norm: cfg
                        .qk_norm
                        .then(|| norm_as(p("self_attn.q_norm.weight"), d, Layout::PerHead))
                        .transpose()?,
                    k_norm: cfg
                        .qk_norm
                        .then(|| norm_as(p("self_attn.k_norm.weight"), d, Layout::PerHead))
                        .transpose()?,
                    heads: heads / w,
                    kv_heads: kv_end - kv_start,
                    head_dim: d,
                };
                let post_attention_layernorm = norm(p("post_attention_layernorm.weight"), hidden)?;
                let i_cols = Layout::Split { dim: 0, start: i_start, end: i_end };
                let gate_proj = column(p("mlp.gate_proj"), inter, hidden, i_cols, cfg.mlp_bias)?;
                let up_proj = column(p("mlp.up_proj"), inter, hidden, i_cols, cfg.mlp_bias)?;
                let (down_proj, down_bias) = row(p("mlp.down_proj"), hidden, inter, i_start, i_end, cfg.mlp_bias)?;
                Ok(TpLayer {
                    input_layernorm,
                    attention,
                    o_bias,
                    post_attention_layernorm,
                    mlp: Mlp { gate_proj, up_proj, down_proj },
                    down_bias,
                    window: cfg.sliding_windows[i],
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = norm("model.norm.weight".into(), hidden)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens.shallow_clone()
        } else {
            let name = "lm_head.weight".to_string();
            let head = to(source.slice(&name, &embedding, 0, vocab.0, vocab.1)?)?;
            keep(name, head, vocab_rows)
        };
        Ok(Self { embed_tokens, layers, norm, lm_head, params: params.into_inner() })
    }
}

impl<C: Collective> TpCausalLm<C> {
    fn gather(&self, tensor: &Tensor, dim: i64) -> Result<Tensor> {
        self.comm.all_gather(tensor, dim).map_err(Error::from)
    }

    /// The whole tensor from every rank's `local` part laid out as `layout` (every rank must
    /// call it; every rank gets the same tensor). With replicated KV rows, the copy of the
    /// first rank holding each head is kept.
    pub fn gather_parameter(&self, local: &Tensor, layout: Layout) -> Result<Tensor> {
        match layout {
            Layout::Replicated | Layout::PerHead => Ok(local.shallow_clone()),
            Layout::Split { dim, .. } => self.gather(local, dim),
            Layout::KvRows { copies, .. } => {
                let gathered = self.gather(local, 0)?;
                if copies == 1 {
                    return Ok(gathered);
                }
                let chunk = local.size()[0];
                let firsts: Vec<Tensor> = (0..self.cfg.num_key_value_heads)
                    .map(|k| gathered.f_narrow(0, k * copies * chunk, chunk))
                    .collect::<std::result::Result<_, _>>()?;
                Ok(Tensor::f_cat(&firsts, 0)?)
            }
        }
    }

    /// The whole model, gathered from every rank's slices (every rank must call it; every
    /// rank gets the same model). Saving a tensor-parallel model goes through this, so its
    /// checkpoint is the Hugging Face layout a TP = 1 model (or transformers) loads.
    pub fn gather_full(&self) -> Result<CausalLm> {
        self.gather_full_on(self.device, true)?
            .ok_or_else(|| Error::InvalidInput("tensor parallel: nothing was gathered".into()))
    }

    /// [`TpCausalLm::gather_full`] into a model on `device`, kept only where `keep` (rank 0
    /// saving a checkpoint keeps it on the CPU; the other ranks take part in the gathers and
    /// keep nothing). Only one whole parameter at a time is held on this rank's device.
    pub fn gather_full_on(&self, device: Device, keep: bool) -> Result<Option<CausalLm>> {
        let _no_grad = tch::no_grad_guard();
        // Every rank makes the same gathers; a problem on the keeping rank (building the
        // model, copying into it) is reported after them, so no rank is left waiting in a
        // collective.
        let mut problem: Option<Error> = None;
        let full = if keep {
            CausalLm::new(self.cfg.clone(), device, self.kind, crate::Init::Zeros).map_err(|e| problem = Some(e)).ok()
        } else {
            None
        };
        let mut variables = full.as_ref().map(|f| f.var_store().variables());
        for param in &self.shards.params {
            let value = self.gather_parameter(&param.tensor.f_detach()?, param.layout)?;
            let Some(variables) = variables.as_mut() else { continue };
            let copied = match variables.get_mut(&param.name) {
                Some(target) => target.f_copy_(&value).map_err(Error::from),
                None => {
                    Err(Error::InvalidInput(format!("tensor parallel: no parameter `{}` to gather into", param.name)))
                }
            };
            if let Err(e) = copied {
                problem.get_or_insert(e);
            }
        }
        if let Some(e) = problem {
            return Err(e);
        }
        if let Some(variables) = &variables
            && variables.len() != self.shards.params.len()
        {
            return Err(Error::InvalidInput(format!(
                "tensor parallel: gathered {} tensors for a model of {}",
                self.shards.params.len(),
                variables.len()
            )));
        }
        Ok(full)
    }
}

fn add_bias(x: Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    Ok(match bias {
        Some(bias) => x.f_add(bias)?,
        None => x,
    })
}

/// A rank decodes from its own pool of its KV heads; its logits are gathered over the vocabulary.
impl<C: Collective> PagedModel for TpCausalLm<C> {
    fn config(&self) -> &ModelConfig {
        TpCausalLm::config(self)
    }

    fn paged_cache(&self, blocks: usize) -> Result<PagedCache> {
        TpCausalLm::paged_cache(self, blocks)
    }

    fn forward_paged(&self, chunks: &[SeqChunk], cache: &mut PagedCache) -> Result<Tensor> {
        TpCausalLm::forward_paged(self, chunks, cache)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Init;
    use keel_collective::cpu::CpuGroup;
    use serde_json::json;

    fn config(arch: &str, heads: i64, kv_heads: i64, extra: serde_json::Value) -> ModelConfig {
        let mut value = json!({
            "architectures": [arch], "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "vocab_size": 101, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
        });
        if let (Some(value), Some(extra)) = (value.as_object_mut(), extra.as_object()) {
            value.extend(extra.clone());
        }
        ModelConfig::from_json(value).expect("a valid config")
    }

    /// Random biases and norm weights too (the initialisation makes them 0 and 1), so a bias
    /// added twice or not at all shows.
    fn randomize_biases_and_norms(full: &CausalLm) {
        let _no_grad = tch::no_grad_guard();
        for (name, mut value) in full.var_store().variables() {
            if name.ends_with("bias") || name.contains("norm") {
                let noise = Tensor::randn(value.size(), (Kind::Float, Device::Cpu)) * 0.3;
                value.copy_(&(value.shallow_clone() + noise));
            }
        }
    }

    /// `f(rank's shard of full)` on `world` threads, the results in rank order.
    fn on_shards<T: Send + 'static>(
        full: &CausalLm,
        world: usize,
        f: impl Fn(TpCausalLm<keel_collective::cpu::CpuCollective>) -> T + Send + Clone + 'static,
    ) -> Vec<T> {
        let shards: Vec<_> = CpuGroup::new(world)
            .expect("a group")
            .into_iter()
            .map(|comm| TpCausalLm::shard(full, comm).expect("a shard"))
            .collect();
        let threads: Vec<_> = shards
            .into_iter()
            .map(|model| {
                let f = f.clone();
                std::thread::spawn(move || f(model))
            })
            .collect();
        threads.into_iter().map(|t| t.join().expect("a rank")).collect()
    }

    /// Max |TP logprobs − TP=1 logprobs| over every rank, for each world size.
    fn compare(cfg: ModelConfig, worlds: &[usize]) -> Vec<(usize, f64)> {
        tch::manual_seed(11);
        let full = CausalLm::new(cfg, Device::Cpu, Kind::Float, Init::Random { std: 0.2 }).expect("a model");
        randomize_biases_and_norms(&full);
        let _no_grad = tch::no_grad_guard();
        let rows: Vec<i64> = (0..2 * 13).map(|i| (i * 37 + 5) % 101).collect();
        let ids = Tensor::from_slice(&rows).view([2, 13]);
        let lengths = [13, 9];
        let expected = full.token_logprobs(&ids, &lengths, 0.7).expect("TP=1 logprobs").detach();
        worlds
            .iter()
            .map(|&world| {
                let rows = rows.clone();
                let results = on_shards(&full, world, move |model| {
                    let ids = Tensor::from_slice(&rows).view([2, 13]);
                    model.token_logprobs(&ids, &lengths, 0.7).expect("TP logprobs")
                });
                let diff = results
                    .into_iter()
                    .map(|got| got.f_sub(&expected).expect("same shape").abs().max().double_value(&[]))
                    .fold(0.0, f64::max);
                (world, diff)
            })
            .collect()
    }

    /// Prompt logprobs (echo, `prompt_logprobs`) are the scorer's token logprobs at
    /// temperature 1, with ranks and top tokens that agree with them, and every rank of TP 2
    /// and 4 gives what the whole model gives.
    #[test]
    fn prompt_logprobs_agree_with_the_scorer_at_every_tp_size() {
        tch::manual_seed(5);
        let full = CausalLm::new(
            config("Qwen2ForCausalLM", 4, 2, json!({})),
            Device::Cpu,
            Kind::Float,
            Init::Random { std: 0.3 },
        )
        .expect("a model");
        randomize_biases_and_norms(&full);
        let prompt: Vec<i64> = (0..11).map(|i| (i * 29 + 3) % 101).collect();
        let want = full.prompt_logprobs(&prompt, 4).expect("prompt logprobs");
        assert_eq!((want.logprobs.len(), want.ranks.len(), want.top.len()), (10, 10, 10));
        let scored = full
            .token_logprobs(&Tensor::from_slice(&prompt).unsqueeze(0), &[prompt.len() as i64], 1.0)
            .expect("the scorer");
        let scored = Vec::<f32>::try_from(scored.get(0)).expect("floats");
        for (i, logprob) in want.logprobs.iter().enumerate() {
            assert!((logprob - scored[i + 1]).abs() < 1e-5, "position {}: {logprob} vs {}", i + 1, scored[i + 1]);
            let top = &want.top[i];
            assert_eq!(top.len(), 4);
            assert!(top.windows(2).all(|w| w[0].1 >= w[1].1), "most likely first: {top:?}");
            let above = top.iter().filter(|(_, l)| l > logprob).count() as i64;
            assert!(want.ranks[i] > above && (want.ranks[i] > 4 || want.ranks[i] == above + 1));
            if want.ranks[i] == 1 {
                assert_eq!(top[0].0, prompt[i + 1]);
            }
        }
        for world in [2, 4] {
            let prompt = prompt.clone();
            for got in on_shards(&full, world, move |model| model.prompt_logprobs(&prompt, 4).expect("TP")) {
                assert_eq!(
                    (&got.ranks, got.top.iter().map(|t| t[0].0).collect::<Vec<_>>()),
                    (&want.ranks, want.top.iter().map(|t| t[0].0).collect())
                );
                let diff = got.logprobs.iter().zip(&want.logprobs).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
                assert!(diff < 1e-5, "TP {world}: {diff:e}");
            }
        }
    }

    #[test]
    fn logprobs_at_tp_2_and_4_equal_tp_1() {
        // Qwen3: q/k norms; 4 KV heads split over 2 and 4 ranks.
        for (world, diff) in compare(config("Qwen3ForCausalLM", 8, 4, json!({"head_dim": 16})), &[2, 4]) {
            assert!(diff <= 1e-5, "qwen3 TP={world}: max diff {diff:e}");
        }
        // Qwen2: q/k/v biases; 2 KV heads replicated over 4 ranks (GQA), tied embeddings.
        let qwen2 = config("Qwen2ForCausalLM", 4, 2, json!({"tie_word_embeddings": true}));
        for (world, diff) in compare(qwen2, &[2, 4]) {
            assert!(diff <= 1e-5, "qwen2 TP={world}: max diff {diff:e}");
        }
        // Llama with biases on o and the MLP, a vocabulary that does not divide by 4.
        let llama = config("LlamaForCausalLM", 4, 4, json!({"attention_bias": true, "mlp_bias": true}));
        for (world, diff) in compare(llama, &[2, 4]) {
            assert!(diff <= 1e-5, "llama TP={world}: max diff {diff:e}");
        }
    }

    #[test]
    fn ranks_loading_their_slices_from_a_checkpoint_match_the_model() {
        let dir = tempfile::tempdir().expect("a directory");
        for cfg in [
            config("LlamaForCausalLM", 4, 4, json!({"attention_bias": true, "mlp_bias": true})),
            config("Qwen2ForCausalLM", 4, 2, json!({"tie_word_embeddings": true})),
        ] {
            tch::manual_seed(5);
            let full = CausalLm::new(cfg, Device::Cpu, Kind::Float, Init::Random { std: 0.2 }).expect("a model");
            randomize_biases_and_norms(&full);
            full.save(dir.path(), crate::SaveOptions { max_shard_bytes: 60_000 }).expect("saved in several shards");
            let ids = Tensor::from_slice(&[3i64, 17, 99, 42, 7, 64, 100, 0]).view([1, 8]);
            let expected = full.token_logprobs(&ids, &[8], 1.0).expect("logprobs").detach();
            for world in [2, 4] {
                let threads: Vec<_> = CpuGroup::new(world)
                    .expect("a group")
                    .into_iter()
                    .map(|comm| {
                        let (path, ids) = (dir.path().to_path_buf(), ids.copy());
                        std::thread::spawn(move || {
                            let model = TpCausalLm::load(&path, comm, Device::Cpu, Kind::Float).expect("loaded");
                            model.token_logprobs(&ids, &[8], 1.0).expect("TP logprobs")
                        })
                    })
                    .collect();
                for thread in threads {
                    let diff = (thread.join().expect("a rank") - &expected).abs().max().double_value(&[]);
                    assert!(diff <= 1e-5, "TP={world} from the checkpoint: max diff {diff:e}");
                }
            }
        }
        let comm = CpuGroup::new(1).expect("a group").into_iter().next().expect("rank 0");
        let missing = TpCausalLm::load(&dir.path().join("nope"), comm, Device::Cpu, Kind::Float);
        assert!(missing.expect_err("no directory").to_string().contains("does not exist"));
    }

    #[test]
    fn gathered_shards_are_the_model_again() {
        for cfg in [
            config("Qwen2ForCausalLM", 4, 2, json!({})),
            config("LlamaForCausalLM", 4, 4, json!({"attention_bias": true, "mlp_bias": true})),
            config("Qwen3ForCausalLM", 8, 4, json!({"head_dim": 16, "tie_word_embeddings": true})),
        ] {
            tch::manual_seed(3);
            let full = CausalLm::new(cfg, Device::Cpu, Kind::Float, Init::Random { std: 0.2 }).expect("a model");
            randomize_biases_and_norms(&full);
            let original = full.var_store().variables();
            for world in [2, 4] {
                let results = on_shards(&full, world, |model| {
                    let gathered = model.gather_full().expect("gathered");
                    gathered.var_store().variables().into_iter().map(|(k, v)| (k, v.detach())).collect::<Vec<_>>()
                });
                for gathered in results {
                    assert_eq!(gathered.len(), original.len());
                    for (name, value) in gathered {
                        assert!(value.equal(&original[&name]), "TP={world}: `{name}` differs after the round trip");
                    }
                }
            }
        }
    }

    /// A loss over token logprobs with fixed per-token weights (the same on every rank).
    fn weighted_loss(logprobs: &Tensor) -> Tensor {
        let size = logprobs.size();
        let weights = Tensor::arange(size[0] * size[1], (Kind::Float, Device::Cpu)).view([size[0], size[1]]);
        let weights = (weights * 0.37).sin();
        (logprobs * weights).sum(Kind::Float)
    }

    #[test]
    fn gradients_at_tp_2_and_4_equal_tp_1() {
        let cases = [
            config("Qwen3ForCausalLM", 8, 4, json!({"head_dim": 16})),
            // 2 KV heads replicated over 4 ranks; tied embeddings; q/k/v biases.
            config("Qwen2ForCausalLM", 4, 2, json!({"tie_word_embeddings": true})),
            config("LlamaForCausalLM", 4, 4, json!({"attention_bias": true, "mlp_bias": true})),
        ];
        for cfg in cases {
            tch::manual_seed(21);
            let full = CausalLm::new(cfg, Device::Cpu, Kind::Float, Init::Random { std: 0.2 }).expect("a model");
            randomize_biases_and_norms(&full);
            let rows: Vec<i64> = (0..3 * 11).map(|i| (i * 53 + 7) % 101).collect();
            let lengths = [11, 6, 9];
            let ids = Tensor::from_slice(&rows).view([3, 11]);
            let expected_lp = full.token_logprobs(&ids, &lengths, 0.8).expect("TP=1 logprobs");
            weighted_loss(&expected_lp).backward();
            let expected: std::collections::HashMap<String, Tensor> =
                full.var_store().variables().into_iter().map(|(name, value)| (name, value.grad().copy())).collect();
            for world in [2, 4] {
                let rows = rows.clone();
                let results = on_shards(&full, world, move |model| {
                    model.set_trainable(true).expect("trainable");
                    let ids = Tensor::from_slice(&rows).view([3, 11]);
                    let (logprobs, tape) = model.train_logprobs(&ids, &lengths, 0.8).expect("TP logprobs");
                    weighted_loss(&logprobs).backward();
                    model.backward(tape).expect("TP backward");
                    model.reduce_replicated_gradients().expect("replicated KV gradients");
                    let grads: Vec<(String, Tensor)> = model
                        .parameters()
                        .into_iter()
                        .map(|(name, value, layout)| {
                            (name, model.gather_parameter(&value.grad(), layout).expect("gathered gradient"))
                        })
                        .collect();
                    (logprobs.detach(), grads)
                });
                for (logprobs, grads) in results {
                    let diff = (logprobs - &expected_lp.detach()).abs().max().double_value(&[]);
                    assert!(diff <= 1e-5, "TP={world}: logprobs with gradients differ by {diff:e}");
                    assert_eq!(grads.len(), expected.len());
                    for (name, grad) in grads {
                        let reference = &expected[&name];
                        let scale = reference.abs().max().double_value(&[]).max(1.0);
                        let diff = (grad - reference).abs().max().double_value(&[]);
                        assert!(diff <= 1e-5 * scale, "TP={world}: gradient of `{name}` differs by {diff:e}");
                    }
                }
            }
        }
    }

    #[test]
    fn cached_decoding_at_tp_2_equals_tp_1() {
        let cfg = config("Qwen2ForCausalLM", 4, 2, json!({"attention_bias": true}));
        tch::manual_seed(8);
        let full = CausalLm::new(cfg, Device::Cpu, Kind::Float, Init::Random { std: 0.2 }).expect("a model");
        randomize_biases_and_norms(&full);
        // Two prompts prefilled into blocks 2 and 0, then three decode steps of both together.
        let run = |forward: &mut dyn FnMut(&[SeqChunk]) -> Tensor| -> Vec<Tensor> {
            let chunk = |tokens: Vec<i64>, context: usize, block: u32| SeqChunk {
                tokens,
                context,
                blocks: vec![block],
                logits: true,
            };
            let mut out = vec![forward(&[chunk(vec![5, 9, 33, 71, 2], 0, 2), chunk(vec![40, 41, 100], 0, 0)])];
            for step in 0..3i64 {
                let at = step as usize;
                out.push(forward(&[chunk(vec![step + 10], 3 + at, 0), chunk(vec![step + 60], 5 + at, 2)]));
            }
            out
        };
        let mut cache = PagedCache::new(full.config(), 3, Kind::Float, Device::Cpu).expect("a cache");
        let expected = run(&mut |chunks| full.forward_paged(chunks, &mut cache).expect("TP=1 forward"));
        for world in [2, 4] {
            let results = on_shards(&full, world, move |model| {
                let mut cache = model.paged_cache(3).expect("a rank's cache");
                run(&mut |chunks| model.forward_paged(chunks, &mut cache).expect("TP forward"))
            });
            for logits in results {
                for (got, want) in logits.iter().zip(&expected) {
                    assert_eq!(got.size(), want.size());
                    let diff = (got - want).abs().max().double_value(&[]);
                    assert!(diff <= 1e-5, "TP={world}: cached logits differ by {diff:e}");
                }
            }
        }
    }

    #[test]
    fn shapes_that_do_not_split_are_refused() {
        let full = CausalLm::new(config("Qwen3ForCausalLM", 6, 3, json!({})), Device::Cpu, Kind::Float, Init::Zeros)
            .expect("a model");
        let comm = CpuGroup::new(4).expect("a group").into_iter().next().expect("rank 0");
        let error = TpCausalLm::shard(&full, comm).expect_err("6 heads over 4 ranks").to_string();
        assert!(error.contains("num_attention_heads"), "{error}");
    }
}
