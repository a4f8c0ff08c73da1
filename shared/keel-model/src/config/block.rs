//! How a family's decoder differs from Llama's ([`Block`]), and the checkpoint tensors Keel
//! holds split ([`FusedWeight`]).

use super::{Architecture, Fields, finite_positive};
use crate::error::{Error, Result};

/// Which RMSNorms a decoder layer has around its two branches, by their Hugging Face names
/// (`None`: the layer has no such norm). Llama normalises each branch's input; OLMo 2
/// normalises each branch's output instead; Gemma and GLM-4 do both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Norms {
    pub pre_attention: Option<&'static str>,
    pub post_attention: Option<&'static str>,
    pub pre_mlp: Option<&'static str>,
    pub post_mlp: Option<&'static str>,
}

impl Norms {
    const LLAMA: Self = Self {
        pre_attention: Some("input_layernorm"),
        post_attention: None,
        pre_mlp: Some("post_attention_layernorm"),
        post_mlp: None,
    };
    const GEMMA: Self = Self {
        pre_attention: Some("input_layernorm"),
        post_attention: Some("post_attention_layernorm"),
        pre_mlp: Some("pre_feedforward_layernorm"),
        post_mlp: Some("post_feedforward_layernorm"),
    };
    const OLMO: Self = Self {
        pre_attention: None,
        post_attention: Some("post_attention_layernorm"),
        pre_mlp: None,
        post_mlp: Some("post_feedforward_layernorm"),
    };
    const GLM: Self = Self {
        pre_attention: Some("input_layernorm"),
        post_attention: Some("post_self_attn_layernorm"),
        pre_mlp: Some("post_attention_layernorm"),
        post_mlp: Some("post_mlp_layernorm"),
    };

    /// Every norm the layer has, by name.
    pub fn names(&self) -> impl Iterator<Item = &'static str> {
        [self.pre_attention, self.post_attention, self.pre_mlp, self.post_mlp].into_iter().flatten()
    }
}

/// How an RMSNorm's weight multiplies the normed values (computed in f32 in every family):
/// the three differ only in rounding below f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormWeight {
    /// `w · cast(normed)`, in the weights' dtype (Llama and most families).
    AfterCast,
    /// `cast(w · normed)`, in f32 (OLMo).
    InF32,
    /// `cast((1 + w) · normed)`, in f32 (Gemma; its weights start at 0).
    OffsetInF32,
}

/// RMSNorm on queries and keys before the rotary embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// Over each head's dimensions (Qwen3, Gemma 3).
    PerHead,
    /// Over the whole q (k) projection, every head at once (OLMo 2 and 3).
    Projection,
}

impl QkNorm {
    /// The size of the norm's weight for a projection of `heads` heads of `head_dim` (`None`:
    /// no norm).
    pub fn size(self, heads: i64, head_dim: i64) -> Option<i64> {
        match self {
            Self::None => None,
            Self::PerHead => Some(head_dim),
            Self::Projection => Some(heads * head_dim),
        }
    }
}

