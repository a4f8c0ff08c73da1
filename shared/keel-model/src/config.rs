//! `config.json` of the supported Hugging Face architectures, parsed into one resolved
//! [`ModelConfig`].
//!
//! Both config layouts transformers writes are read: v4 (`rope_theta` + `rope_scaling`,
//! `torch_dtype`) and v5 (`rope_parameters`, `dtype`, `layer_types`). Per-architecture
//! defaults follow transformers' config classes. Anything the model code cannot honour is
//! refused with an error naming the field.

use std::path::Path;

use serde_json::{Map, Value, json};

use crate::error::{Error, Result};

/// The decoder-only architectures Keel runs. They share one implementation and differ in:
/// Qwen2 has biases on q/k/v; Qwen3 has RMSNorm on q and k per head (and an optional
/// `attention_bias`); Llama has optional `attention_bias`/`mlp_bias` and Llama 3 rope
/// scaling; Mistral uses a sliding attention window. Qwen3-MoE (Qwen3's attention) and
/// Mixtral (Mistral's) replace the MLP with a mixture of experts ([`MoeConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
    Mistral,
    Qwen3Moe,
    Mixtral,
    Gemma2,
    Gemma3,
    Phi3,
    Olmo2,
    Olmo3,
    Glm4,
    Granite,
    SmolLm3,
}

impl Architecture {
    pub const ALL: [Self; 14] = [
        Self::Llama,
        Self::Qwen2,
        Self::Qwen3,
        Self::Mistral,
        Self::Qwen3Moe,
        Self::Mixtral,
        Self::Gemma2,
        Self::Gemma3,
        Self::Phi3,
        Self::Olmo2,
        Self::Olmo3,
        Self::Glm4,
        Self::Granite,
        Self::SmolLm3,
    ];

    /// The class name in `config.json`'s `architectures`.
    pub fn hf_class(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen3Moe => "Qwen3MoeForCausalLM",
            Self::Mixtral => "MixtralForCausalLM",
            Self::Gemma2 => "Gemma2ForCausalLM",
            Self::Gemma3 => "Gemma3ForCausalLM",
            Self::Phi3 => "Phi3ForCausalLM",
            Self::Olmo2 => "Olmo2ForCausalLM",
            Self::Olmo3 => "Olmo3ForCausalLM",
            Self::Glm4 => "Glm4ForCausalLM",
            Self::Granite => "GraniteForCausalLM",
            Self::SmolLm3 => "SmolLM3ForCausalLM",
        }
    }

    /// The name `keel model init --arch` takes: the `model_type`, without Gemma 3's `_text`.
    pub fn short_name(self) -> &'static str {
        match self {
            Self::Gemma3 => "gemma3",
            other => other.model_type(),
        }
    }

    /// The `model_type` in `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Mistral => "mistral",
            Self::Qwen3Moe => "qwen3_moe",
            Self::Mixtral => "mixtral",
            Self::Gemma2 => "gemma2",
            Self::Gemma3 => "gemma3_text",
            Self::Phi3 => "phi3",
            Self::Olmo2 => "olmo2",
            Self::Olmo3 => "olmo3",
            Self::Glm4 => "glm4",
            Self::Granite => "granite",
            Self::SmolLm3 => "smollm3",
        }
    }

    /// Every supported class name, comma-separated.
    pub fn hf_classes() -> String {
        Self::ALL.map(Self::hf_class).join(", ")
    }

    fn from_hf_class(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|arch| arch.hf_class() == name)
            .ok_or_else(|| Error::UnknownArchitecture(name.to_string()))
    }

    fn from_model_type(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|arch| arch.model_type() == name)
            .ok_or_else(|| Error::UnknownArchitecture(format!("model_type {name}")))
    }
}

impl std::str::FromStr for Architecture {
    type Err = Error;

    /// Accepts the short name (`llama`, `gemma3`), the `model_type` or the HF class
    /// (`LlamaForCausalLM`).
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|a| [a.short_name(), a.model_type(), a.hf_class()].contains(&s)).ok_or_else(|| {
            let names = Self::ALL.map(|arch| arch.short_name()).join(", ");
            Error::InvalidInput(format!("unknown architecture `{s}` (use one of {names})"))
        })
    }
}

/// How rotary frequencies are scaled.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (`rope_type: linear`).
    Linear {
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent scaling (`rope_type: llama3`).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: i64,
    },
    /// Phi-3's LongRoPE (`rope_type: longrope`, also written `su`): each frequency divided
    /// by its `short_factor`, or by its `long_factor` in a pass that reaches past
    /// `original_max_position_embeddings` (as transformers chooses per forward call), and
    /// cos/sin scaled by `attention_factor`.
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: i64,
        attention_factor: f64,
    },
}

/// The rotary embedding of a layer.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: RopeScaling,
    /// How many of each head's dimensions rotate (`partial_rotary_factor` × head_dim; the rest
    /// pass through): the whole head unless the family says otherwise.
    pub rotary_dim: i64,
    /// Pairs (x0, x1), (x2, x3), … rotate together (GLM), rather than the two halves of the
    /// rotated dimensions (every other family).
    pub interleaved: bool,
}

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

