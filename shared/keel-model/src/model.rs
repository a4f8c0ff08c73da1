//! The decoder-only causal LM shared by every supported architecture (Llama, Qwen2, Qwen3,
//! Mistral, and the mixtures of experts Qwen3-MoE and Mixtral, whose MLPs are [`moe`]; see
//! [`crate::config::Architecture`] for what differs). Parameters live in one
//! `nn::VarStore` under Hugging Face's tensor names, so loading and saving are direct maps
//! and an optimiser can train them.
//!
//! Three forward paths: [`CausalLm::token_logprobs`] for training and scoring (full
//! right-padded sequences, logprobs of the next tokens computed in vocabulary chunks; rows
//! that begin alike, as a GRPO group's samples do, run as one tree per shared beginning),
//! [`CausalLm::forward`] with an optional [`KvCache`] for prefill and incremental decoding,
//! and [`CausalLm::forward_paged`] for the generator: chunks of many sequences packed into
//! one pass over a [`PagedCache`] (see [`paged`]).

use std::sync::Arc;

use tch::{Device, Kind, Tensor, nn};

pub mod decode;
pub mod moe;
pub mod paged;
pub mod prompt;
pub mod tp;

pub use tp::{Layout, StagedWeights, Tape};

use moe::{Experts, Routers};

use crate::attention::{Mask, Masks, attention, masks_for};
use crate::cache::{KvCache, LayerCache, PagedCache, SeqChunk};
use crate::config::{Activation, ModelConfig, NormWeight, QkNorm};
use crate::cuda::{Kernel, Kernels};
use crate::error::{Error, Result};
use crate::packed::PackedRow;
use crate::prefix::PrefixTree;
use crate::rope::{RopeTables, Rotations};

/// How new parameters are filled.
#[derive(Debug, Clone, Copy)]
pub enum Init {
    /// Zeros (weights are about to be loaded over them).
    Zeros,
    /// Transformers' initialisation: normal(0, std) weights, zero biases, unit norms.
    Random { std: f64 },
}

/// Creates parameters in the var store with HF names.
struct Params<'a> {
    kind: Kind,
    device: Device,
    init: Init,
    path: nn::Path<'a>,
}

impl<'a> Params<'a> {
    fn sub(&self, name: impl ToString) -> Params<'a> {
        Params { kind: self.kind, device: self.device, init: self.init, path: &self.path / name }
    }

    fn add(&self, name: &str, tensor: Tensor) -> Result<Tensor> {
        Ok(self.path.add(name, tensor.f_to_kind(self.kind)?, true))
    }

    fn weight(&self, name: &str, dims: &[i64]) -> Result<Tensor> {
        let tensor = match self.init {
            Init::Zeros => Tensor::f_zeros(dims, (Kind::Float, self.device))?,
            Init::Random { std } => Tensor::f_randn(dims, (Kind::Float, self.device))?.f_mul_scalar(std)?,
        };
        self.add(name, tensor)
    }

    fn zeros(&self, name: &str, dims: &[i64]) -> Result<Tensor> {
        self.add(name, Tensor::f_zeros(dims, (Kind::Float, self.device))?)
    }

    fn ones(&self, name: &str, dims: &[i64]) -> Result<Tensor> {
        self.add(name, Tensor::f_ones(dims, (Kind::Float, self.device))?)
    }
}

#[derive(Debug)]
pub(crate) struct Linear {
    pub(crate) weight: Tensor,
    bias: Option<Tensor>,
    /// A LoRA adapter ([`crate::lora`]).
    pub(crate) adapter: Option<crate::lora::Adapter>,
}

impl Linear {
    fn new(p: &Params<'_>, inputs: i64, outputs: i64, bias: bool) -> Result<Self> {
        let weight = p.weight("weight", &[outputs, inputs])?;
        let bias = if bias { Some(p.zeros("bias", &[outputs])?) } else { None };
        Ok(Self { weight, bias, adapter: None })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.f_linear(&self.weight, self.bias.as_ref())?;
        match &self.adapter {
            Some(adapter) => adapter.add_to(y, x),
            None => Ok(y),
        }
    }
}

/// RMSNorm computed in f32 and cast back, as transformers does, its weight applied as the
/// family applies it ([`NormWeight`]).
#[derive(Debug)]
pub(crate) struct RmsNorm {
    pub(crate) weight: Tensor,
    pub(crate) eps: f64,
    pub(crate) applied: NormWeight,
}

impl RmsNorm {
    fn new(p: &Params<'_>, size: i64, cfg: &ModelConfig) -> Result<Self> {
        let applied = cfg.block.norm_weight;
        // An offset norm's weight is 0 for the identity (transformers initialises it so).
        let weight =
            if applied == NormWeight::OffsetInF32 { p.zeros("weight", &[size])? } else { p.ones("weight", &[size])? };
        Ok(Self { weight, eps: cfg.rms_norm_eps, applied })
    }

    fn kernel<'k>(&self, kernels: Option<&'k Kernels>, x: &Tensor) -> Option<&'k Kernels> {
        kernel_for(kernels, Kernel::RmsNorm, x).filter(|_| self.applied == NormWeight::AfterCast)
    }

    pub(crate) fn forward(&self, x: &Tensor, kernels: Option<&Kernels>) -> Result<Tensor> {
        if self.applied != NormWeight::AfterCast {
            return f32_weight_rms_norm(x, &self.weight, self.eps, self.applied == NormWeight::OffsetInF32);
        }
        match self.kernel(kernels, x) {
            Some(k) => Ok(k.rms_norm(x, None, &self.weight, self.eps)?.0),
            None => rms_norm(x, &self.weight, self.eps),
        }
    }

    /// (`x + residual`, its norm), fused into one kernel where one runs.
    fn add_forward(&self, x: &Tensor, residual: &Tensor, kernels: Option<&Kernels>) -> Result<(Tensor, Tensor)> {
        if let Some(k) = self.kernel(kernels, x)
            && let (normed, Some(sum)) = k.rms_norm(x, Some(residual), &self.weight, self.eps)?
        {
            return Ok((sum, normed));
        }
        let sum = x.f_add(residual)?;
        let normed = self.forward(&sum, None)?;
        Ok((sum, normed))
    }
}