/// The gate's activation in the gated MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu` (SwiGLU).
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`, `gelu_new`): Gemma's GeGLU.
    GeluTanh,
    /// Exact GELU (`gelu`).
    Gelu,
}

impl Activation {
    fn parse(key: &str, name: &str) -> Result<Self> {
        match name {
            "silu" | "swish" => Ok(Self::Silu),
            "gelu_pytorch_tanh" | "gelu_new" => Ok(Self::GeluTanh),
            "gelu" => Ok(Self::Gelu),
            other => Err(Error::unsupported(key, other, "silu, gelu_pytorch_tanh, gelu_new and gelu are implemented")),
        }
    }
}

/// How a family's decoder differs from Llama's, besides attention biases, windows and rotary
/// embeddings: everything here is read from `config.json` by [`Block::parse`], the one place
/// that says what each family changes.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    pub norms: Norms,
    /// How RMSNorm weights apply to the normed values.
    pub norm_weight: NormWeight,
    pub activation: Activation,
    /// The token embeddings are multiplied by this (Gemma: √hidden, rounded to the weights'
    /// dtype as transformers does; Granite: `embedding_multiplier`).
    pub embedding_multiplier: f64,
    /// The attention logits' scale (`None`: 1/√head_dim). Gemma: `query_pre_attn_scalar`^-½;
    /// Granite: `attention_multiplier`.
    pub attention_scale: Option<f64>,
    /// Attention logits pass through `cap · tanh(x / cap)` before the mask (Gemma 2).
    pub attention_softcap: Option<f64>,
    /// The LM head's logits pass through `cap · tanh(x / cap)` (Gemma 2).
    pub final_softcap: Option<f64>,
    /// Each branch's output is multiplied by this before it joins the residual stream
    /// (Granite's `residual_multiplier`).
    pub residual_multiplier: f64,
    /// The LM head's logits are divided by this (Granite's `logits_scaling`).
    pub logits_divisor: f64,
    /// q, k and v are stored as one `qkv_proj` (Phi-3); Keel holds them apart and splits or
    /// joins them at load and save ([`ModelConfig::fused_weights`]).
    pub fused_qkv: bool,
    /// gate and up are stored as one `gate_up_proj`, gate first (Phi-3, GLM-4).
    pub fused_gate_up: bool,
}

impl Block {
    pub(super) fn parse(f: &Fields<'_>, architecture: Architecture, hidden_size: i64) -> Result<Self> {
        use Architecture as A;
        let mut block = Self {
            norms: Norms::LLAMA,
            norm_weight: NormWeight::AfterCast,
            activation: Activation::Silu,
            embedding_multiplier: 1.0,
            attention_scale: None,
            attention_softcap: None,
            final_softcap: None,
            residual_multiplier: 1.0,
            logits_divisor: 1.0,
            fused_qkv: false,
            fused_gate_up: false,
        };
        match architecture {
            A::Gemma2 | A::Gemma3 => {
                block.norms = Norms::GEMMA;
                block.norm_weight = NormWeight::OffsetInF32;
                // transformers' Gemma MLP reads `hidden_activation` (not `hidden_act`).
                let activation = f.str("hidden_activation")?.unwrap_or("gelu_pytorch_tanh");
                block.activation = Activation::parse("hidden_activation", activation)?;
                block.embedding_multiplier = (hidden_size as f64).sqrt();
                let scalar =
                    finite_positive("query_pre_attn_scalar", f.float("query_pre_attn_scalar")?.unwrap_or(256.0))?;
                block.attention_scale = Some(scalar.powf(-0.5));
                let (attention, last) = if architecture == A::Gemma2 { (Some(50.0), Some(30.0)) } else { (None, None) };
                let cap = |key: &str, default: Option<f64>| -> Result<Option<f64>> {
                    let value = if f.0.contains_key(key) { f.float(key)? } else { default };
                    value.map(|v| finite_positive(key, v)).transpose()
                };
                block.attention_softcap = cap("attn_logit_softcapping", attention)?;
                block.final_softcap = cap("final_logit_softcapping", last)?;
                if f.bool("use_bidirectional_attention")?.unwrap_or(false) {
                    return Err(Error::unsupported(
                        "use_bidirectional_attention",
                        true,
                        "only causal attention is implemented (a causal LM)",
                    ));
                }
            }
            A::Olmo2 | A::Olmo3 => {
                block.norms = Norms::OLMO;
                block.norm_weight = NormWeight::InF32;
            }
            A::Glm4 => {
                block.norms = Norms::GLM;
                block.fused_gate_up = true;
            }
            A::Phi3 => {
                block.fused_qkv = true;
                block.fused_gate_up = true;
            }
            A::Granite => {
                let multiplier = |key: &str| -> Result<f64> { finite_positive(key, f.float(key)?.unwrap_or(1.0)) };
                block.embedding_multiplier = multiplier("embedding_multiplier")?;
                block.residual_multiplier = multiplier("residual_multiplier")?;
                block.attention_scale = Some(multiplier("attention_multiplier")?);
                block.logits_divisor = multiplier("logits_scaling")?;
            }
            A::Llama | A::Qwen2 | A::Qwen3 | A::Mistral | A::Qwen3Moe | A::Mixtral | A::SmolLm3 => {}
        }
        if !matches!(architecture, A::Gemma2 | A::Gemma3)
            && let Some(act) = f.str("hidden_act")?
        {
            block.activation = Activation::parse("hidden_act", act)?;
            if block.activation != Activation::Silu {
                return Err(Error::unsupported("hidden_act", act, "this family's MLP is implemented with silu only"));
            }
        }
        Ok(block)
    }
}

/// One tensor of a checkpoint that Keel holds as several: rows `parts[i].1` after those of
/// the parts before it belong to parameter `parts[i].0` (full Hugging Face names).
#[derive(Debug, Clone, PartialEq)]
pub struct FusedWeight {
    pub name: String,
    pub parts: Vec<(String, i64)>,
}