/// RMSNorm on queries and keys before the rotary embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// Over each head's dimensions (Qwen3, Gemma 3).
    PerHead,
    /// Over the whole q (k) projection, every head at once (OLMo 2 and 3).
    Projection,
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
    /// RMSNorm weights apply as `1 + w` (Gemma), computed in f32.
    pub norm_offset: bool,
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
    fn parse(f: &Fields<'_>, architecture: Architecture, hidden_size: i64) -> Result<Self> {
        use Architecture as A;
        let mut block = Self {
            norms: Norms::LLAMA,
            norm_offset: false,
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
                block.norm_offset = true;
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
            A::Olmo2 | A::Olmo3 => block.norms = Norms::OLMO,
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

/// A parsed and validated `config.json`.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    /// The rotary embedding of full-attention layers (of every layer, unless the next two
    /// fields say otherwise).
    pub rope: RopeConfig,
    /// The rotary embedding of sliding-window layers, where it differs (Gemma 3's
    /// `rope_local_base_freq`; OLMo 3's and Gemma 3's per-layer-type `rope_parameters`).
    pub local_rope: Option<RopeConfig>,
    /// Layers without a rotary embedding (SmolLM3's NoPE layers).
    pub nope_layers: Vec<bool>,
    pub max_position_embeddings: i64,
    pub tie_word_embeddings: bool,
    /// Bias on q, k and v projections.
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// Bias on gate, up and down projections.
    pub mlp_bias: bool,
    /// RMSNorm on q and k (Qwen3, Gemma 3: per head; OLMo: over the projection).
    pub qk_norm: QkNorm,
    /// What else the family changes in the decoder ([`Block`]).
    pub block: Block,
    /// The attention window of each layer (`None` = full causal attention).
    pub sliding_windows: Vec<Option<i64>>,
    pub bos_token_id: Option<i64>,
    pub eos_token_ids: Vec<i64>,
    pub pad_token_id: Option<i64>,
    /// `torch_dtype` / `dtype` as written in the file.
    pub dtype: Option<String>,
    /// The mixture of experts of Qwen3-MoE and Mixtral (`None`: every MLP is dense).
    pub moe: Option<MoeConfig>,
    /// The file's JSON, kept so that saving preserves fields Keel does not use.
    raw: Map<String, Value>,
}

/// A mixture-of-experts MLP, as transformers' Qwen3-MoE and Mixtral blocks compute it: a
/// router (`gate`, no bias) scores the experts per token; the softmax of its logits (f32)
/// picks the `experts_per_token` best, whose weights are renormalised to sum to 1 when
/// `normalize_top_k` (Mixtral always; Qwen3-MoE's `norm_topk_prob`); the output is the
/// weighted sum of those experts' SwiGLU MLPs.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub experts: i64,
    pub experts_per_token: i64,
    /// The intermediate size of each expert's MLP.
    pub expert_intermediate_size: i64,
    pub normalize_top_k: bool,
    /// Which layers have experts (the others a dense MLP of `intermediate_size`): Qwen3-MoE's
    /// `decoder_sparse_step` and `mlp_only_layers`; every layer for Mixtral.
    pub sparse_layers: Vec<bool>,
    /// transformers' `router_aux_loss_coef`.
    pub router_aux_loss_coef: f64,
    /// transformers' `output_router_logits`: with it, training adds
    /// `router_aux_loss_coef` × the load-balancing loss to the loss, as transformers does.
    pub output_router_logits: bool,
}

impl MoeConfig {
    /// The Hugging Face names of a layer's block and its experts' linears: Qwen3-MoE
    /// `mlp.experts.E.{gate,up,down}_proj`, Mixtral `block_sparse_moe.experts.E.{w1,w3,w2}`.
    pub fn names(architecture: Architecture) -> (&'static str, [&'static str; 3]) {
        match architecture {
            Architecture::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
            _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        }
    }

    fn parse(f: &Fields<'_>, architecture: Architecture, layers: i64) -> Result<Option<Self>> {
        // transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`.
        let (experts_key, default_experts, default_k) = match architecture {
            Architecture::Qwen3Moe if f.get("num_experts").is_some() => ("num_experts", 128, 8),
            Architecture::Qwen3Moe => ("num_local_experts", 128, 8),
            Architecture::Mixtral => ("num_local_experts", 8, 2),
            _ => return Ok(None),
        };
        let experts = positive(experts_key, f.int(experts_key)?.unwrap_or(default_experts))?;
        let experts_per_token = positive("num_experts_per_tok", f.int("num_experts_per_tok")?.unwrap_or(default_k))?;
        if experts_per_token > experts {
            return Err(Error::invalid(
                "num_experts_per_tok",
                format!("({experts_per_token}) is more than the {experts} experts"),
            ));
        }
        let router_aux_loss_coef = f.float("router_aux_loss_coef")?.unwrap_or(0.001);
        if !(router_aux_loss_coef >= 0.0 && router_aux_loss_coef.is_finite()) {
            return Err(Error::invalid("router_aux_loss_coef", format!("must be ≥ 0, found {router_aux_loss_coef}")));
        }
        let output_router_logits = f.bool("output_router_logits")?.unwrap_or(false);
        if architecture == Architecture::Mixtral {
            if let Some(noise) = f.float("router_jitter_noise")?.filter(|n| *n != 0.0) {
                return Err(Error::unsupported(
                    "router_jitter_noise",
                    noise,
                    "only 0 (no noise on the router's input) is implemented",
                ));
            }
            return Ok(Some(Self {
                experts,
                experts_per_token,
                expert_intermediate_size: positive("intermediate_size", f.req_int("intermediate_size")?)?,
                normalize_top_k: true,
                sparse_layers: vec![true; layers as usize],
                router_aux_loss_coef,
                output_router_logits,
            }));
        }
        for key in ["shared_expert_intermediate_size", "n_shared_experts"] {
            if let Some(v) = f.get(key).filter(|v| v.as_i64() != Some(0)) {
                return Err(Error::unsupported(key, v, "Qwen3-MoE has no shared experts"));
            }
        }
        let step = positive("decoder_sparse_step", f.int("decoder_sparse_step")?.unwrap_or(1))?;
        let dense: Vec<i64> = match f.get("mlp_only_layers") {
            None => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_i64().filter(|i| (0..layers).contains(i)).ok_or_else(|| {
                        Error::invalid("mlp_only_layers", format!("must hold layer indices below {layers}, found {v}"))
                    })
                })
                .collect::<Result<_>>()?,
            Some(other) => return Err(Error::invalid("mlp_only_layers", format!("must be a list, found {other}"))),
        };
        Ok(Some(Self {
            experts,
            experts_per_token,
            expert_intermediate_size: positive(
                "moe_intermediate_size",
                f.int("moe_intermediate_size")?.unwrap_or(768),
            )?,
            normalize_top_k: f.bool("norm_topk_prob")?.unwrap_or(false),
            sparse_layers: (0..layers).map(|i| !dense.contains(&i) && (i + 1) % step == 0).collect(),
            router_aux_loss_coef,
            output_router_logits,
        }))
    }
}

