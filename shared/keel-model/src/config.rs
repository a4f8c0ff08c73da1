//! `config.json` of the supported Hugging Face architectures, parsed into one resolved
//! [`ModelConfig`].
//!
//! Both config layouts transformers writes are read: v4 (`rope_theta` + `rope_scaling`,
//! `torch_dtype`) and v5 (`rope_parameters`, `dtype`, `layer_types`). Per-architecture
//! defaults follow transformers' config classes. Anything the model code cannot honour is
//! refused with an error naming the field.
//!
//! Layout: this file holds the architectures, [`ModelConfig`] and the per-family defaults of
//! its shared fields and windows; [`block`] what a family changes in the decoder, [`rope`] the
//! rotary embeddings, [`moe`] the mixtures of experts.

use std::path::Path;

use serde_json::{Map, Value, json};

use crate::error::{Error, Result};

pub mod block;
pub mod moe;
pub mod rope;

pub use block::{Activation, Block, FusedWeight, NormWeight, Norms, QkNorm};
pub use moe::MoeConfig;
pub use rope::{RopeConfig, RopeScaling};
use rope::{Ropes, nope_layers};

/// The decoder-only architectures Keel runs. They share one implementation and differ in:
/// Qwen2 has biases on q/k/v; Qwen3 has RMSNorm on q and k per head (and an optional
/// `attention_bias`); Llama has optional `attention_bias`/`mlp_bias` and Llama 3 rope
/// scaling; Mistral uses a sliding attention window. Qwen3-MoE (Qwen3's attention) and
/// Mixtral (Mistral's) replace the MLP with a mixture of experts ([`MoeConfig`]). The newer
/// families' differences are their [`Block`], rotary embeddings and window patterns.
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
            .ok_or_else(|| Error::UnknownArchitecture { name: name.to_string(), supported: Self::hf_classes() })
    }

    fn from_model_type(name: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|arch| arch.model_type() == name).ok_or_else(|| Error::UnknownArchitecture {
            name: format!("model_type {name}"),
            supported: Self::hf_classes(),
        })
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
        // `pretraining_tp` (SmolLM3's files say 2) is read by transformers 5 and changes
        // nothing it computes; so it is here.
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

    /// Configs in the shape the Hub's files have (the fields that make each family what it
    /// is, as `config.json` writes them in v4 layout), resolved as transformers resolves them.
    #[test]
    fn hub_configs_of_the_new_families_resolve_as_transformers_reads_them() {
        let load = |extra: Value| {
            let mut c = json!({"hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 12,
                "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 262144});
            c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            ModelConfig::from_json(c).unwrap()
        };
        // gemma-3-1b-it: windows of 512, five local layers to one global, a local rotary base.
        let gemma = load(json!({"architectures": ["Gemma3ForCausalLM"], "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "rope_local_base_freq": 10000,
            "rope_scaling": null, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
            "final_logit_softcapping": null, "attn_logit_softcapping": null}));
        let windows: Vec<bool> = gemma.sliding_windows.iter().map(Option::is_some).collect();
        assert_eq!(windows, [true, true, true, true, true, false, true, true, true, true, true, false]);
        assert_eq!((gemma.rope.theta, gemma.local_rope.as_ref().map(|r| r.theta)), (1e6, Some(1e4)));
        assert_eq!(gemma.layer_rope(0).unwrap().theta, 1e4);
        assert_eq!(gemma.layer_rope(5).unwrap().theta, 1e6);
        assert!(gemma.tie_word_embeddings && gemma.block.final_softcap.is_none());
        assert_eq!(gemma.block.norm_weight, NormWeight::OffsetInF32);
        assert_eq!(gemma.block.embedding_multiplier, (1152f64).sqrt());
        // Phi-4-mini: 3/4 of 128-dimension heads rotate, LongRoPE to 131072 from 4096.
        let phi = load(json!({"architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "num_attention_heads": 24,
            "num_key_value_heads": 8, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 4096,
            "max_position_embeddings": 131072, "sliding_window": 262144, "hidden_act": "silu", "resid_pdrop": 0.0,
            "rope_scaling": {"type": "longrope", "short_factor": vec![1.0; 48], "long_factor": vec![2.0; 48]}}));
        assert_eq!((phi.head_dim, phi.rope.rotary_dim), (128, 96));
        let RopeScaling::LongRope { attention_factor, original_max_position_embeddings, .. } = phi.rope.scaling else {
            panic!("{:?}", phi.rope.scaling)
        };
        let expected = (1.0 + (32f64).ln() / (4096f64).ln()).sqrt();
        assert!((attention_factor - expected).abs() < 1e-12 && original_max_position_embeddings == 4096);
        assert_eq!(phi.fused_weights().len(), 2 * 12);
        // GLM-4-0414: half of each head rotates, in pairs; biases on q/k/v only.
        let glm = load(json!({"architectures": ["Glm4ForCausalLM"], "head_dim": 128, "num_attention_heads": 32,
            "num_key_value_heads": 2, "hidden_size": 4096, "partial_rotary_factor": 0.5, "attention_bias": true,
            "rms_norm_eps": 1e-5, "eos_token_id": [151329, 151336, 151338]}));
        assert_eq!((glm.rope.rotary_dim, glm.rope.interleaved, glm.qkv_bias, glm.o_bias), (64, true, true, false));
        assert_eq!(glm.eos_token_ids.len(), 3);
        // granite-3.3-2b-instruct's multipliers.
        let granite = load(json!({"architectures": ["GraniteForCausalLM"], "attention_multiplier": 0.015625,
            "embedding_multiplier": 12.0, "logits_scaling": 8.0, "residual_multiplier": 0.22, "rope_theta": 10000000.0,
            "tie_word_embeddings": true}));
        let b = &granite.block;
        assert_eq!(
            (b.attention_scale, b.embedding_multiplier, b.logits_divisor, b.residual_multiplier),
            (Some(0.015625), 12.0, 8.0, 0.22)
        );
        // SmolLM3-3B: every fourth layer NoPE, and `pretraining_tp: 2` changes nothing.
        let smol = load(json!({"architectures": ["SmolLM3ForCausalLM"], "pretraining_tp": 2,
            "no_rope_layer_interval": 4, "use_sliding_window": false, "sliding_window": null,
            "rope_theta": 5000000.0}));
        let nope: Vec<usize> = (0..12).filter(|&l| smol.layer_rope(l).is_none()).collect();
        assert_eq!(nope, [3, 7, 11]);
        assert!(smol.sliding_windows.iter().all(Option::is_none) && smol.tie_word_embeddings);
        // OLMo-2-0425-1B: norms after each branch only, q/k norms over the projection, untied.
        let olmo = load(json!({"architectures": ["Olmo2ForCausalLM"], "rope_theta": 500000, "rms_norm_eps": 1e-6}));
        assert_eq!(
            (olmo.block.norms.pre_attention, olmo.qk_norm, olmo.tie_word_embeddings),
            (None, QkNorm::Projection, false)
        );
        // A field Keel cannot honour is refused by name.
        let mut bidirectional = json!({"architectures": ["Gemma3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100, "use_bidirectional_attention": true});
        let err = ModelConfig::from_json(bidirectional.clone()).unwrap_err().to_string();
        assert!(err.contains("use_bidirectional_attention"), "{err}");
        bidirectional["use_bidirectional_attention"] = json!(false);
        bidirectional["hidden_activation"] = json!("relu");
        assert!(ModelConfig::from_json(bidirectional).unwrap_err().to_string().contains("hidden_activation"));
    }
}