/// The kernels, when `kernel` runs for `x` (its device and dtype, and no gradient needed).
fn kernel_for<'k>(kernels: Option<&'k Kernels>, kernel: Kernel, x: &Tensor) -> Option<&'k Kernels> {
    kernels.filter(|k| !x.requires_grad() && k.runs(kernel, x.device(), x.kind()))
}

/// `weight · x / sqrt(mean(x²) + eps)` over the last dimension, the norm in f32.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(weight.f_mul(&normalized(x, eps)?.f_to_kind(x.kind())?)?)
}

/// `x / sqrt(mean(x²) + eps)` over the last dimension, in f32.
fn normalized(x: &Tensor, eps: f64) -> Result<Tensor> {
    let x32 = x.f_to_kind(Kind::Float)?;
    let variance = x32.f_square()?.f_mean_dim(-1, true, Kind::Float)?;
    Ok(x32.f_mul(&variance.f_add_scalar(eps)?.f_rsqrt()?)?)
}

/// `x · weight / sqrt(mean(x²) + eps)` with the weight applied in f32 (`1 + weight` with
/// `offset`), cast back: OLMo's and Gemma's RMSNorms.
fn f32_weight_rms_norm(x: &Tensor, weight: &Tensor, eps: f64, offset: bool) -> Result<Tensor> {
    let normed = normalized(x, eps)?;
    let weight = weight.f_to_kind(Kind::Float)?;
    let weight = if offset { weight.f_add_scalar(1.0)? } else { weight };
    Ok(normed.f_mul(&weight)?.f_to_kind(x.kind())?)
}

/// `silu(gate) · up`: the gated activation of the MLP.
pub(crate) fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok(gate.f_silu()?.f_mul(up)?)
}

/// `activation(gate) · up`.
fn gated(activation: Activation, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok(match activation {
        Activation::Silu => return silu_mul(gate, up),
        Activation::GeluTanh => gate.f_gelu("tanh")?.f_mul(up)?,
        Activation::Gelu => gate.f_gelu("none")?.f_mul(up)?,
    })
}

/// Rotary tables and the masks (one per distinct window among `windows`) for `ids` [B, S]
/// whose row b starts at position `offsets[b]` and attends to `visible` keys.
fn positions_for(
    rotations: &Rotations,
    kind: Kind,
    windows: &[Option<i64>],
    ids: &Tensor,
    offsets: &[i64],
    visible: i64,
    device: Device,
) -> Result<(RopeTables, Masks)> {
    let (b, s) = (ids.size()[0], ids.size()[1]);
    let starts = Tensor::from_slice(offsets).f_to_device(device)?.f_unsqueeze(1)?;
    let positions =
        starts.f_add(&Tensor::f_arange(s, (Kind::Int64, device))?.f_unsqueeze(0)?)?.f_expand([b, s], false)?;
    Ok((rotations.tables(&positions, kind)?, masks_for(windows, s, offsets, visible, device)?))
}

/// What a layer of one forward pass reads besides its input: the rotary tables for the
/// positions of the input and the attention mask of the layer's window.
struct Positions<'a> {
    rope: &'a RopeTables,
    layer: usize,
    mask: &'a Mask,
    window: Option<i64>,
    /// CUDA kernels the layers may use instead of tch ops (inference on a GPU).
    kernels: Option<&'a Kernels>,
    /// Where MoE layers leave their router logits (training passes).
    routers: Option<&'a Routers>,
}

impl<'a> Positions<'a> {
    /// The positions of layer `layer`, whose attention window is `window`.
    fn of(rope: &'a RopeTables, layer: usize, masks: &'a Masks, window: Option<i64>) -> Self {
        let (_, mask) = masks.iter().find(|(w, _)| *w == window).expect("a mask was built for every window");
        Self { rope, layer, mask, window, kernels: None, routers: None }
    }

    fn with_kernels(self, kernels: Option<&'a Kernels>) -> Self {
        Self { kernels, ..self }
    }

    fn with_routers(self, routers: Option<&'a Routers>) -> Self {
        Self { routers, ..self }
    }

    /// Rotary embedding of `x` [B, H, S, D] at these positions (none in a NoPE layer).
    fn rotate(&self, x: &Tensor) -> Result<Tensor> {
        let Some(table) = self.rope.layer(self.layer) else { return Ok(x.shallow_clone()) };
        match kernel_for(self.kernels, Kernel::Rotary, x).filter(|_| table.style.is_plain()) {
            Some(k) => Ok(k.rotary(x, &table.cos, &table.sin)?),
            None => table.style.apply(x, &table.cos, &table.sin),
        }
    }
}

#[derive(Debug)]
pub(crate) struct Attention {
    pub(crate) q_proj: Linear,
    pub(crate) k_proj: Linear,
    pub(crate) v_proj: Linear,
    pub(crate) o_proj: Linear,
    pub(crate) q_norm: Option<RmsNorm>,
    pub(crate) k_norm: Option<RmsNorm>,
    pub(crate) heads: i64,
    pub(crate) kv_heads: i64,
    pub(crate) head_dim: i64,
    pub(crate) scores: Scores,
    /// On a tensor-parallel rank of a family whose q/k norms span the whole projection
    /// (OLMo): the rank computes and norms the whole q and k, then keeps its heads, from these
    /// first query and KV heads (`None`: the projections hold just this model's heads).
    pub(crate) projection_heads: Option<(i64, i64)>,
}

/// How a layer's attention logits differ from `q·k / √D`, and where its q/k norms apply.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scores {
    /// The queries are multiplied by this before attention, which scales the logits by
    /// `multiplier / √D` (1: the usual scale).
    query_multiplier: f64,
    /// `cap · tanh(logit / cap)` before the mask (Gemma 2).
    softcap: Option<f64>,
    /// The q/k norms span the whole projection (OLMo), not each head.
    norm_projection: bool,
}

impl Scores {
    pub(crate) fn of(cfg: &ModelConfig) -> Self {
        let query_multiplier = cfg.block.attention_scale.map_or(1.0, |scale| scale * (cfg.head_dim as f64).sqrt());
        Self {
            query_multiplier,
            softcap: cfg.block.attention_softcap,
            norm_projection: cfg.qk_norm == QkNorm::Projection,
        }
    }
}