/// Typed access to the raw JSON with errors naming the field.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn int(&self, key: &str) -> Result<Option<i64>> {
        self.get(key)
            .map(|v| v.as_i64().ok_or_else(|| Error::invalid(key, format!("must be an integer, found {v}"))))
            .transpose()
    }

    fn req_int(&self, key: &str) -> Result<i64> {
        self.int(key)?.ok_or_else(|| Error::invalid(key, "is missing"))
    }

    fn float(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| Error::invalid(key, format!("must be a number, found {v}"))))
            .transpose()
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| Error::invalid(key, format!("must be true or false, found {v}"))))
            .transpose()
    }

    fn str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| Error::invalid(key, format!("must be a string, found {v}"))))
            .transpose()
    }

    /// An id or a list of ids (`eos_token_id` may be either).
    fn ids(&self, key: &str) -> Result<Vec<i64>> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_i64().ok_or_else(|| Error::invalid(key, format!("must hold integers, found {v}"))))
                .collect(),
            Some(v) => Ok(vec![
                v.as_i64().ok_or_else(|| Error::invalid(key, format!("must be an integer or a list, found {v}")))?,
            ]),
        }
    }
}

fn positive(key: &str, value: i64) -> Result<i64> {
    if value > 0 { Ok(value) } else { Err(Error::invalid(key, format!("must be positive, found {value}"))) }
}

