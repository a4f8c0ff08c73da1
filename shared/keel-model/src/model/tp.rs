//! Tensor parallelism, Megatron style: a [`CausalLm`] can be one rank of a
//! [`keel_collective::Collective`] group, holding that rank's slices of the parameters
//! ([`CausalLm::shard`], [`CausalLm::load_shard`]). The layers and the forward passes are
//! the whole model's; what a rank adds is here.
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
//! Training ([`CausalLm::train_logprobs`], then the loss's backward, then
//! [`CausalLm::backward`]): the collectives are not autograd operations, so the forward
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

use keel_collective::{ReduceOp, SharedComm};
use tch::{Device, Kind, Tensor, nn};

use super::{
    Attention, CausalLm, DecoderLayer, Experts, FeedForward, LayerNorms, Linear, Mlp, Pass, Positions, RmsNorm,
    Routers, Scores, maybe_norm,
};
use crate::config::QkNorm;
use crate::config::{ModelConfig, MoeConfig};
use crate::error::{Error, Result};
use crate::rope::Rotations;
use crate::weights::SliceReader;

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
    /// Every rank holds the whole tensor but applies it to its own part of the work only
    /// (the q/k norms to its heads; an MoE router weighting its slices of the experts): its
    /// gradient is the sum of the ranks' parts.
    PartialUse,
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
            Layout::Replicated | Layout::PartialUse => full.shallow_clone(),
            Layout::Split { dim, start, end } => full.f_narrow(dim, start, end - start)?,
            Layout::KvRows { start, end, .. } => full.f_narrow(0, start, end - start)?,
        })
    }

    /// How much this rank's copy counts in a sum over ranks (the squared gradient norm):
    /// 1 for a split, 1/copies for replicated KV rows; `None` for a replicated tensor, which
    /// every rank counts once on its own.
    pub fn weight_in_sum(&self) -> Option<f64> {
        match *self {
            Layout::Replicated | Layout::PartialUse => None,
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

/// A tensor-parallel rank's place in its group.
#[derive(Debug)]
pub(crate) struct Shard {
    comm: SharedComm,
    /// This rank's vocabulary range.
    vocab: (i64, i64),
    /// This rank's KV heads.
    kv_heads: i64,
    /// How each parameter of the model's var store (this rank's slices, by Hugging Face
    /// name) is spread over the ranks.
    layouts: std::collections::HashMap<String, Layout>,
}

/// A parameter of this rank, by its Hugging Face name.
#[derive(Debug)]
struct Param {
    name: String,
    tensor: Tensor,
    layout: Layout,
}

/// What [`CausalLm::train_logprobs`] keeps for [`CausalLm::backward`] (nothing for a whole
/// model, whose autograd graph reaches every parameter), and the pass's router
/// load-balancing loss for a mixture of experts.
#[derive(Debug, Default)]
pub struct Tape {
    /// The embedding's output (its graph reaches this rank's embedding rows).
    embedded: Option<Tensor>,
    /// The segments in forward order; the last one's output is the logprobs the loss uses.
    segments: Vec<Segment>,
    pub(crate) router_aux_loss: Option<Tensor>,
    /// What this rank adds to its loss per unit of the load-balancing loss.
    pub(crate) router_loss_weight: f64,
    /// Whether the pass ends in the replicated final hidden states (a value head's input,
    /// whose gradient every rank has whole) rather than a rank's vocabulary slice.
    replicated_end: bool,
}

impl Tape {
    /// The pass's router load-balancing loss, as transformers computes it (MoE models only;
    /// with gradients).
    pub fn router_aux_loss(&self) -> Option<&Tensor> {
        self.router_aux_loss.as_ref()
    }

    /// What training adds to this rank's loss for the load-balancing loss: `router_aux_loss_coef`
    /// × the loss when the config has `output_router_logits` (transformers' rule), divided
    /// over the ranks of a tensor-parallel group; `None` when there is nothing to add.
    pub fn router_loss(&self) -> Result<Option<Tensor>> {
        match &self.router_aux_loss {
            Some(aux) if self.router_loss_weight > 0.0 => Ok(Some(aux.f_mul_scalar(self.router_loss_weight)?)),
            _ => Ok(None),
        }
    }
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

impl CausalLm {
    /// The slices of `full` that rank `comm.rank()` of `comm.world_size()` holds (copied, so
    /// `full` may be dropped). Fails when the heads or the intermediate size do not divide.
    pub fn shard(full: &CausalLm, comm: SharedComm) -> Result<Self> {
        let source = FromModel(full.var_store().variables());
        Self::build_shard(full.cfg.clone(), comm, full.device(), full.kind, &source)
    }

    /// Loads this rank's slices from a Hugging Face model directory, reading only the bytes
    /// of its slices from the (memory-mapped) safetensors files.
    pub fn load_shard(dir: &std::path::Path, comm: SharedComm, device: Device, kind: Kind) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::MissingDirectory(dir.to_path_buf()));
        }
        if crate::lora::is_adapter_dir(dir) {
            let full = CausalLm::load(dir, device, kind)?;
            return Self::shard(&full, comm);
        }
        let cfg = ModelConfig::load(dir)?;
        let files = SliceReader::open(dir)?.with_fused(&cfg.fused_weights());
        Self::build_shard(cfg, comm, device, kind, &files)
    }

    fn build_shard(
        cfg: ModelConfig,
        comm: SharedComm,
        device: Device,
        kind: Kind,
        source: &dyn Source,
    ) -> Result<Self> {
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
        let dense = (0..cfg.num_hidden_layers as usize).any(|layer| !cfg.is_sparse_layer(layer));
        if dense && cfg.intermediate_size % w != 0 {
            let reason = format!("does not split across {world} ranks");
            return Err(problem("intermediate_size", cfg.intermediate_size, reason));
        }
        if let Some(moe) = cfg.moe.as_ref().filter(|m| m.expert_intermediate_size % w != 0) {
            let reason = format!("does not split across {world} ranks");
            return Err(problem("moe_intermediate_size", moe.expert_intermediate_size, reason));
        }
        let slices = Slices::build(&cfg, rank, world, device, kind, source)?;
        // The slices by their Hugging Face names, as a whole model holds its parameters.
        let vs = nn::VarStore::new(device);
        for param in &slices.params {
            let mut parts: Vec<&str> = param.name.split('.').collect();
            let last = parts.pop().unwrap_or_default();
            let path = parts.into_iter().fold(vs.root(), |path, part| path / part);
            let _ = path.add(last, param.tensor.shallow_clone(), false);
        }
        let kv_range = if kv_heads % w == 0 { kv_heads / w } else { 1 };
        Ok(Self {
            rotary: Rotations::new(&cfg, device)?,
            shard: Some(Shard {
                comm,
                vocab: share(cfg.vocab_size, rank, world),
                kv_heads: kv_range,
                layouts: slices.params.into_iter().map(|p| (p.name, p.layout)).collect(),
            }),
            cfg,
            vs,
            embed_tokens: slices.embed_tokens,
            layers: slices.layers,
            norm: slices.norm,
            lm_head: slices.lm_head,
            kind,
            kernels: None,
            adapters: None,
            share_prefixes: false,
        })
    }

    /// Loads `dir` whole, or this rank's slices of it when `comm` is given.
    pub fn load_on(dir: &std::path::Path, comm: Option<SharedComm>, device: Device, kind: Kind) -> Result<Self> {
        match comm {
            None => Self::load(dir, device, kind),
            Some(comm) => Self::load_shard(dir, comm, device, kind),
        }
    }

    /// This rank's place in a tensor-parallel group (rank 0 of 1 for a whole model).
    pub fn rank(&self) -> usize {
        self.shard.as_ref().map_or(0, |s| s.comm.rank())
    }

    pub fn world_size(&self) -> usize {
        self.shard.as_ref().map_or(1, |s| s.comm.world_size())
    }

    /// The communicator of a tensor-parallel rank (`None` for a whole model).
    pub fn comm(&self) -> Option<&SharedComm> {
        self.shard.as_ref().map(|s| &s.comm)
    }

    /// How many parameters the whole model has (every rank gets the same count; every rank
    /// must call it).
    pub fn parameter_count(&self) -> Result<i64> {
        let world = self.world_size() as f64;
        let local: f64 = self
            .parameters()
            .iter()
            .map(|(_, t, layout)| {
                let n = t.numel() as f64;
                match layout.weight_in_sum() {
                    // A replicated tensor counts once over the ranks.
                    None => n / world,
                    Some(weight) => n * weight,
                }
            })
            .sum();
        Ok(self.all_reduce_sum(local)?.round() as i64)
    }

    /// The sum of `value` over the ranks (itself for a whole model; every rank must call it).
    pub fn all_reduce_sum(&self, value: f64) -> Result<f64> {
        let Some(shard) = &self.shard else { return Ok(value) };
        // On the rank's device: NCCL reduces GPU tensors only.
        let t = Tensor::from_slice(&[value]).f_to_device(self.device())?;
        Ok(all_reduce(shard, t, ReduceOp::Sum)?.f_double_value(&[0])?)
    }

    /// Runs `f` on the whole model: itself, or gathered from the ranks onto rank 0's CPU
    /// (every rank must call it; `f` runs on rank 0 only, the others get `None`).
    pub fn with_full<R, E: From<Error>>(
        &self,
        f: impl FnOnce(&CausalLm) -> std::result::Result<R, E>,
    ) -> std::result::Result<Option<R>, E> {
        if self.shard.is_none() {
            return f(self).map(Some);
        }
        // Rank 0 gathers onto the CPU (the checkpoint is written from there); the device
        // holds one whole parameter at a time.
        match self.gather_full_on(Device::Cpu, self.rank() == 0)? {
            Some(full) => f(&full).map(Some),
            None => Ok(None),
        }
    }

    /// Whether this is one rank's slices of the model.
    pub fn is_shard(&self) -> bool {
        self.shard.is_some()
    }

    /// The KV heads this model (or rank) holds.
    pub(crate) fn kv_heads(&self) -> i64 {
        self.shard.as_ref().map_or(self.cfg.num_key_value_heads, |s| s.kv_heads)
    }

    /// The parameters (sharing storage with the model) with their Hugging Face names and
    /// layouts across the ranks (every one [`Layout::Replicated`] on a whole model), sorted
    /// by name; a tied LM head appears once, as the embedding.
    pub fn parameters(&self) -> Vec<(String, Tensor, Layout)> {
        let layout = |name: &str| {
            let layouts = self.shard.as_ref().map(|s| &s.layouts);
            layouts.and_then(|l| l.get(name).copied()).unwrap_or(Layout::Replicated)
        };
        let mut params: Vec<(String, Tensor, Layout)> = self
            .vs
            .variables()
            .into_iter()
            .map(|(name, tensor)| {
                let layout = layout(&name);
                (name, tensor, layout)
            })
            .collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        params
    }

    /// Makes every parameter of the base model collect gradients (or stop collecting them).
    pub fn set_trainable(&self, trainable: bool) -> Result<()> {
        for tensor in self.vs.variables().values() {
            let _ = tensor.f_set_requires_grad(trainable)?;
        }
        Ok(())
    }

    /// The sum over the ranks of `partial` (itself on a whole model), with the identity as
    /// its gradient with respect to `partial` (the value is exactly the all-reduced sum).
    pub(crate) fn sum_over_ranks(&self, partial: Tensor) -> Result<Tensor> {
        let Some(shard) = &self.shard else { return Ok(partial) };
        if !partial.requires_grad() {
            return all_reduce(shard, partial, ReduceOp::Sum);
        }
        let total = all_reduce(shard, partial.f_detach()?.copy(), ReduceOp::Sum)?;
        Ok(total.f_add(&partial.f_sub(&partial.f_detach()?)?)?)
    }

    /// The embedding of `ids`, times the family's embedding multiplier (rounded to the
    /// weights' dtype, as Gemma's scale is); on a rank, the vocab-parallel embedding: its rows
    /// for ids in its range, zeros elsewhere, summed over the ranks.
    pub(crate) fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let embedded = match &self.shard {
            None => Tensor::f_embedding(&self.embed_tokens, ids, -1, false, false)?,
            Some(shard) => {
                let (start, end) = shard.vocab;
                let outside = ids.f_lt(start)?.f_logical_or(&ids.f_ge(end)?)?;
                let local = ids.f_sub_scalar(start)?.f_masked_fill(&outside, 0)?;
                let rows = Tensor::f_embedding(&self.embed_tokens, &local, -1, false, false)?;
                self.sum_over_ranks(rows.f_masked_fill(&outside.f_unsqueeze(-1)?, 0.0)?)?
            }
        };
        let multiplier = self.cfg.block.embedding_multiplier;
        if multiplier == 1.0 {
            return Ok(embedded);
        }
        // Rounded on the host (no copy to the device, so a CUDA graph can capture the pass).
        let rounded = Tensor::from(multiplier).f_to_kind(embedded.kind())?.f_double_value(&[])?;
        Ok(embedded.f_mul_scalar(rounded)?)
    }

    /// The chunk length of the logprob loop: the same on every rank (each must make the same
    /// collective calls), from the largest vocabulary share, not this rank's.
    pub(crate) fn largest_vocab_share(&self) -> i64 {
        let world = self.world_size() as i64;
        (self.cfg.vocab_size + world - 1) / world
    }

    /// A pass with gradients on a rank, cut into residual segments for
    /// [`CausalLm::backward`].
    pub(crate) fn taped_logprobs(&self, pass: &Pass, temperature: f64, routers: &Routers) -> Result<(Tensor, Tape)> {
        let (hidden, tape) = self.taped_hidden_states_with(pass, routers)?;
        Ok((self.pass_logprobs(&hidden, pass, temperature)?, tape))
    }

    /// The final hidden states of a pass with gradients on a rank: what a value head reads.
    pub(crate) fn taped_hidden_states(&self, pass: &Pass) -> Result<(Tensor, Tape)> {
        let (hidden, tape) = self.taped_hidden_states_with(pass, &Routers::own_graph())?;
        Ok((hidden, Tape { replicated_end: true, ..tape }))
    }

    /// The layers and the final norm, cut into segments; the last segment's branch input
    /// (the final hidden states) is where the caller's computation starts.
    fn taped_hidden_states_with(&self, pass: &Pass, routers: &Routers) -> Result<(Tensor, Tape)> {
        let embedded = self.embed(&pass.ids)?;
        let mut segments = Vec::with_capacity(2 * self.layers.len() + 1);
        let mut x = embedded.shallow_clone();
        for (index, layer) in self.layers.iter().enumerate() {
            let at = Positions::of(&pass.rope, index, &pass.masks, layer.window);
            let n = &layer.norms;
            let attention = |a: &Tensor| layer.self_attn.forward(a, &at, None);
            let norms = (n.pre_attention.as_ref(), n.post_attention.as_ref());
            x = self.segment(&x, layer, norms, attention, layer.o_bias.as_ref(), &mut segments)?;
            let mlp = |a: &Tensor| layer.mlp.forward(a, None, Some(routers));
            let norms = (n.pre_mlp.as_ref(), n.post_mlp.as_ref());
            x = self.segment(&x, layer, norms, mlp, layer.down_bias.as_ref(), &mut segments)?;
        }
        let input = leaf(&x)?;
        let normed = self.norm.forward(&input, None)?;
        let branch_input = leaf(&normed)?;
        let hidden = branch_input.shallow_clone();
        segments.push(Segment { input, normed, branch_input, output: None });
        Ok((hidden, Tape { embedded: Some(embedded), segments, ..Tape::default() }))
    }

    /// One residual block cut for training: x + post(all-reduce(branch(pre(x))) + bias) ×
    /// the residual multiplier, with the (pre, post) norms the layer has.
    fn segment(
        &self,
        x: &Tensor,
        layer: &DecoderLayer,
        (pre, post): (Option<&RmsNorm>, Option<&RmsNorm>),
        branch: impl FnOnce(&Tensor) -> Result<Tensor>,
        bias: Option<&Tensor>,
        segments: &mut Vec<Segment>,
    ) -> Result<Tensor> {
        let input = leaf(x)?;
        let normed = maybe_norm(pre, &input, None)?;
        let branch_input = leaf(&normed)?;
        let partial = branch(&branch_input)?;
        let summed = super::add_bias(self.sum_over_ranks(partial)?, bias)?;
        let output = input.f_add(&layer.branch_output(summed, post, None)?)?;
        segments.push(Segment { input, normed, branch_input, output: Some(output.shallow_clone()) });
        Ok(output)
    }

    /// Carries the gradients of a [`CausalLm::train_logprobs`] pass back through a rank's
    /// model, after the loss's own backward reached the logprobs: gradients accumulate into
    /// the parameters as `backward()` does. Every rank must call it; on a whole model
    /// (an empty tape) there is nothing left to do.
    pub fn backward(&self, tape: Tape) -> Result<()> {
        let Some(shard) = &self.shard else { return Ok(()) };
        let mut upstream: Option<Tensor> = None;
        for (index, segment) in tape.segments.into_iter().rev().enumerate() {
            if let (Some(output), Some(grad)) = (&segment.output, &upstream) {
                backward_with(output, grad)?;
            }
            let partial = grad_of(&segment.branch_input)?;
            // A value head's gradient is whole on every rank; a slice's is summed.
            let full = if index == 0 && tape.replicated_end {
                partial
            } else {
                all_reduce(shard, partial.copy(), ReduceOp::Sum)?
            };
            backward_with(&segment.normed, &full)?;
            upstream = Some(grad_of(&segment.input)?);
        }
        if let (Some(grad), Some(embedded)) = (upstream, tape.embedded)
            && embedded.requires_grad()
        {
            backward_with(&embedded, &grad)?;
        }
        Ok(())
    }

    /// Completes the gradients of tensors several ranks apply to their own heads: the q/k
    /// norms (summed over all ranks) and, with fewer KV heads than ranks, the K/V rows each
    /// copy of a KV head holds (summed over the ranks sharing it). Call it once per
    /// optimiser step, after the last backward pass and before clipping (nothing to do on a
    /// whole model).
    pub fn reduce_replicated_gradients(&self) -> Result<()> {
        let Some(shard) = &self.shard else { return Ok(()) };
        let _no_grad = tch::no_grad_guard();
        for (_, tensor, layout) in self.parameters() {
            if layout == Layout::PartialUse {
                let mut grad = tensor.grad();
                if grad.defined() {
                    let sum = all_reduce(shard, grad.copy(), ReduceOp::Sum)?;
                    grad.f_copy_(&sum)?;
                }
                continue;
            }
            let Layout::KvRows { copies, .. } = layout else { continue };
            if copies == 1 {
                continue;
            }
            // Every rank ran the same passes, so either all have this gradient or none.
            let mut grad = tensor.grad();
            if !grad.defined() {
                continue;
            }
            let local = grad.shallow_clone();
            let gathered = gather(shard, &local, 0)?;
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
    pub(crate) fn vocab_parallel_logprobs(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let shard = self.shard.as_ref().ok_or_else(|| Error::InvalidInput("not a tensor-parallel rank".into()))?;
        let (start, end) = shard.vocab;
        // The maximum only keeps exp() in range: log-softmax does not depend on it.
        let local_max = logits.f_detach()?.f_amax(&[-1][..], false)?;
        let max = all_reduce(shard, local_max, ReduceOp::Max)?;
        let shifted = logits.f_sub(&max.f_unsqueeze(-1)?)?;
        let sum_exp = self.sum_over_ranks(shifted.f_exp()?.f_sum_dim_intlist(&[-1][..], false, Kind::Float)?)?;
        let outside = targets.f_lt(start)?.f_logical_or(&targets.f_ge(end)?)?;
        let local = targets.f_sub_scalar(start)?.f_masked_fill(&outside, 0)?;
        let picked = shifted.f_gather(-1, &local.f_unsqueeze(-1)?, false)?.f_squeeze_dim(-1)?;
        let picked = self.sum_over_ranks(picked.f_masked_fill(&outside, 0.0)?)?;
        Ok(picked.f_sub(&sum_exp.f_log()?)?)
    }

    /// Full logits from this rank's vocabulary slice [.., local vocab] (a whole model's
    /// logits as they are): each slice is padded to the largest share so that every rank
    /// sends the same size, then the padding is cut.
    pub(crate) fn gather_vocab(&self, local: Tensor) -> Result<Tensor> {
        let Some(shard) = &self.shard else { return Ok(local) };
        let largest = self.largest_vocab_share();
        let width = shard.vocab.1 - shard.vocab.0;
        let dims = local.dim() as i64;
        let padded = if width < largest { local.f_constant_pad_nd([0, largest - width])? } else { local };
        let gathered = gather(shard, &padded, dims - 1)?;
        let world = self.world_size();
        let parts = (0..world)
            .map(|rank| {
                let (start, end) = share(self.cfg.vocab_size, rank, world);
                gathered.f_narrow(dims - 1, rank as i64 * largest, end - start)
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Tensor::f_cat(&parts, dims - 1)?)
    }

    /// This rank's slices of the weights in `dir` (all of them for a whole model), read and
    /// checked against the model's, without touching the model. Across ranks, stage on every rank and
    /// [`CausalLm::commit_weights`] only once all have staged, so that no rank swaps while
    /// another keeps the old weights.
    pub fn stage_weights(&self, dir: &std::path::Path) -> Result<StagedWeights> {
        if crate::lora::is_adapter_dir(dir) {
            let full = CausalLm::load(dir, self.device(), self.kind)?;
            return self.stage(&self.cfg.clone(), &FromModel(full.var_store().variables()), &dir.display().to_string());
        }
        let cfg = ModelConfig::load(dir)?;
        let files = SliceReader::open(dir)?.with_fused(&cfg.fused_weights());
        self.stage(&cfg, &files, &dir.display().to_string())
    }

    /// [`CausalLm::stage_weights`] from whole tensors in memory, by Hugging Face name (a
    /// weights-only refit): this rank's slices are cut from them.
    pub fn stage_weights_from(&self, weights: std::collections::HashMap<String, Tensor>) -> Result<StagedWeights> {
        let names: std::collections::HashSet<String> = self.parameters().into_iter().map(|(name, ..)| name).collect();
        let unexpected: Vec<_> = weights
            .keys()
            .filter(|name| !names.contains(*name))
            .map(|name| crate::error::WeightProblem::Unexpected { name: name.clone() })
            .collect();
        if !unexpected.is_empty() {
            return Err(Error::Weights(unexpected));
        }
        self.stage(&self.cfg.clone(), &FromModel(weights), "the new weights")
    }

    fn stage(&self, cfg: &ModelConfig, source: &dyn Source, what: &str) -> Result<StagedWeights> {
        let params = self.parameters();
        let mut fresh = Slices::build(cfg, self.rank(), self.world_size(), self.device(), self.kind, source)?;
        fresh.params.sort_by(|a, b| a.name.cmp(&b.name));
        if fresh.params.len() != params.len() {
            return Err(Error::InvalidInput(format!(
                "{what} have {} tensors for this rank, the model {}",
                fresh.params.len(),
                params.len()
            )));
        }
        let problems: Vec<_> = fresh
            .params
            .iter()
            .zip(&params)
            .filter(|(new, (name, tensor, _))| new.name != *name || new.tensor.size() != tensor.size())
            .map(|(new, (name, tensor, _))| crate::error::WeightProblem::Shape {
                name: name.clone(),
                expected: tensor.size(),
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
        for (name, tensor, layout) in self.parameters().into_iter().filter(|(name, ..)| whole.contains_key(name)) {
            let slice = layout.local(&whole[&name])?;
            check_shape(&name, &tensor.size(), &slice.size())?;
            local.insert(name, slice.f_to_kind(self.kind)?.f_to_device(self.device())?.copy());
        }
        Ok(local)
    }

    /// Stages this rank's slices of `base + s·B·A` for the linears `adapters` target (whole
    /// A and B; `base` from [`CausalLm::targeted_weights`]); the other parameters stay as
    /// they are. Commit with [`CausalLm::commit_weights`].
    pub fn stage_adapters(
        &self,
        base: &std::collections::HashMap<String, Tensor>,
        adapters: &std::collections::HashMap<String, Tensor>,
        scale: f64,
    ) -> Result<StagedWeights> {
        let params = self.parameters();
        let layouts: std::collections::HashMap<&str, Layout> =
            params.iter().map(|(name, _, layout)| (name.as_str(), *layout)).collect();
        let cut = |name: &str, delta: Tensor| match layouts.get(name) {
            Some(layout) => layout.local(&delta),
            None => Err(Error::InvalidInput(format!("the model has no `{name}`"))),
        };
        let mut merged = crate::lora::merged_weights(base, adapters, scale, cut)?;
        Ok(StagedWeights(params.iter().map(|(name, ..)| merged.remove(name)).collect()))
    }

    /// Copies weights staged by [`CausalLm::stage_weights`] into the model (only those
    /// staged: an adapter refit stages the linears it targets).
    pub fn commit_weights(&self, staged: StagedWeights) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        for (new, (_, current, _)) in staged.0.iter().zip(self.parameters()) {
            if let Some(new) = new {
                current.shallow_clone().f_copy_(new)?;
            }
        }
        Ok(())
    }

    /// The whole tensor from every rank's `local` part laid out as `layout` (every rank must
    /// call it; every rank gets the same tensor; a whole model's tensor as it is). With
    /// replicated KV rows, the copy of the first rank holding each head is kept.
    pub fn gather_parameter(&self, local: &Tensor, layout: Layout) -> Result<Tensor> {
        let Some(shard) = &self.shard else { return Ok(local.shallow_clone()) };
        match layout {
            Layout::Replicated | Layout::PartialUse => Ok(local.shallow_clone()),
            Layout::Split { dim, .. } => gather(shard, local, dim),
            Layout::KvRows { copies, .. } => {
                let gathered = gather(shard, local, 0)?;
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
        self.gather_full_on(self.device(), true)?
            .ok_or_else(|| Error::InvalidInput("tensor parallel: nothing was gathered".into()))
    }

    /// [`CausalLm::gather_full`] into a model on `device`, kept only where `keep` (rank 0
    /// saving a checkpoint keeps it on the CPU; the other ranks take part in the gathers and
    /// keep nothing). Only one whole parameter at a time is held on this rank's device.
    pub fn gather_full_on(&self, device: Device, keep: bool) -> Result<Option<CausalLm>> {
        if self.shard.is_none() {
            return Err(Error::InvalidInput("a whole model has nothing to gather".into()));
        }
        let params = self.parameters();
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
        for (name, tensor, layout) in &params {
            let value = self.gather_parameter(&tensor.f_detach()?, *layout)?;
            let Some(variables) = variables.as_mut() else { continue };
            let copied = match variables.get_mut(name) {
                Some(target) => target.f_copy_(&value).map_err(Error::from),
                None => Err(Error::InvalidInput(format!("tensor parallel: no parameter `{name}` to gather into"))),
            };
            if let Err(e) = copied {
                problem.get_or_insert(e);
            }
        }
        if let Some(e) = problem {
            return Err(e);
        }
        if let Some(variables) = &variables
            && variables.len() != params.len()
        {
            return Err(Error::InvalidInput(format!(
                "tensor parallel: gathered {} tensors for a model of {}",
                params.len(),
                variables.len()
            )));
        }
        Ok(full)
    }
}

fn all_reduce(shard: &Shard, mut x: Tensor, op: ReduceOp) -> Result<Tensor> {
    shard.comm.all_reduce(&mut x, op).map_err(Error::from)?;
    Ok(x)
}

fn gather(shard: &Shard, tensor: &Tensor, dim: i64) -> Result<Tensor> {
    shard.comm.all_gather(tensor, dim).map_err(Error::from)
}

/// A rank's slices of new weights, read and checked, not yet in the model (`None`: the
/// parameter stays as it is).
#[derive(Debug)]
pub struct StagedWeights(Vec<Option<Tensor>>);

/// One rank's slices of every parameter, and the layers built on them.
struct Slices {
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Tensor,
    /// Every parameter once (a tied LM head is the embedding), sharing storage with the
    /// fields above.
    params: Vec<Param>,
}

impl Slices {
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
            Ok(RmsNorm { weight: keep(name, weight, layout), eps: cfg.rms_norm_eps, applied: cfg.block.norm_weight })
        };
        let norm = |name: String, size: i64| norm_as(name, size, Layout::Replicated);
        // Output rows start..end of `name` ([outputs, inputs]), with its bias when it has one.
        let column = |name: String, outputs: i64, inputs: i64, layout: Layout, bias: bool| -> Result<Linear> {
            let (start, end) = match layout {
                Layout::Split { start, end, .. } | Layout::KvRows { start, end, .. } => (start, end),
                Layout::Replicated | Layout::PartialUse => (0, outputs),
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
                let norms = LayerNorms::build(cfg, |name| norm(p(&format!("{name}.weight")), hidden))?;
                let (o_proj, o_bias) =
                    row(p("self_attn.o_proj"), hidden, heads * d, q_start * d, q_end * d, cfg.o_bias)?;
                // q/k norms over the whole projection (OLMo) couple every head: each rank
                // computes the whole q and k (their weights used in part, like a router's),
                // norms them, then keeps its heads.
                let whole = cfg.qk_norm == QkNorm::Projection;
                // Whole on every rank, applied to its heads (or, over the projection, first).
                let qk_norm = |name: &str, heads: i64| {
                    let weight = p(&format!("self_attn.{name}.weight"));
                    cfg.qk_norm.size(heads, d).map(|size| norm_as(weight, size, Layout::PartialUse)).transpose()
                };
                let (q_rows, k_rows) = if whole { (Layout::PartialUse, Layout::PartialUse) } else { (q_rows, kv_rows) };
                let attention = Attention {
                    q_proj: column(p("self_attn.q_proj"), heads * d, hidden, q_rows, cfg.qkv_bias)?,
                    k_proj: column(p("self_attn.k_proj"), kv_heads * d, hidden, k_rows, cfg.qkv_bias)?,
                    v_proj: column(p("self_attn.v_proj"), kv_heads * d, hidden, kv_rows, cfg.qkv_bias)?,
                    o_proj,
                    q_norm: qk_norm("q_norm", heads)?,
                    k_norm: qk_norm("k_norm", kv_heads)?,
                    heads: heads / w,
                    kv_heads: kv_end - kv_start,
                    head_dim: d,
                    scores: Scores::of(cfg),
                    projection_heads: whole.then_some((q_start, kv_start)),
                };
                let (mlp, down_bias) = match cfg.moe.as_ref().filter(|m| m.sparse_layers[i]) {
                    Some(moe) => {
                        // Each expert's MLP split as a dense one is; the router whole.
                        let (block, [gate, up, down]) = MoeConfig::names(cfg.architecture);
                        let inter = moe.expert_intermediate_size;
                        let (start, end) = share(inter, rank, world);
                        let cols = Layout::Split { dim: 0, start, end };
                        let router_name = p(&format!("{block}.gate.weight"));
                        let router = to(source.whole(&router_name, &[moe.experts, hidden])?)?;
                        let router = keep(router_name, router, Layout::PartialUse);
                        let experts = (0..moe.experts)
                            .map(|e| {
                                let name = |linear: &str| p(&format!("{block}.experts.{e}.{linear}"));
                                Ok(Mlp {
                                    gate_proj: column(name(gate), inter, hidden, cols, false)?,
                                    up_proj: column(name(up), inter, hidden, cols, false)?,
                                    down_proj: row(name(down), hidden, inter, start, end, false)?.0,
                                    activation: cfg.block.activation,
                                })
                            })
                            .collect::<Result<Vec<_>>>()?;
                        (FeedForward::Experts(Experts::with(router, experts, moe)), None)
                    }
                    None => {
                        let i_cols = Layout::Split { dim: 0, start: i_start, end: i_end };
                        let gate_proj = column(p("mlp.gate_proj"), inter, hidden, i_cols, cfg.mlp_bias)?;
                        let up_proj = column(p("mlp.up_proj"), inter, hidden, i_cols, cfg.mlp_bias)?;
                        let (down_proj, down_bias) =
                            row(p("mlp.down_proj"), hidden, inter, i_start, i_end, cfg.mlp_bias)?;
                        let activation = cfg.block.activation;
                        (FeedForward::Dense(Mlp { gate_proj, up_proj, down_proj, activation }), down_bias)
                    }
                };
                Ok(DecoderLayer {
                    norms,
                    self_attn: attention,
                    mlp,
                    o_bias,
                    down_bias,
                    window: cfg.sliding_windows[i],
                    residual_multiplier: cfg.block.residual_multiplier,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Init;
    use crate::cache::{PagedCache, SeqChunk};
    use keel_collective::cpu::CpuGroup;

    /// The communicators of a group of `world` CPU ranks.
    fn group(world: usize) -> Vec<SharedComm> {
        CpuGroup::new(world).expect("a group").into_iter().map(|c| std::sync::Arc::new(c) as SharedComm).collect()
    }
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
        f: impl Fn(CausalLm) -> T + Send + Clone + 'static,
    ) -> Vec<T> {
        let shards: Vec<_> =
            group(world).into_iter().map(|comm| CausalLm::shard(full, comm).expect("a shard")).collect();
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
        // Mixtures of experts: every expert split over the ranks, the router whole; a dense
        // layer between sparse ones.
        for (name, moe) in [("qwen3_moe", qwen3_moe()), ("mixtral", mixtral())] {
            for (world, diff) in compare(moe, &[2, 4]) {
                assert!(diff <= 1e-5, "{name} TP={world}: max diff {diff:e}");
            }
        }
    }

    /// Qwen3-MoE with 6 experts (top 2, weights not renormalised), a dense second layer, the
    /// load-balancing loss trained.
    fn qwen3_moe() -> ModelConfig {
        config(
            "Qwen3MoeForCausalLM",
            8,
            4,
            json!({"head_dim": 16, "num_hidden_layers": 3, "num_experts": 6, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "mlp_only_layers": [1], "output_router_logits": true,
                   "router_aux_loss_coef": 0.05}),
        )
    }

    fn mixtral() -> ModelConfig {
        config(
            "MixtralForCausalLM",
            4,
            2,
            json!({"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": true,
                   "router_aux_loss_coef": 0.05}),
        )
    }

    #[test]
    fn ranks_loading_their_slices_from_a_checkpoint_match_the_model() {
        let dir = tempfile::tempdir().expect("a directory");
        for cfg in [
            config("LlamaForCausalLM", 4, 4, json!({"attention_bias": true, "mlp_bias": true})),
            config("Qwen2ForCausalLM", 4, 2, json!({"tie_word_embeddings": true})),
            qwen3_moe(),
        ] {
            tch::manual_seed(5);
            let full = CausalLm::new(cfg, Device::Cpu, Kind::Float, Init::Random { std: 0.2 }).expect("a model");
            randomize_biases_and_norms(&full);
            full.save(dir.path(), crate::SaveOptions { max_shard_bytes: 60_000 }).expect("saved in several shards");
            let ids = Tensor::from_slice(&[3i64, 17, 99, 42, 7, 64, 100, 0]).view([1, 8]);
            let expected = full.token_logprobs(&ids, &[8], 1.0).expect("logprobs").detach();
            for world in [2, 4] {
                let threads: Vec<_> = group(world)
                    .into_iter()
                    .map(|comm| {
                        let (path, ids) = (dir.path().to_path_buf(), ids.copy());
                        std::thread::spawn(move || {
                            let model = CausalLm::load_shard(&path, comm, Device::Cpu, Kind::Float).expect("loaded");
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
        let comm = group(1).into_iter().next().expect("rank 0");
        let missing = CausalLm::load_shard(&dir.path().join("nope"), comm, Device::Cpu, Kind::Float);
        assert!(missing.expect_err("no directory").to_string().contains("does not exist"));
    }

    #[test]
    fn gathered_shards_are_the_model_again() {
        for cfg in [
            config("Qwen2ForCausalLM", 4, 2, json!({})),
            config("LlamaForCausalLM", 4, 4, json!({"attention_bias": true, "mlp_bias": true})),
            config("Qwen3ForCausalLM", 8, 4, json!({"head_dim": 16, "tie_word_embeddings": true})),
            qwen3_moe(),
            mixtral(),
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

    /// `loss` plus what the pass's routers add to it (MoE models).
    fn with_router_loss(loss: Tensor, tape: &Tape) -> Tensor {
        match tape.router_loss().expect("the router's loss") {
            Some(router) => loss + router,
            None => loss,
        }
    }

    #[test]
    fn gradients_at_tp_2_and_4_equal_tp_1() {
        let cases = [
            config("Qwen3ForCausalLM", 8, 4, json!({"head_dim": 16})),
            // 2 KV heads replicated over 4 ranks; tied embeddings; q/k/v biases.
            config("Qwen2ForCausalLM", 4, 2, json!({"tie_word_embeddings": true})),
            config("LlamaForCausalLM", 4, 4, json!({"attention_bias": true, "mlp_bias": true})),
            // The router's gradient from the experts' outputs and the load-balancing loss.
            qwen3_moe(),
            mixtral(),
            // Gemma 2: sandwich (1 + w) norms, √hidden embeddings, both soft-caps, a window.
            config(
                "Gemma2ForCausalLM",
                4,
                2,
                json!({"head_dim": 16, "sliding_window": 5, "query_pre_attn_scalar": 20,
                "attn_logit_softcapping": 3.0, "final_logit_softcapping": 4.0}),
            ),
            // OLMo 2: post-norms only; q/k norms over the whole projection (whole q and k per rank).
            config("Olmo2ForCausalLM", 4, 2, json!({"attention_bias": true})),
            // Phi-3: partial rotary with LongRoPE; Granite: every multiplier; GLM-4: interleaved rotary.
            config(
                "Phi3ForCausalLM",
                4,
                4,
                json!({"partial_rotary_factor": 0.5, "original_max_position_embeddings": 8,
                "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5],
                "long_factor": [2.0, 3.0, 4.0, 5.0]}}),
            ),
            config(
                "GraniteForCausalLM",
                4,
                2,
                json!({"embedding_multiplier": 6.0, "residual_multiplier": 0.5,
                "attention_multiplier": 0.1, "logits_scaling": 4.0}),
            ),
            config("Glm4ForCausalLM", 4, 2, json!({"head_dim": 16})),
            // Gemma 3: per-head (1 + w) q/k norms, a local rotary base; OLMo 3: windows and
            // whole-projection q/k norms with replicated KV heads; SmolLM3: a NoPE layer.
            config(
                "Gemma3ForCausalLM",
                4,
                2,
                json!({"head_dim": 16, "sliding_window": 5, "rope_local_base_freq": 100.0,
                "layer_types": ["sliding_attention", "full_attention"]}),
            ),
            config(
                "Olmo3ForCausalLM",
                4,
                2,
                json!({"sliding_window": 5,
                "layer_types": ["sliding_attention", "full_attention"]}),
            ),
            config("SmolLM3ForCausalLM", 4, 2, json!({"no_rope_layer_interval": 2})),
        ];
        for cfg in cases {
            tch::manual_seed(21);
            let full = CausalLm::new(cfg, Device::Cpu, Kind::Float, Init::Random { std: 0.2 }).expect("a model");
            randomize_biases_and_norms(&full);
            let rows: Vec<i64> = (0..3 * 11).map(|i| (i * 53 + 7) % 101).collect();
            let lengths = [11, 6, 9];
            let ids = Tensor::from_slice(&rows).view([3, 11]);
            let (expected_lp, tape) = full.train_logprobs(&ids, &lengths, 0.8).expect("TP=1 logprobs");
            with_router_loss(weighted_loss(&expected_lp), &tape).backward();
            let expected: std::collections::HashMap<String, Tensor> =
                full.var_store().variables().into_iter().map(|(name, value)| (name, value.grad().copy())).collect();
            for world in [2, 4] {
                let rows = rows.clone();
                let results = on_shards(&full, world, move |model| {
                    model.set_trainable(true).expect("trainable");
                    let ids = Tensor::from_slice(&rows).view([3, 11]);
                    let (logprobs, tape) = model.train_logprobs(&ids, &lengths, 0.8).expect("TP logprobs");
                    with_router_loss(weighted_loss(&logprobs), &tape).backward();
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

    /// A value head on the final hidden states (a critic, a reward model): the same values and
    /// gradients at TP 2 as whole, the head's own gradient whole on every rank.
    #[test]
    fn value_head_gradients_at_tp_2_equal_tp_1() {
        for cfg in [config("Qwen3ForCausalLM", 8, 4, json!({"head_dim": 16})), mixtral()] {
            tch::manual_seed(17);
            let full = CausalLm::new(cfg, Device::Cpu, Kind::Float, Init::Random { std: 0.2 }).expect("a model");
            randomize_biases_and_norms(&full);
            let head = Tensor::randn([1, 64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
            let rows: Vec<i64> = (0..2 * 9).map(|i| (i * 31 + 2) % 101).collect();
            let lengths = [9, 5];
            let value_loss = |hidden: &Tensor, head: &Tensor| {
                let values = hidden.matmul(&head.transpose(0, 1)).squeeze_dim(2);
                weighted_loss(&(&values * &values))
            };
            let ids = Tensor::from_slice(&rows).view([2, 9]);
            let (hidden, tape) = full.train_hidden_states(&ids, &lengths).expect("TP=1 hidden states");
            value_loss(&hidden, &head).backward();
            full.backward(tape).expect("nothing to do whole");
            // The LM head takes no part: its gradient is none, zeros on the ranks.
            let expected: std::collections::HashMap<String, Tensor> = full
                .var_store()
                .variables()
                .into_iter()
                .map(|(name, value)| {
                    let grad = value.grad();
                    (name, if grad.defined() { grad.copy() } else { value.zeros_like() })
                })
                .collect();
            let expected_head = head.grad().copy();
            let start = Vec::<f32>::try_from(head.detach().flatten(0, -1)).expect("floats");
            let results = on_shards(&full, 2, move |model| {
                model.set_trainable(true).expect("trainable");
                let head = Tensor::from_slice(&start).view([1, 64]).set_requires_grad(true);
                let ids = Tensor::from_slice(&rows).view([2, 9]);
                let (hidden, tape) = model.train_hidden_states(&ids, &lengths).expect("TP hidden states");
                value_loss(&hidden, &head).backward();
                model.backward(tape).expect("TP backward");
                model.reduce_replicated_gradients().expect("replicated gradients");
                let grads: Vec<(String, Tensor)> = model
                    .parameters()
                    .into_iter()
                    .map(|(name, value, layout)| {
                        let grad = value.grad();
                        let grad = if grad.defined() { grad } else { value.zeros_like() };
                        (name, model.gather_parameter(&grad, layout).expect("gathered gradient"))
                    })
                    .collect();
                (head.grad().copy(), grads)
            });
            for (head_grad, grads) in results {
                let scale = expected_head.abs().max().double_value(&[]).max(1.0);
                let diff = (head_grad - &expected_head).abs().max().double_value(&[]);
                assert!(diff <= 1e-5 * scale, "the value head's gradient differs by {diff:e} (largest {scale:e})");
                for (name, grad) in grads {
                    let reference = &expected[&name];
                    let scale = reference.abs().max().double_value(&[]).max(1.0);
                    let diff = (grad - reference).abs().max().double_value(&[]);
                    assert!(diff <= 1e-5 * scale, "gradient of `{name}` differs by {diff:e}");
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
        let comm = group(4).into_iter().next().expect("rank 0");
        let error = CausalLm::shard(&full, comm).expect_err("6 heads over 4 ranks").to_string();
        assert!(error.contains("num_attention_heads"), "{error}");
    }
}