impl Attention {
    fn new(p: &Params<'_>, cfg: &ModelConfig) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (heads, kv_heads) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let norm = |name: &str, heads: i64| -> Result<Option<RmsNorm>> {
            cfg.qk_norm.size(heads, d).map(|size| RmsNorm::new(&p.sub(name), size, cfg)).transpose()
        };
        Ok(Self {
            q_proj: Linear::new(&p.sub("q_proj"), h, heads * d, cfg.qkv_bias)?,
            k_proj: Linear::new(&p.sub("k_proj"), h, kv_heads * d, cfg.qkv_bias)?,
            v_proj: Linear::new(&p.sub("v_proj"), h, kv_heads * d, cfg.qkv_bias)?,
            o_proj: Linear::new(&p.sub("o_proj"), heads * d, h, cfg.o_bias)?,
            q_norm: norm("q_norm", heads)?,
            k_norm: norm("k_norm", kv_heads)?,
            heads,
            kv_heads,
            head_dim: d,
            scores: Scores::of(cfg),
            projection_heads: None,
        })
    }

    /// [B, S, heads·D] → [B, heads, S, D], with the q or k norm where the model has one;
    /// `first` is where this rank's heads start in a whole normed projection.
    fn split_heads(
        &self,
        x: &Tensor,
        (heads, first): (i64, Option<i64>),
        norm: Option<&RmsNorm>,
        kernels: Option<&Kernels>,
    ) -> Result<Tensor> {
        let (b, s) = (x.size()[0], x.size()[1]);
        let x = match norm {
            Some(norm) if self.scores.norm_projection => {
                let normed = norm.forward(x, kernels)?;
                let normed = match first {
                    Some(first) => normed.f_narrow(-1, first * self.head_dim, heads * self.head_dim)?,
                    None => normed,
                };
                normed.f_reshape([b, s, heads, self.head_dim])?
            }
            Some(norm) => norm.forward(&x.f_view([b, s, heads, self.head_dim])?, kernels)?,
            None => x.f_view([b, s, heads, self.head_dim])?,
        };
        Ok(x.f_transpose(1, 2)?)
    }

    fn forward(
        &self,
        x: &Tensor,
        at: &Positions<'_>,
        cache: Option<(&mut (dyn LayerCache + '_), usize)>,
    ) -> Result<Tensor> {
        let (b, s) = (x.size()[0], x.size()[1]);
        let (q_first, kv_first) = self.projection_heads.unzip();
        let q = self.split_heads(&self.q_proj.forward(x)?, (self.heads, q_first), self.q_norm.as_ref(), at.kernels)?;
        let k =
            self.split_heads(&self.k_proj.forward(x)?, (self.kv_heads, kv_first), self.k_norm.as_ref(), at.kernels)?;
        let v = self.split_heads(&self.v_proj.forward(x)?, (self.kv_heads, None), None, at.kernels)?;
        let q = at.rotate(&q)?;
        let q = if self.scores.query_multiplier == 1.0 { q } else { q.f_mul_scalar(self.scores.query_multiplier)? };
        let k = at.rotate(&k)?;
        let softcap = self.scores.softcap;
        let out = match cache {
            Some((cache, layer)) => cache.attend(layer, &q, &k, &v, at.mask, at.window, softcap)?,
            None => attention(&q, &k, &v, at.mask, softcap)?,
        };
        self.o_proj.forward(&out.f_transpose(1, 2)?.f_reshape([b, s, self.heads * self.head_dim])?)
    }
}

#[derive(Debug)]
pub(crate) struct Mlp {
    pub(crate) gate_proj: Linear,
    pub(crate) up_proj: Linear,
    pub(crate) down_proj: Linear,
    pub(crate) activation: Activation,
}

impl Mlp {
    /// A gated MLP of `intermediate` units whose gate, up and down linears are `names`.
    fn new(p: &Params<'_>, cfg: &ModelConfig, intermediate: i64, bias: bool, names: [&str; 3]) -> Result<Self> {
        let [gate, up, down] = names;
        let hidden = cfg.hidden_size;
        Ok(Self {
            gate_proj: Linear::new(&p.sub(gate), hidden, intermediate, bias)?,
            up_proj: Linear::new(&p.sub(up), hidden, intermediate, bias)?,
            down_proj: Linear::new(&p.sub(down), intermediate, hidden, bias)?,
            activation: cfg.block.activation,
        })
    }

    fn forward(&self, x: &Tensor, kernels: Option<&Kernels>) -> Result<Tensor> {
        let (gate, up) = (self.gate_proj.forward(x)?, self.up_proj.forward(x)?);
        let kernel = kernel_for(kernels, Kernel::SiluMul, &gate).filter(|_| self.activation == Activation::Silu);
        let activated = match kernel {
            Some(k) => k.silu_mul(&gate, &up)?,
            None => gated(self.activation, &gate, &up)?,
        };
        self.down_proj.forward(&activated)
    }
}

/// A layer's feed-forward block: a dense MLP or a mixture of experts.
#[derive(Debug)]
pub(crate) enum FeedForward {
    Dense(Mlp),
    Experts(Experts),
}

impl FeedForward {
    fn new(p: &Params<'_>, cfg: &ModelConfig, layer: usize) -> Result<Self> {
        match &cfg.moe {
            Some(moe) if moe.sparse_layers[layer] => {
                let (block, _) = crate::config::MoeConfig::names(cfg.architecture);
                Ok(Self::Experts(Experts::new(&p.sub(block), cfg, moe)?))
            }
            _ => Ok(Self::Dense(Mlp::new(
                &p.sub("mlp"),
                cfg,
                cfg.intermediate_size,
                cfg.mlp_bias,
                ["gate_proj", "up_proj", "down_proj"],
            )?)),
        }
    }

    fn forward(&self, x: &Tensor, kernels: Option<&Kernels>, routers: Option<&Routers>) -> Result<Tensor> {
        match self {
            Self::Dense(mlp) => mlp.forward(x, kernels),
            Self::Experts(experts) => experts.forward(x, kernels, routers),
        }
    }
}

/// The norms of a decoder layer, where its family has them ([`crate::config::Norms`]).
#[derive(Debug)]
pub(crate) struct LayerNorms {
    pub(crate) pre_attention: Option<RmsNorm>,
    pub(crate) post_attention: Option<RmsNorm>,
    pub(crate) pre_mlp: Option<RmsNorm>,
    pub(crate) post_mlp: Option<RmsNorm>,
}

impl LayerNorms {
    /// The layer's norms, each made by `norm` from its Hugging Face name.
    pub(crate) fn build(cfg: &ModelConfig, mut norm: impl FnMut(&str) -> Result<RmsNorm>) -> Result<Self> {
        let names = cfg.block.norms;
        let mut make = |name: Option<&str>| name.map(&mut norm).transpose();
        Ok(Self {
            pre_attention: make(names.pre_attention)?,
            post_attention: make(names.post_attention)?,
            pre_mlp: make(names.pre_mlp)?,
            post_mlp: make(names.post_mlp)?,
        })
    }
}

/// `norm(x)`, or `x` where the layer has no such norm.
pub(crate) fn maybe_norm(norm: Option<&RmsNorm>, x: &Tensor, kernels: Option<&Kernels>) -> Result<Tensor> {
    match norm {
        Some(norm) => norm.forward(x, kernels),
        None => Ok(x.shallow_clone()),
    }
}

#[derive(Debug)]
pub(crate) struct DecoderLayer {
    pub(crate) norms: LayerNorms,
    pub(crate) self_attn: Attention,
    pub(crate) mlp: FeedForward,
    /// The biases of o and down on a tensor-parallel rank, added once after the sum over the
    /// ranks (a whole model keeps them in its linears).
    pub(crate) o_bias: Option<Tensor>,
    pub(crate) down_bias: Option<Tensor>,
    pub(crate) window: Option<i64>,
    /// Each branch's output is multiplied by this as it joins the residual stream.
    pub(crate) residual_multiplier: f64,
}

impl DecoderLayer {
    fn new(p: &Params<'_>, cfg: &ModelConfig, index: usize) -> Result<Self> {
        Ok(Self {
            norms: LayerNorms::build(cfg, |name| RmsNorm::new(&p.sub(name), cfg.hidden_size, cfg))?,
            self_attn: Attention::new(&p.sub("self_attn"), cfg)?,
            mlp: FeedForward::new(p, cfg, index)?,
            o_bias: None,
            down_bias: None,
            window: cfg.sliding_windows[index],
            residual_multiplier: cfg.block.residual_multiplier,
        })
    }

    /// A branch's summed output as it joins the residual stream: its post-norm (where the
    /// family has one), then the residual multiplier.
    pub(crate) fn branch_output(
        &self,
        out: Tensor,
        post: Option<&RmsNorm>,
        kernels: Option<&Kernels>,
    ) -> Result<Tensor> {
        let out = maybe_norm(post, &out, kernels)?;
        Ok(if self.residual_multiplier == 1.0 { out } else { out.f_mul_scalar(self.residual_multiplier)? })
    }

    /// The layer over `x`; `sum` completes a branch's output from this rank's part (the sum
    /// over the ranks; the identity for a whole model).
    fn forward(
        &self,
        x: &Tensor,
        at: &Positions<'_>,
        cache: Option<(&mut (dyn LayerCache + '_), usize)>,
        sum: &dyn Fn(Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let n = &self.norms;
        let attn = self.self_attn.forward(&maybe_norm(n.pre_attention.as_ref(), x, at.kernels)?, at, cache)?;
        let attn = add_bias(sum(attn)?, self.o_bias.as_ref())?;
        let attn = self.branch_output(attn, n.post_attention.as_ref(), at.kernels)?;
        // Llama's layout fuses the residual sum with the MLP's norm.
        let (h, normed) = match &n.pre_mlp {
            Some(norm) => norm.add_forward(x, &attn, at.kernels)?,
            None => {
                let h = x.f_add(&attn)?;
                let normed = h.shallow_clone();
                (h, normed)
            }
        };
        let mlp = add_bias(sum(self.mlp.forward(&normed, at.kernels, at.routers)?)?, self.down_bias.as_ref())?;
        let mlp = self.branch_output(mlp, n.post_mlp.as_ref(), at.kernels)?;
        Ok(h.f_add(&mlp)?)
    }
}

fn add_bias(x: Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    Ok(match bias {
        Some(bias) => x.f_add(bias)?,
        None => x,
    })
}

/// A decoder-only causal language model: the whole model, or one tensor-parallel rank's
/// slices of it ([`tp`]) — the same layers, forward passes and logprobs at every world size.
#[derive(Debug)]
pub struct CausalLm {
    cfg: ModelConfig,
    vs: nn::VarStore,
    embed_tokens: Tensor,
    pub(crate) layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Tensor,
    rotary: Rotations,
    kind: Kind,
    /// CUDA kernels for inference passes ([`Self::use_kernels`]).
    kernels: Option<Arc<Kernels>>,
    /// LoRA adapters, in a var store of their own ([`crate::lora`]).
    pub(crate) adapters: Option<crate::lora::Adapters>,
    /// This rank's place in a tensor-parallel group (`None`: the whole model).
    shard: Option<tp::Shard>,
    /// Rows that share a prefix run as trees ([`PrefixTree`]); on unless turned off.
    share_prefixes: bool,
}

/// Largest number of logits (batch × positions × vocabulary) materialised at once when
/// computing token logprobs.
const LOGPROB_CHUNK_ELEMENTS: i64 = 1 << 25;

impl CausalLm {
    /// Builds the model with parameters in `kind` on `device`.
    pub fn new(cfg: ModelConfig, device: Device, kind: Kind, init: Init) -> Result<Self> {
        if !matches!(kind, Kind::Float | Kind::BFloat16 | Kind::Half) {
            return Err(Error::InvalidInput(format!("parameter dtype {kind:?} is not supported (f32, bf16, f16)")));
        }
        let vs = nn::VarStore::new(device);
        let root = Params { kind, device, init, path: vs.root() };
        let model = root.sub("model");
        let embed_tokens = model.sub("embed_tokens").weight("weight", &[cfg.vocab_size, cfg.hidden_size])?;
        let layers_path = model.sub("layers");
        let layers = (0..cfg.num_hidden_layers as usize)
            .map(|i| DecoderLayer::new(&layers_path.sub(i), &cfg, i))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(&model.sub("norm"), cfg.hidden_size, &cfg)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens.shallow_clone()
        } else {
            root.sub("lm_head").weight("weight", &[cfg.vocab_size, cfg.hidden_size])?
        };
        let rotary = Rotations::new(&cfg, device)?;
        Ok(Self {
            cfg,
            vs,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rotary,
            kind,
            kernels: None,
            adapters: None,
            shard: None,
            share_prefixes: true,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Runs inference passes (no gradients) with `kernels` where they run for the model's
    /// device and dtype; the tch path everywhere else.
    pub fn use_kernels(&mut self, kernels: Arc<Kernels>) {
        self.kernels = Some(kernels);
    }

    pub fn var_store(&self) -> &nn::VarStore {
        &self.vs
    }

    /// The parameters, to load or copy weights into in place.
    pub fn var_store_mut(&mut self) -> &mut nn::VarStore {
        &mut self.vs
    }

    pub fn device(&self) -> Device {
        self.vs.device()
    }

    /// Moves the parameters to `device` in place (host memory while a colocated trainer
    /// trains; back with `self.device()`); see [`crate::device::move_in_place`].
    pub fn move_weights(&self, device: Device) -> Result<u64> {
        let variables = self.vs.variables();
        crate::device::move_in_place(variables.values(), device)
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Casts the parameters (and adapters) to `kind` (f32, bf16 or f16) in place.
    pub fn set_kind(&mut self, kind: Kind) -> Result<()> {
        let stores = std::iter::once(&mut self.vs).chain(self.adapters.as_mut().map(|a| &mut a.vs));
        for vs in stores {
            match kind {
                Kind::Float => vs.float(),
                Kind::BFloat16 => vs.bfloat16(),
                Kind::Half => vs.half(),
                other => {
                    return Err(Error::InvalidInput(format!(
                        "parameter dtype {other:?} is not supported (f32, bf16, f16)"
                    )));
                }
            }
        }
        self.kind = kind;
        Ok(())
    }

    /// Moves the parameters (and the rotary tables) to `device`, e.g. to keep a frozen
    /// reference model on the CPU between uses.
    pub fn set_device(&mut self, device: Device) -> Result<()> {
        if device != self.device() {
            if self.shard.is_some() {
                return Err(Error::InvalidInput("a tensor-parallel rank cannot change device".into()));
            }
            self.vs.set_device(device);
            if let Some(adapters) = &mut self.adapters {
                adapters.vs.set_device(device);
            }
            self.rotary = Rotations::new(&self.cfg, device)?;
        }
        Ok(())
    }

    /// Stops gradients to every parameter of the base model (a frozen reference, or the
    /// base under LoRA adapters, which keep theirs).
    pub fn freeze(&mut self) -> Result<()> {
        self.vs.freeze();
        self.set_trainable(false)
    }

    /// A pool of `blocks` blocks of this model's (or rank's) KV heads (see [`PagedCache`]).
    pub fn paged_cache(&self, blocks: usize) -> Result<PagedCache> {
        PagedCache::with_kv_heads(&self.cfg, self.kv_heads(), blocks, self.kind, self.device())
    }

    fn check_input(&self, input_ids: &Tensor, lengths: Option<&[i64]>) -> Result<(i64, i64)> {
        check_ids(self.cfg.vocab_size, input_ids, lengths)
    }

    /// Final hidden states [B, S, hidden] after the last norm. With a cache, the tokens are
    /// placed after those already cached and the cache grows by S.
    fn hidden_states(&self, input_ids: &Tensor, mut cache: Option<&mut KvCache>) -> Result<Tensor> {
        let (b, s) = (input_ids.size()[0], input_ids.size()[1]);
        let past = cache.as_ref().map_or(0, |c| c.len());
        if cache.is_some() && self.shard.is_some() {
            return Err(Error::InvalidInput(
                "a KV cache holds every KV head: a tensor-parallel rank decodes with a paged cache".into(),
            ));
        }
        if let Some(cache) = &cache {
            cache.check(self.layers.len(), b, self.kind, self.device(), s)?;
        }
        let hidden = self.run_layers(
            input_ids,
            &vec![past; b as usize],
            past + s,
            cache.as_deref_mut().map(|c| c as &mut dyn LayerCache),
        )?;
        if let Some(cache) = cache {
            cache.advance(s);
        }
        Ok(hidden)
    }

    /// The decoder stack over `input_ids` [B, S] whose row b starts at position `offsets[b]`,
    /// attending to `visible` keys (cached plus new).
    fn run_layers(
        &self,
        input_ids: &Tensor,
        offsets: &[i64],
        visible: i64,
        cache: Option<&mut dyn LayerCache>,
    ) -> Result<Tensor> {
        let device = self.device();
        let (rope, masks) =
            positions_for(&self.rotary, self.kind, &self.windows(), input_ids, offsets, visible, device)?;
        self.run_layers_at(input_ids, &rope, &masks, cache, None)
    }

    fn windows(&self) -> Vec<Option<i64>> {
        self.layers.iter().map(|l| l.window).collect()
    }

    /// The decoder stack over `input_ids` with the rotary tables and masks of its positions.
    fn run_layers_at(
        &self,
        input_ids: &Tensor,
        rope: &RopeTables,
        masks: &Masks,
        mut cache: Option<&mut dyn LayerCache>,
        routers: Option<&Routers>,
    ) -> Result<Tensor> {
        let mut x = self.embed(&input_ids.f_to_device(self.device())?)?;
        let sum = |partial: Tensor| self.sum_over_ranks(partial);
        for (index, layer) in self.layers.iter().enumerate() {
            let at = Positions::of(rope, index, masks, layer.window)
                .with_kernels(self.kernels.as_deref())
                .with_routers(routers);
            x = layer.forward(&x, &at, cache.as_deref_mut().map(|c| (c, index)), &sum)?;
        }
        self.norm.forward(&x, self.kernels.as_deref())
    }

    /// Logits [R, vocab] (inference, no gradients) for the last token of each of `chunks`
    /// that asks for them, in order: every chunk's tokens continue its sequence in `cache`
    /// (see [`paged`]), all packed into one pass.
    pub fn forward_paged(&self, chunks: &[SeqChunk], cache: &mut PagedCache) -> Result<Tensor> {
        cache.check(self.layers.len(), self.kv_heads(), self.kind, self.device())?;
        let windows = self.windows();
        let vocab = self.cfg.vocab_size;
        let last = paged::last_hidden(
            chunks,
            cache,
            vocab,
            &windows,
            &self.rotary,
            self.kind,
            self.paged_kernels(),
            |ids, rope, masks, step| self.run_layers_at(ids, rope, masks, Some(step), None),
        )?;
        self.lm_logits(&last)
    }

    /// Logits [rows, vocab] of a fixed-shape decode step over `batch` (see [`decode`]):
    /// what a CUDA graph captures, and what [`Self::forward_paged`] gives for the same rows.
    pub fn forward_decode(&self, batch: &decode::DecodeBatch, cache: &mut PagedCache) -> Result<Tensor> {
        self.lm_logits(&self.decode_hidden_states(batch, cache)?)
    }

    /// Final hidden states [rows, hidden] of a fixed-shape decode step: [`Self::forward_decode`]
    /// without the LM head (a CUDA graph captures this; the head runs on the real rows only).
    pub fn decode_hidden_states(&self, batch: &decode::DecodeBatch, cache: &mut PagedCache) -> Result<Tensor> {
        cache.check(self.layers.len(), self.kv_heads(), self.kind, self.device())?;
        let windows = self.windows();
        decode::decode_hidden(
            batch,
            cache,
            &windows,
            &self.rotary,
            self.kind,
            self.paged_kernels(),
            |ids, rope, masks, step| self.run_layers_at(ids, rope, masks, Some(step), None),
        )
    }

    fn head(&self) -> Head<'_> {
        let block = &self.cfg.block;
        Head { weight: &self.lm_head, divisor: block.logits_divisor, softcap: block.final_softcap }
    }

    /// The CUDA kernels this model's family needs something else than, each with why: the
    /// model runs those steps on the tch path whatever kernels it is given.
    pub fn kernels_not_used(&self) -> Vec<(Kernel, &'static str)> {
        let block = &self.cfg.block;
        let plain_rope = self.rotary.is_plain();
        [
            (block.norm_weight != NormWeight::AfterCast, Kernel::RmsNorm, "its RMSNorms apply their weight in f32"),
            (!plain_rope, Kernel::Rotary, "its rotary embedding is partial or interleaved"),
            (block.activation != Activation::Silu, Kernel::SiluMul, "its MLP's activation is not SiLU"),
            (block.attention_softcap.is_some(), Kernel::PagedDecode, "its attention logits are soft-capped"),
        ]
        .into_iter()
        .filter_map(|(gap, kernel, why)| gap.then_some((kernel, why)))
        .collect()
    }

    /// The kernels the paged passes may attend with: none when the family's attention logits
    /// are soft-capped (the decode-attention kernel computes plain softmax attention).
    fn paged_kernels(&self) -> Option<&Kernels> {
        self.kernels.as_deref().filter(|_| self.cfg.block.attention_softcap.is_none())
    }

    /// Logits [.., vocab] of final hidden states [.., hidden] (a tensor-parallel rank's
    /// vocabulary slices gathered, so every rank has them all).
    pub fn lm_logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let _no_grad = tch::no_grad_guard();
        self.gather_vocab(self.head().logits(hidden)?)
    }

    /// Logits [B, S, vocab] in the parameters' dtype. With a cache (inference only: runs
    /// without gradients), `input_ids` continue the cached tokens: the whole prompt for
    /// prefill, one token per row for decoding.
    pub fn forward(&self, input_ids: &Tensor, cache: Option<&mut KvCache>) -> Result<Tensor> {
        self.check_input(input_ids, None)?;
        let _no_grad = (cache.is_some() || self.shard.is_some()).then(tch::no_grad_guard);
        let hidden = self.hidden_states(input_ids, cache)?;
        self.gather_vocab(self.head().logits(&hidden)?)
    }

    fn padded_input(&self, input_ids: &Tensor, lengths: &[i64]) -> Result<(Tensor, Tensor)> {
        padded_ids(self.cfg.vocab_size, self.device(), input_ids, lengths)
    }

    /// Final hidden states [B, S, hidden] (after the last norm) of right-padded sequences;
    /// positions at or past a row's length hold padding. Value heads read these.
    pub fn last_hidden_states(&self, input_ids: &Tensor, lengths: &[i64]) -> Result<Tensor> {
        let (ids, _) = self.padded_input(input_ids, lengths)?;
        let _no_grad = self.shard.is_some().then(tch::no_grad_guard);
        self.hidden_states(&ids, None)
    }

    /// [`Self::last_hidden_states`] with gradients, for a value head trained on them: the
    /// caller computes its loss from them (the same on every rank of a tensor-parallel group),
    /// runs the loss's backward, then hands what comes back to [`Self::backward`].
    pub fn train_hidden_states(&self, input_ids: &Tensor, lengths: &[i64]) -> Result<(Tensor, Tape)> {
        let pass = self.padded_pass(self.padded_input(input_ids, lengths)?)?;
        if self.shard.is_some() {
            return self.taped_hidden_states(&pass);
        }
        let hidden = self.run_layers_at(&pass.ids, &pass.rope, &pass.masks, None, None)?;
        Ok((hidden, Tape::default()))
    }

    /// Token logprobs [B, S] (f32) of right-padded sequences: entry (b, i) is
    /// log p(token_i | tokens before i) with logits divided by `temperature`; entry 0 and
    /// every position at or past the row's length are 0. The log-softmax is computed over
    /// chunks of positions, so the full [B × S × vocab] tensor is never held. Gradients flow
    /// as the caller's mode records them on a whole model; a tensor-parallel rank computes
    /// none here (see [`Self::train_logprobs`]).
    pub fn token_logprobs(&self, input_ids: &Tensor, lengths: &[i64], temperature: f64) -> Result<Tensor> {
        check_temperature(temperature)?;
        let _no_grad = self.shard.is_some().then(tch::no_grad_guard);
        let padded = self.padded_input(input_ids, lengths)?;
        if let Some(tree) = self.prefix_tree(&padded.0, lengths)? {
            return self.tree_logprobs(&tree, temperature);
        }
        let pass = self.padded_pass(padded)?;
        let hidden = self.run_layers_at(&pass.ids, &pass.rope, &pass.masks, None, None)?;
        self.pass_logprobs(&hidden, &pass, temperature)
    }

    /// [`Self::token_logprobs`] of the sequences packed in `row`, each attending to itself
    /// only with its own positions, given back right-padded [n, S] as the unpacked pass
    /// gives them.
    pub fn packed_token_logprobs(&self, row: &PackedRow, temperature: f64) -> Result<Tensor> {
        check_temperature(temperature)?;
        let _no_grad = self.shard.is_some().then(tch::no_grad_guard);
        let pass = self.packed_pass(row)?;
        let hidden = self.run_layers_at(&pass.ids, &pass.rope, &pass.masks, None, None)?;
        row.unpack(&self.pass_logprobs(&hidden, &pass, temperature)?)
    }

    /// Token logprobs as [`Self::token_logprobs`] computes them, with gradients: the caller
    /// computes its loss from them, runs the loss's backward, then hands what comes back
    /// with them to [`Self::backward`], which carries the gradients through a
    /// tensor-parallel rank's model (a whole model's graph needs nothing more).
    pub fn train_logprobs(&self, input_ids: &Tensor, lengths: &[i64], temperature: f64) -> Result<(Tensor, Tape)> {
        check_temperature(temperature)?;
        let padded = self.padded_input(input_ids, lengths)?;
        if let Some(tree) = self.prefix_tree(&padded.0, lengths)? {
            return Ok((self.tree_logprobs(&tree, temperature)?, Tape::default()));
        }
        let pass = self.padded_pass(padded)?;
        self.logprobs_with_tape(&pass, temperature)
    }

    /// Whether [`Self::token_logprobs`] and [`Self::train_logprobs`] run rows that begin with
    /// the same tokens as one tree per shared beginning ([`crate::prefix`]; on by default).
    /// Either way the logprobs and gradients are the same up to float rounding.
    pub fn set_prefix_sharing(&mut self, on: bool) {
        self.share_prefixes = on;
    }

    /// How many tree rows the logprob passes over right-padded `input_ids` with `lengths` run
    /// (`None`: they run the padded rows, as when nothing worth sharing is found, on a
    /// tensor-parallel rank and for mixtures of experts).
    pub fn prefix_tree_rows(&self, input_ids: &Tensor, lengths: &[i64]) -> Result<Option<i64>> {
        let (ids, _) = self.padded_input(input_ids, lengths)?;
        Ok(self.prefix_tree(&ids, lengths)?.map(|tree| tree.ids.size()[0]))
    }

    /// The trees of checked right-padded `ids` (see [`Self::padded_input`]) that share
    /// prefixes, when the whole dense model computes them with clearly less work than the
    /// padded rows. (A rank's taped passes and the MoE router loss, which counts every row's
    /// tokens, stay padded.)
    fn prefix_tree(&self, ids: &Tensor, lengths: &[i64]) -> Result<Option<PrefixTree>> {
        if !self.share_prefixes || self.shard.is_some() || self.cfg.moe.is_some() {
            return Ok(None);
        }
        let width = ids.size()[1] as usize;
        let host = Vec::<i64>::try_from(ids.f_flatten(0, -1)?.f_to_device(Device::Cpu)?)?;
        PrefixTree::plan(&host, width, lengths, self.device())
    }

    /// Token logprobs in the padded layout of rows laid out as `tree`.
    fn tree_logprobs(&self, tree: &PrefixTree, temperature: f64) -> Result<Tensor> {
        let rope = self.rotary.tables(&tree.positions, self.kind)?;
        let masks = tree.masks(&self.windows())?;
        let hidden = self.run_layers_at(&tree.ids, &rope, &masks, None, None)?;
        let vocab = self.cfg.vocab_size;
        let head = self.head();
        tree.logprobs(&hidden, |h| head.logits(h), LOGPROB_CHUNK_ELEMENTS / vocab.max(1), temperature, target_logprobs)
    }

    /// [`Self::train_logprobs`] of the sequences packed in `row`, right-padded [n, S].
    pub fn packed_train_logprobs(&self, row: &PackedRow, temperature: f64) -> Result<(Tensor, Tape)> {
        check_temperature(temperature)?;
        let pass = self.packed_pass(row)?;
        let (packed, tape) = self.logprobs_with_tape(&pass, temperature)?;
        Ok((row.unpack(&packed)?, tape))
    }

    fn logprobs_with_tape(&self, pass: &Pass, temperature: f64) -> Result<(Tensor, Tape)> {
        let routers = if self.shard.is_some() { Routers::own_graph() } else { Routers::shared() };
        let (logprobs, mut tape) = if self.shard.is_some() {
            self.taped_logprobs(pass, temperature, &routers)?
        } else {
            let hidden = self.run_layers_at(&pass.ids, &pass.rope, &pass.masks, None, Some(&routers))?;
            (self.pass_logprobs(&hidden, pass, temperature)?, Tape::default())
        };
        if let Some(moe) = &self.cfg.moe {
            tape.router_aux_loss = routers.load_balancing_loss(moe, pass.padding.as_ref())?;
            // Every rank of a group adds its share: the gradients summed over the ranks are
            // the loss's once.
            let coefficient = if moe.output_router_logits { moe.router_aux_loss_coef } else { 0.0 };
            tape.router_loss_weight = coefficient / self.world_size() as f64;
        }
        Ok((logprobs, tape))
    }

    /// Right-padded rows as a pass, from [`Self::padded_input`]'s checked ids (padding as
    /// token 0) and padding mask: the positions' rotary tables and causal masks, and the
    /// positions without a logprob (padding).
    fn padded_pass(&self, (ids, invalid): (Tensor, Tensor)) -> Result<Pass> {
        let (b, s) = (ids.size()[0], ids.size()[1]);
        let (rope, masks) =
            positions_for(&self.rotary, self.kind, &self.windows(), &ids, &vec![0; b as usize], s, self.device())?;
        Ok(Pass { padding: Some(invalid.shallow_clone()), ids, invalid, rope, masks })
    }

    /// A packed row as a pass: each sequence at its own positions, attending to itself; its
    /// first token has no logprob.
    fn packed_pass(&self, row: &PackedRow) -> Result<Pass> {
        check_ids(self.cfg.vocab_size, &row.ids, None)?;
        let device = self.device();
        let rope = self.rotary.tables(&row.positions(device)?, self.kind)?;
        let ids = row.ids.f_to_device(device)?;
        Ok(Pass { ids, invalid: row.starts(device)?, padding: None, rope, masks: row.masks(&self.windows()) })
    }

    /// The logprobs of a pass's tokens from its final hidden states (the vocabulary split
    /// over the ranks of a tensor-parallel group).
    fn pass_logprobs(&self, hidden: &Tensor, pass: &Pass, temperature: f64) -> Result<Tensor> {
        if self.shard.is_some() {
            let logprobs = |logits: &Tensor, targets: &Tensor| self.vocab_parallel_logprobs(logits, targets);
            let share = self.largest_vocab_share();
            return chunked_token_logprobs(
                hidden,
                &pass.ids,
                &pass.invalid,
                &self.head(),
                share,
                temperature,
                logprobs,
            );
        }
        let vocab = self.cfg.vocab_size;
        chunked_token_logprobs(hidden, &pass.ids, &pass.invalid, &self.head(), vocab, temperature, target_logprobs)
    }
}

/// The LM head and what the family does to its logits: Granite divides them by
/// `logits_scaling`, Gemma 2 soft-caps them. Elementwise, so a tensor-parallel rank applies it
/// to its vocabulary slice before the vocab-parallel softmax.
struct Head<'a> {
    weight: &'a Tensor,
    divisor: f64,
    softcap: Option<f64>,
}

impl Head<'_> {
    /// Logits [.., vocab (or this rank's share)] of hidden states [.., hidden], in their dtype.
    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let mut logits = hidden.f_linear::<Tensor>(self.weight, None)?;
        if self.divisor != 1.0 {
            logits = logits.f_div_scalar(self.divisor)?;
        }
        if let Some(cap) = self.softcap {
            logits = logits.f_div_scalar(cap)?.f_tanh()?.f_mul_scalar(cap)?;
        }
        Ok(logits)
    }
}

/// What one forward pass over a batch of rows needs besides the weights.
pub(crate) struct Pass {
    ids: Tensor,
    /// Positions without a logprob (a sequence's first token, padding).
    invalid: Tensor,
    /// The padding positions (`None`: every token is a sequence's).
    padding: Option<Tensor>,
    rope: RopeTables,
    masks: Masks,
}

/// The logprobs [B, L] of `targets` [B, L] under f32 `logits` [B, L, vocab].
fn target_logprobs(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let targets = targets.f_unsqueeze(-1)?;
    Ok(logits.f_log_softmax(-1, Kind::Float)?.f_gather(-1, &targets, false)?.f_squeeze_dim(-1)?)
}

fn check_temperature(temperature: f64) -> Result<()> {
    if temperature.is_finite() && temperature > 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidInput(format!("temperature must be positive and finite, got {temperature}")))
    }
}