impl ModelConfig {
    /// Reads `dir/config.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(Error::io(&path))?;
        let value: Value = serde_json::from_str(&text).map_err(Error::json(&path))?;
        Self::from_json(value)
    }

    pub fn from_json(value: Value) -> Result<Self> {
        let Value::Object(raw) = value else {
            return Err(Error::invalid("(root)", "must be a JSON object"));
        };
        let f = Fields(&raw);
        let architecture = match f.get("architectures") {
            Some(Value::Array(names)) if names.len() == 1 => {
                Architecture::from_hf_class(names[0].as_str().unwrap_or_default())?
            }
            Some(other) => {
                return Err(Error::unsupported("architectures", other, "exactly one architecture is needed"));
            }
            None => Architecture::from_model_type(
                f.str("model_type")?
                    .ok_or_else(|| Error::invalid("architectures", "and `model_type` are both missing"))?,
            )?,
        };
        if let Some(q) = f.get("quantization_config") {
            return Err(Error::unsupported("quantization_config", q, "quantized checkpoints are not supported"));
        }
        if let Some(tp) = f.int("pretraining_tp")?.filter(|tp| *tp != 1) {
            return Err(Error::unsupported("pretraining_tp", tp, "only 1 is supported"));
        }
        use Architecture as A;

        let hidden_size = positive("hidden_size", f.req_int("hidden_size")?)?;
        let num_attention_heads = positive("num_attention_heads", f.req_int("num_attention_heads")?)?;
        // transformers' defaults, class by class.
        let default_kv_heads = match architecture {
            A::Llama | A::Phi3 | A::Olmo2 | A::Olmo3 | A::Granite => num_attention_heads,
            A::Mistral | A::Mixtral => 8,
            A::Qwen2 | A::Qwen3 => 32,
            A::Qwen3Moe | A::Gemma2 | A::Gemma3 | A::SmolLm3 => 4,
            A::Glm4 => 2,
        };
        let num_key_value_heads =
            positive("num_key_value_heads", f.int("num_key_value_heads")?.unwrap_or(default_kv_heads))?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(Error::invalid(
                "num_key_value_heads",
                format!("({num_key_value_heads}) must divide num_attention_heads ({num_attention_heads})"),
            ));
        }
        let default_head_dim = match architecture {
            A::Qwen3 | A::Glm4 => 128,
            A::Gemma2 | A::Gemma3 => 256,
            _ => hidden_size / num_attention_heads,
        };
        let head_dim = positive("head_dim", f.int("head_dim")?.unwrap_or(default_head_dim))?;
        if head_dim % 2 != 0 {
            return Err(Error::invalid("head_dim", format!("must be even for rotary embeddings, found {head_dim}")));
        }
        let num_hidden_layers = positive("num_hidden_layers", f.req_int("num_hidden_layers")?)?;
        let default_eps = match architecture {
            A::Phi3 | A::Olmo2 | A::Olmo3 => 1e-5,
            A::Glm4 => 1.5625e-7,
            _ => 1e-6,
        };
        let rms_norm_eps = f.float("rms_norm_eps")?.unwrap_or(default_eps);
        if rms_norm_eps <= 0.0 {
            return Err(Error::invalid("rms_norm_eps", format!("must be positive, found {rms_norm_eps}")));
        }

        let default_attention_bias = architecture == A::Glm4;
        let attention_bias = f.bool("attention_bias")?.unwrap_or(default_attention_bias);
        let mlp_bias = || -> Result<bool> { Ok(f.bool("mlp_bias")?.unwrap_or(false)) };
        let (qkv_bias, o_bias, mlp_bias, qk_norm) = match architecture {
            A::Llama | A::Granite | A::SmolLm3 => (attention_bias, attention_bias, mlp_bias()?, QkNorm::None),
            A::Qwen2 => (true, false, false, QkNorm::None),
            A::Qwen3 | A::Qwen3Moe => (attention_bias, attention_bias, false, QkNorm::PerHead),
            A::Mistral | A::Mixtral | A::Phi3 => (false, false, false, QkNorm::None),
            A::Gemma2 => (attention_bias, attention_bias, false, QkNorm::None),
            A::Gemma3 => (attention_bias, attention_bias, false, QkNorm::PerHead),
            A::Olmo2 | A::Olmo3 => (attention_bias, attention_bias, false, QkNorm::Projection),
            // GLM-4's o_proj never has a bias.
            A::Glm4 => (attention_bias, false, false, QkNorm::None),
        };
        let block = Block::parse(&f, architecture, hidden_size)?;

        let sliding_windows = sliding_windows(&f, architecture, num_hidden_layers)?;
        let dtype = f.str("dtype")?.or(f.str("torch_dtype")?).map(str::to_string);
        if let Some(dtype) = &dtype
            && !["float32", "bfloat16", "float16"].contains(&dtype.as_str())
        {
            return Err(Error::unsupported("torch_dtype", dtype, "use float32, bfloat16 or float16"));
        }

        let moe = MoeConfig::parse(&f, architecture, num_hidden_layers)?;
        // Qwen3-MoE's dense layers (if any) use `intermediate_size`, 6144 when absent.
        let intermediate_size = match architecture {
            A::Qwen3Moe => f.int("intermediate_size")?.unwrap_or(6144),
            _ => f.req_int("intermediate_size")?,
        };
        let max_position_embeddings = positive(
            "max_position_embeddings",
            f.int("max_position_embeddings")?.unwrap_or(match architecture {
                A::Llama | A::Olmo2 | A::Olmo3 | A::Granite => 2048,
                A::Phi3 => 4096,
                A::Gemma2 => 8192,
                A::Mistral | A::Mixtral | A::Gemma3 | A::Glm4 => 131_072,
                A::Qwen2 | A::Qwen3 | A::Qwen3Moe | A::SmolLm3 => 32_768,
            }),
        )?;
        let ropes = Ropes::parse(&f, architecture, head_dim, max_position_embeddings)?;
        let nope_layers = nope_layers(&f, architecture, num_hidden_layers)?;
        let tied_default = matches!(architecture, A::Gemma2 | A::Gemma3 | A::SmolLm3);
        Ok(Self {
            architecture,
            vocab_size: positive("vocab_size", f.req_int("vocab_size")?)?,
            hidden_size,
            intermediate_size: positive("intermediate_size", intermediate_size)?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope: ropes.full,
            local_rope: ropes.local,
            nope_layers,
            max_position_embeddings,
            tie_word_embeddings: f.bool("tie_word_embeddings")?.unwrap_or(tied_default),
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm,
            block,
            sliding_windows,
            bos_token_id: f.ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.ids("eos_token_id")?,
            pad_token_id: f.ids("pad_token_id")?.first().copied(),
            dtype,
            moe,
            raw,
        })
    }

    /// The checkpoint tensors Keel holds split: Phi-3's `qkv_proj` (q, k, v rows) and
    /// Phi-3's and GLM-4's `gate_up_proj` (gate, then up), per layer.
    pub fn fused_weights(&self) -> Vec<FusedWeight> {
        let (q, kv) = (self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim);
        let mut fused = Vec::new();
        for layer in 0..self.num_hidden_layers {
            let p = |name: &str| format!("model.layers.{layer}.{name}.weight");
            if self.block.fused_qkv {
                fused.push(FusedWeight {
                    name: p("self_attn.qkv_proj"),
                    parts: vec![(p("self_attn.q_proj"), q), (p("self_attn.k_proj"), kv), (p("self_attn.v_proj"), kv)],
                });
            }
            if self.block.fused_gate_up {
                let i = self.intermediate_size;
                fused.push(FusedWeight {
                    name: p("mlp.gate_up_proj"),
                    parts: vec![(p("mlp.gate_proj"), i), (p("mlp.up_proj"), i)],
                });
            }
        }
        fused
    }

    /// The rotary embedding of layer `layer` (`None`: a NoPE layer).
    pub fn layer_rope(&self, layer: usize) -> Option<&RopeConfig> {
        if self.nope_layers[layer] {
            return None;
        }
        match (&self.local_rope, self.sliding_windows[layer]) {
            (Some(local), Some(_)) => Some(local),
            _ => Some(&self.rope),
        }
    }

    /// Whether layer `layer` has experts rather than a dense MLP.
    pub fn is_sparse_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.sparse_layers[layer])
    }

    /// The MLP weights of layer `layer` (every expert's and the router's for a sparse layer).
    pub fn mlp_parameters(&self, layer: usize) -> i64 {
        let h = self.hidden_size;
        match &self.moe {
            Some(m) if m.sparse_layers[layer] => m.experts * (3 * h * m.expert_intermediate_size + h),
            _ => 3 * h * self.intermediate_size,
        }
    }

    /// The config as JSON, with `dtype` set to what the weights are saved in.
    pub fn to_json(&self, dtype: Option<&str>) -> Value {
        let mut raw = self.raw.clone();
        if let Some(dtype) = dtype {
            let mut keys: Vec<&str> = ["dtype", "torch_dtype"].into_iter().filter(|k| raw.contains_key(*k)).collect();
            if keys.is_empty() {
                keys.push("dtype");
            }
            for key in keys {
                raw.insert(key.into(), json!(dtype));
            }
        }
        Value::Object(raw)
    }
}

fn finite_positive(key: &str, value: f64) -> Result<f64> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(Error::invalid(key, format!("must be a positive number, found {value}")))
    }
}

/// The rotary embeddings of full-attention and (where they differ) sliding-window layers.
struct Ropes {
    full: RopeConfig,
    local: Option<RopeConfig>,
}

impl Ropes {
    /// Reads both layouts transformers writes: v4 (`rope_theta`, `rope_scaling`, Gemma 3's
    /// `rope_local_base_freq`) and v5 (`rope_parameters`, for Gemma 3 and OLMo 3 one object per
    /// layer type).
    fn parse(f: &Fields<'_>, architecture: Architecture, head_dim: i64, max_positions: i64) -> Result<Self> {
        use Architecture as A;
        let default_theta = match architecture {
            A::Gemma3 => 1_000_000.0,
            A::Olmo3 => 500_000.0,
            A::SmolLm3 => 2_000_000.0,
            _ => 10_000.0,
        };
        let shape = RopeShape {
            head_dim,
            max_positions,
            default_partial: if architecture == A::Glm4 { 0.5 } else { 1.0 },
            interleaved: architecture == A::Glm4,
            phi3: architecture == A::Phi3,
        };
        let per_layer_type = matches!(architecture, A::Gemma3 | A::Olmo3);
        let parameters = f.get("rope_parameters").and_then(Value::as_object);
        if per_layer_type && let Some(types) = parameters.filter(|p| p.contains_key("full_attention")) {
            let part = |key: &str| -> Result<RopeConfig> {
                let name = format!("rope_parameters.{key}");
                match types.get(key) {
                    None | Some(Value::Null) => shape.parse(f, &name, &Map::new(), default_theta),
                    Some(Value::Object(p)) => shape.parse(f, &name, p, default_theta),
                    Some(other) => Err(Error::invalid(&name, format!("must be an object, found {other}"))),
                }
            };
            let full = part("full_attention")?;
            let local_theta = if architecture == A::Gemma3 { 10_000.0 } else { full.theta };
            let local = match types.get("sliding_attention") {
                Some(Value::Object(p)) => shape.parse(f, "rope_parameters.sliding_attention", p, local_theta)?,
                _ => RopeConfig { theta: local_theta, scaling: RopeScaling::None, ..full.clone() },
            };
            return Ok(Self { local: (local != full).then_some(local), full });
        }
        // One object for every layer: `rope_parameters` (v5) or `rope_scaling` (v4).
        let (key, params) = match (f.get("rope_parameters"), f.get("rope_scaling")) {
            (Some(p), _) => ("rope_parameters", Some(p)),
            (None, Some(s)) => ("rope_scaling", Some(s)),
            (None, None) => ("rope_scaling", None),
        };
        let empty = Map::new();
        let params = match params {
            Some(Value::Object(map)) => map,
            Some(other) => return Err(Error::invalid(key, format!("must be an object, found {other}"))),
            None => &empty,
        };
        let full = shape.parse(f, key, params, default_theta)?;
        let local = match architecture {
            // v4 Gemma 3: local layers at `rope_local_base_freq`, unscaled.
            A::Gemma3 => {
                let theta = f.float("rope_local_base_freq")?.unwrap_or(10_000.0);
                Some(RopeConfig {
                    theta: finite_positive("rope_local_base_freq", theta)?,
                    scaling: RopeScaling::None,
                    ..full.clone()
                })
            }
            // v4 OLMo 3, as transformers 5.23 reads it: `rope_scaling` and `rope_theta` go to the
            // full-attention layers only; the sliding ones keep the default base, unscaled.
            A::Olmo3 => Some(RopeConfig { theta: 500_000.0, scaling: RopeScaling::None, ..full.clone() }),
            _ => None,
        };
        Ok(Self { local: local.filter(|l| *l != full), full })
    }
}