/// Token logprobs [B, S] from the final `hidden` states [B, S, hidden] of `ids`: the LM head
/// (`head`, `vocab` rows) is applied to chunks of positions so that at most
/// [`LOGPROB_CHUNK_ELEMENTS`] logits exist at once; `logprobs(logits, targets)` turns a
/// chunk's f32 logits [B, L, vocab] (divided by `temperature`) and next tokens [B, L] into
/// their logprobs [B, L]. Entry 0 and the `invalid` (padding) positions are 0.
fn chunked_token_logprobs(
    hidden: &Tensor,
    ids: &Tensor,
    invalid: &Tensor,
    head: &Head<'_>,
    vocab: i64,
    temperature: f64,
    mut logprobs: impl FnMut(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let (b, s) = (ids.size()[0], ids.size()[1]);
    let predicted = s - 1;
    let chunk = (LOGPROB_CHUNK_ELEMENTS / (b * vocab.max(1))).max(1);
    let mut parts = vec![Tensor::f_zeros([b, 1], (Kind::Float, hidden.device()))?];
    let mut start = 0;
    while start < predicted {
        let len = chunk.min(predicted - start);
        let logits = head.logits(&hidden.f_narrow(1, start, len)?)?.f_to_kind(Kind::Float)?;
        let logits = if temperature == 1.0 { logits } else { logits.f_div_scalar(temperature)? };
        parts.push(logprobs(&logits, &ids.f_narrow(1, start + 1, len)?)?);
        start += len;
    }
    Ok(Tensor::f_cat(&parts, 1)?.f_masked_fill(invalid, 0.0)?)
}

/// Checks that `input_ids` is an i64 [B, S] tensor whose ids (within each row's length,
/// when given) index a vocabulary of `vocab_size`.
fn check_ids(vocab_size: i64, input_ids: &Tensor, lengths: Option<&[i64]>) -> Result<(i64, i64)> {
    let size = input_ids.size();
    let [b, s] = size[..] else {
        return Err(Error::InvalidInput(format!("input ids must be [batch, seq], got shape {size:?}")));
    };
    if input_ids.kind() != Kind::Int64 {
        return Err(Error::InvalidInput(format!("input ids must be i64, got {:?}", input_ids.kind())));
    }
    if b == 0 || s == 0 {
        return Err(Error::InvalidInput(format!("input ids are empty (shape {size:?})")));
    }
    let ids = Vec::<i64>::try_from(input_ids.f_flatten(0, -1)?.f_to_device(Device::Cpu)?)?;
    for (row, chunk) in ids.chunks(s as usize).enumerate() {
        let len = lengths.map_or(s, |l| l[row]) as usize;
        if let Some((position, &id)) = chunk[..len].iter().enumerate().find(|(_, id)| !(0..vocab_size).contains(*id)) {
            return Err(Error::TokenOutOfRange { id, row, position, vocab_size });
        }
    }
    Ok((b, s))
}

/// Checks right-padded ids against their row lengths; returns the ids on `device` with
/// padding replaced by token 0, and the [B, S] mask of padding positions.
fn padded_ids(vocab_size: i64, device: Device, input_ids: &Tensor, lengths: &[i64]) -> Result<(Tensor, Tensor)> {
    let batch = input_ids.size().first().copied().unwrap_or(0);
    if lengths.len() as i64 != batch {
        return Err(Error::InvalidInput(format!("{} lengths for a batch of {batch}", lengths.len())));
    }
    let seq = input_ids.size().get(1).copied().unwrap_or(0);
    if let Some(bad) = lengths.iter().find(|&&l| l < 1 || l > seq) {
        return Err(Error::InvalidInput(format!("sequence length {bad} is outside 1..={seq}")));
    }
    let (_, s) = check_ids(vocab_size, input_ids, Some(lengths))?;
    let lengths = Tensor::from_slice(lengths).f_to_device(device)?.f_unsqueeze(1)?;
    let invalid = Tensor::f_arange(s, (Kind::Int64, device))?.f_unsqueeze(0)?.f_ge_tensor(&lengths)?;
    let ids = input_ids.f_to_device(device)?.f_masked_fill(&invalid, 0)?;
    Ok((ids, invalid))
}