/// What a rotary embedding's parameters are read against.
struct RopeShape {
    head_dim: i64,
    max_positions: i64,
    default_partial: f64,
    interleaved: bool,
    /// Phi-3 reads `su` and `yarn` as LongRoPE.
    phi3: bool,
}

impl RopeShape {
    /// One rotary embedding from `params` (named `key` in errors), with the top-level fields
    /// of `f` where the object lacks them (v4 keeps `rope_theta`, `partial_rotary_factor`
    /// and Phi-3's `original_max_position_embeddings` there).
    fn parse(&self, f: &Fields<'_>, key: &str, params: &Map<String, Value>, default_theta: f64) -> Result<RopeConfig> {
        let p = Fields(params);
        let field = |name: &str| format!("{key}.{name}");
        let theta = p.float("rope_theta")?.or(f.float("rope_theta")?).unwrap_or(default_theta);
        if theta <= 0.0 {
            return Err(Error::invalid("rope_theta", format!("must be positive, found {theta}")));
        }
        let partial =
            p.float("partial_rotary_factor")?.or(f.float("partial_rotary_factor")?).unwrap_or(self.default_partial);
        if !(partial > 0.0 && partial <= 1.0) {
            return Err(Error::invalid("partial_rotary_factor", format!("must be in (0, 1], found {partial}")));
        }
        // transformers truncates: int(head_dim * partial_rotary_factor).
        let rotary_dim = (self.head_dim as f64 * partial) as i64;
        if rotary_dim < 2 || rotary_dim % 2 != 0 {
            return Err(Error::invalid(
                "partial_rotary_factor",
                format!(
                    "gives {rotary_dim} rotary dimensions of a {}-dimension head (an even number is needed)",
                    self.head_dim
                ),
            ));
        }
        let rope_type = p.str("rope_type")?.or(p.str("type")?).unwrap_or("default");
        let factor = || -> Result<f64> {
            let factor = p.float("factor")?.ok_or_else(|| Error::invalid(&field("factor"), "is missing"))?;
            if factor < 1.0 {
                return Err(Error::invalid(&field("factor"), format!("must be at least 1, found {factor}")));
            }
            Ok(factor)
        };
        let original_max = || -> Result<i64> {
            let value = p.int("original_max_position_embeddings")?.or(f.int("original_max_position_embeddings")?);
            positive(
                &field("original_max_position_embeddings"),
                value.ok_or_else(|| Error::invalid(&field("original_max_position_embeddings"), "is missing"))?,
            )
        };
        let longrope = || -> Result<RopeScaling> {
            let factors = |name: &str| -> Result<Vec<f64>> {
                let list = p
                    .get(name)
                    .and_then(Value::as_array)
                    .ok_or_else(|| Error::invalid(&field(name), "must be a list of numbers"))?;
                let values: Vec<f64> = list.iter().filter_map(Value::as_f64).collect();
                if values.len() != list.len()
                    || values.len() as i64 != rotary_dim / 2
                    || values.iter().any(|v| !v.is_finite() || *v <= 0.0)
                {
                    return Err(Error::invalid(
                        &field(name),
                        format!("must hold {} positive numbers (rotary dimensions / 2)", rotary_dim / 2),
                    ));
                }
                Ok(values)
            };
            let original = original_max()?;
            let factor = match p.float("factor")? {
                Some(factor) => factor,
                None => self.max_positions as f64 / original as f64,
            };
            let attention_factor = match p.float("attention_factor")? {
                Some(a) => finite_positive(&field("attention_factor"), a)?,
                None if factor <= 1.0 => 1.0,
                None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
            };
            Ok(RopeScaling::LongRope {
                short_factor: factors("short_factor")?,
                long_factor: factors("long_factor")?,
                original_max_position_embeddings: original,
                attention_factor,
            })
        };
        let scaling = match rope_type {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: factor()? },
            "llama3" => {
                let low_freq_factor = p
                    .float("low_freq_factor")?
                    .ok_or_else(|| Error::invalid(&field("low_freq_factor"), "is missing"))?;
                let high_freq_factor = p
                    .float("high_freq_factor")?
                    .ok_or_else(|| Error::invalid(&field("high_freq_factor"), "is missing"))?;
                if high_freq_factor <= low_freq_factor {
                    return Err(Error::invalid(&field("high_freq_factor"), "must be greater than low_freq_factor"));
                }
                RopeScaling::Llama3 {
                    factor: factor()?,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings: original_max()?,
                }
            }
            // Phi-3 names LongRoPE `su` (and once `yarn`); transformers reads both as longrope.
            "longrope" => longrope()?,
            "su" | "yarn" if self.phi3 => longrope()?,
            other => {
                return Err(Error::unsupported(
                    &field("rope_type"),
                    other,
                    "supported rope types are default, linear, llama3 and (Phi-3) longrope",
                ));
            }
        };
        Ok(RopeConfig { theta, scaling, rotary_dim, interleaved: self.interleaved })
    }
}

/// SmolLM3's layers without rotary embeddings: `no_rope_layers` (1 = rotary, 0 = NoPE), or
/// every `no_rope_layer_interval`-th layer (4 when absent). No other family has them.
fn nope_layers(f: &Fields<'_>, architecture: Architecture, layers: i64) -> Result<Vec<bool>> {
    if architecture != Architecture::SmolLm3 {
        return Ok(vec![false; layers as usize]);
    }
    if let Some(list) = f.get("no_rope_layers") {
        let list = list.as_array().ok_or_else(|| Error::invalid("no_rope_layers", "must be a list of 0 and 1"))?;
        if list.len() as i64 != layers {
            return Err(Error::invalid("no_rope_layers", format!("has {} entries for {layers} layers", list.len())));
        }
        return list
            .iter()
            .map(|v| match v.as_i64() {
                Some(1) => Ok(false),
                Some(0) => Ok(true),
                _ => Err(Error::invalid("no_rope_layers", format!("must hold 0 or 1, found {v}"))),
            })
            .collect();
    }
    let interval = positive("no_rope_layer_interval", f.int("no_rope_layer_interval")?.unwrap_or(4))?;
    Ok((0..layers).map(|i| (i + 1) % interval == 0).collect())
}

/// The attention window of each layer, as transformers derives it: Mistral uses
/// `sliding_window` (4096 when the key is absent, none when null) on every layer, Phi-3 too
/// (none when absent); Qwen2/Qwen3 use it only with `use_sliding_window`, on layers from
/// `max_window_layers` on (28 when absent); Gemma 2 alternates windowed and full layers,
/// Gemma 3 has one full layer in `sliding_window_pattern` (6), OLMo 3 one in four; SmolLM3
/// windows its NoPE layers with `use_sliding_window`. `layer_types`, when present, says which
/// layers are windowed.
fn sliding_windows(f: &Fields<'_>, architecture: Architecture, layers: i64) -> Result<Vec<Option<i64>>> {
    use Architecture as A;
    let absent = match architecture {
        A::Mistral | A::Qwen2 | A::Qwen3 | A::Qwen3Moe | A::Gemma2 | A::Gemma3 | A::Olmo3 => Some(4096),
        _ => None,
    };
    let configured = if f.0.contains_key("sliding_window") { f.int("sliding_window")? } else { absent };
    if let Some(w) = configured {
        positive("sliding_window", w)?;
    }
    let use_sliding_window = f.bool("use_sliding_window")?.unwrap_or(false);
    let window = match architecture {
        A::Llama | A::Olmo2 | A::Glm4 | A::Granite => None,
        A::Mistral | A::Mixtral | A::Phi3 | A::Gemma2 | A::Gemma3 | A::Olmo3 => configured,
        A::Qwen2 | A::Qwen3 | A::Qwen3Moe | A::SmolLm3 => configured.filter(|_| use_sliding_window),
    };
    if let Some(types) = f.get("layer_types") {
        let types = types.as_array().ok_or_else(|| Error::invalid("layer_types", "must be a list"))?;
        if types.len() as i64 != layers {
            return Err(Error::invalid("layer_types", format!("has {} entries for {layers} layers", types.len())));
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok(None),
                // SmolLM3 names its NoPE layers sliding even when no window is in use.
                Some("sliding_attention") if architecture == A::SmolLm3 => Ok(window),
                Some("sliding_attention") => window.map(Some).ok_or_else(|| {
                    Error::invalid("layer_types", "has sliding_attention but no sliding window is in effect")
                }),
                _ => {
                    Err(Error::unsupported("layer_types", t, "only full_attention and sliding_attention are supported"))
                }
            })
            .collect();
    }
    let windowed = |i: i64| -> Result<bool> {
        Ok(match architecture {
            A::Qwen2 | A::Qwen3 | A::Qwen3Moe => i >= f.int("max_window_layers")?.unwrap_or(28),
            A::Gemma2 => i % 2 == 0,
            A::Gemma3 => {
                (i + 1) % positive("sliding_window_pattern", f.int("sliding_window_pattern")?.unwrap_or(6))? != 0
            }
            A::Olmo3 => (i + 1) % 4 != 0,
            A::SmolLm3 => nope_layers(f, architecture, layers)?[i as usize],
            _ => true,
        })
    };
    (0..layers).map(|i| Ok(if windowed(i)? { window } else { None })).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base(arch: &str) -> Value {
        json!({
            "architectures": [arch], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 100, "rms_norm_eps": 1e-6,
        })
    }

    #[test]
    fn unknown_architecture_is_named() {
        let err = ModelConfig::from_json(base("GPT2LMHeadModel")).unwrap_err();
        assert!(err.to_string().contains("GPT2LMHeadModel"), "{err}");
    }

    #[test]
    fn per_architecture_defaults() {
        let qwen3 = ModelConfig::from_json(base("Qwen3ForCausalLM")).unwrap();
        assert_eq!(qwen3.head_dim, 128);
        assert_eq!(qwen3.qk_norm, QkNorm::PerHead);
        let qwen2 = ModelConfig::from_json(base("Qwen2ForCausalLM")).unwrap();
        assert!(qwen2.qkv_bias && !qwen2.o_bias);
        assert_eq!(qwen2.head_dim, 16);
    }

    #[test]
    fn v4_and_v5_rope_layouts_agree() {
        let mut v4 = base("LlamaForCausalLM");
        v4["rope_theta"] = json!(500000.0);
        v4["rope_scaling"] = json!({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
        let mut v5 = base("LlamaForCausalLM");
        v5["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
        let (a, b) = (ModelConfig::from_json(v4).unwrap(), ModelConfig::from_json(v5).unwrap());
        assert_eq!(a.rope, b.rope);
        assert!(matches!(a.rope.scaling, RopeScaling::Llama3 { .. }));
    }

    #[test]
    fn unsupported_values_name_the_field() {
        let mut c = base("LlamaForCausalLM");
        c["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        let err = ModelConfig::from_json(c).unwrap_err().to_string();
        assert!(err.contains("rope_scaling.rope_type") && err.contains("yarn"), "{err}");

        let mut c = base("LlamaForCausalLM");
        c["hidden_act"] = json!("gelu");
        assert!(ModelConfig::from_json(c).unwrap_err().to_string().contains("hidden_act"));

        let mut c = base("LlamaForCausalLM");
        c["num_key_value_heads"] = json!(3);
        assert!(ModelConfig::from_json(c).unwrap_err().to_string().contains("num_key_value_heads"));

        let mut c = base("LlamaForCausalLM");
        c["hidden_size"] = json!("big");
        assert!(ModelConfig::from_json(c).unwrap_err().to_string().contains("hidden_size"));
    }

    #[test]
    fn sliding_windows_follow_transformers() {
        let mut c = base("MistralForCausalLM");
        c["sliding_window"] = json!(8);
        assert_eq!(ModelConfig::from_json(c).unwrap().sliding_windows, vec![Some(8), Some(8)]);
        let mut c = base("MistralForCausalLM");
        c["sliding_window"] = Value::Null;
        assert_eq!(ModelConfig::from_json(c).unwrap().sliding_windows, vec![None, None]);
        // Qwen: the window applies only with use_sliding_window, from max_window_layers on.
        let mut c = base("Qwen2ForCausalLM");
        c["sliding_window"] = json!(8);
        assert_eq!(ModelConfig::from_json(c.clone()).unwrap().sliding_windows, vec![None, None]);
        c["use_sliding_window"] = json!(true);
        c["max_window_layers"] = json!(1);
        assert_eq!(ModelConfig::from_json(c.clone()).unwrap().sliding_windows, vec![None, Some(8)]);
        c["layer_types"] = json!(["sliding_attention", "full_attention"]);
        assert_eq!(ModelConfig::from_json(c.clone()).unwrap().sliding_windows, vec![Some(8), None]);
        c["use_sliding_window"] = json!(false);
        let err = ModelConfig::from_json(c).unwrap_err().to_string();
        assert!(err.contains("layer_types") && err.contains("no sliding window"), "{err}");
    }

    #[test]
    fn mixtures_of_experts_follow_transformers() {
        let mut c = base("Qwen3MoeForCausalLM");
        c["num_hidden_layers"] = json!(4);
        c["num_experts"] = json!(6);
        c["decoder_sparse_step"] = json!(2);
        c["mlp_only_layers"] = json!([3]);
        c["num_experts_per_tok"] = json!(2);
        let qwen = ModelConfig::from_json(c.clone()).unwrap();
        let moe = qwen.moe.clone().unwrap();
        // Layers 1 and 3 by the step, 3 dense by the list; defaults from Qwen3MoeConfig.
        assert_eq!(moe.sparse_layers, vec![false, true, false, false]);
        assert_eq!((moe.experts, moe.experts_per_token, moe.expert_intermediate_size), (6, 2, 768));
        assert!(!moe.normalize_top_k && !moe.output_router_logits);
        assert_eq!(qwen.head_dim, 16, "Qwen3-MoE's head_dim defaults to hidden / heads");
        assert_eq!(qwen.mlp_parameters(0), 3 * 64 * 128);
        assert_eq!(qwen.mlp_parameters(1), 6 * (3 * 64 * 768 + 64));
        // transformers 5 writes `num_local_experts`.
        c["num_experts"] = Value::Null;
        c["num_local_experts"] = json!(4);
        assert_eq!(ModelConfig::from_json(c.clone()).unwrap().moe.unwrap().experts, 4);
        c["num_experts_per_tok"] = json!(5);
        let err = ModelConfig::from_json(c).unwrap_err().to_string();
        assert!(err.contains("num_experts_per_tok"), "{err}");

        let mut c = base("MixtralForCausalLM");
        let mixtral = ModelConfig::from_json(c.clone()).unwrap();
        let moe = mixtral.moe.unwrap();
        assert_eq!((moe.experts, moe.experts_per_token, moe.expert_intermediate_size), (8, 2, 128));
        assert!(moe.normalize_top_k && moe.sparse_layers.iter().all(|s| *s));
        assert_eq!(mixtral.sliding_windows, vec![None, None], "no window unless the config sets one");
        c["router_jitter_noise"] = json!(0.1);
        let err = ModelConfig::from_json(c).unwrap_err().to_string();
        assert!(err.contains("router_jitter_noise"), "{err}");
        assert!(ModelConfig::from_json(base("Qwen3ForCausalLM")).unwrap().moe.is_none());
    }
}
