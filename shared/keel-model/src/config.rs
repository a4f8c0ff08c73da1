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
}

impl Architecture {
    pub const ALL: [Self; 6] = [Self::Llama, Self::Qwen2, Self::Qwen3, Self::Mistral, Self::Qwen3Moe, Self::Mixtral];

    /// The class name in `config.json`'s `architectures`.
    pub fn hf_class(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen3Moe => "Qwen3MoeForCausalLM",
            Self::Mixtral => "MixtralForCausalLM",
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
        }
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

    /// Accepts the short name (`llama`) or the HF class (`LlamaForCausalLM`).
    fn from_str(s: &str) -> Result<Self> {
        Self::from_model_type(s).or_else(|_| Self::from_hf_class(s)).map_err(|_| {
            Error::InvalidInput(format!(
                "unknown architecture `{s}` (use llama, qwen2, qwen3, mistral, qwen3_moe or mixtral)"
            ))
        })
    }
}

/// How rotary frequencies are scaled.
#[derive(Debug, Clone, Copy, PartialEq)]
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
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: RopeScaling,
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
    pub rope: RopeConfig,
    pub max_position_embeddings: i64,
    pub tie_word_embeddings: bool,
    /// Bias on q, k and v projections.
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// Bias on gate, up and down projections.
    pub mlp_bias: bool,
    /// RMSNorm on q and k per head (Qwen3).
    pub qk_norm: bool,
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
        if let Some(act) = f.str("hidden_act")?.filter(|act| *act != "silu") {
            return Err(Error::unsupported("hidden_act", act, "only silu is implemented"));
        }
        if let Some(q) = f.get("quantization_config") {
            return Err(Error::unsupported("quantization_config", q, "quantized checkpoints are not supported"));
        }
        if let Some(tp) = f.int("pretraining_tp")?.filter(|tp| *tp != 1) {
            return Err(Error::unsupported("pretraining_tp", tp, "only 1 is supported"));
        }

        let hidden_size = positive("hidden_size", f.req_int("hidden_size")?)?;
        let num_attention_heads = positive("num_attention_heads", f.req_int("num_attention_heads")?)?;
        let default_kv_heads = match architecture {
            Architecture::Llama => num_attention_heads,
            Architecture::Mistral | Architecture::Mixtral => 8,
            Architecture::Qwen2 | Architecture::Qwen3 => 32,
            Architecture::Qwen3Moe => 4,
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
            Architecture::Qwen3 => 128,
            _ => hidden_size / num_attention_heads,
        };
        let head_dim = positive("head_dim", f.int("head_dim")?.unwrap_or(default_head_dim))?;
        if head_dim % 2 != 0 {
            return Err(Error::invalid("head_dim", format!("must be even for rotary embeddings, found {head_dim}")));
        }
        let num_hidden_layers = positive("num_hidden_layers", f.req_int("num_hidden_layers")?)?;
        let rms_norm_eps = f.float("rms_norm_eps")?.unwrap_or(1e-6);
        if rms_norm_eps <= 0.0 {
            return Err(Error::invalid("rms_norm_eps", format!("must be positive, found {rms_norm_eps}")));
        }

        let attention_bias = f.bool("attention_bias")?.unwrap_or(false);
        let (qkv_bias, o_bias, mlp_bias, qk_norm) = match architecture {
            Architecture::Llama => (attention_bias, attention_bias, f.bool("mlp_bias")?.unwrap_or(false), false),
            Architecture::Qwen2 => (true, false, false, false),
            Architecture::Qwen3 | Architecture::Qwen3Moe => (attention_bias, attention_bias, false, true),
            Architecture::Mistral | Architecture::Mixtral => (false, false, false, false),
        };

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
            Architecture::Qwen3Moe => f.int("intermediate_size")?.unwrap_or(6144),
            _ => f.req_int("intermediate_size")?,
        };
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
            rope: rope_config(&f)?,
            max_position_embeddings: positive(
                "max_position_embeddings",
                f.int("max_position_embeddings")?.unwrap_or(match architecture {
                    Architecture::Llama => 2048,
                    Architecture::Mistral | Architecture::Mixtral => 131_072,
                    Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => 32_768,
                }),
            )?,
            tie_word_embeddings: f.bool("tie_word_embeddings")?.unwrap_or(false),
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm,
            sliding_windows,
            bos_token_id: f.ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.ids("eos_token_id")?,
            pad_token_id: f.ids("pad_token_id")?.first().copied(),
            dtype,
            moe,
            raw,
        })
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

fn rope_config(f: &Fields<'_>) -> Result<RopeConfig> {
    // v5 keeps everything in `rope_parameters`; v4 has `rope_theta` and `rope_scaling`.
    let (params_key, params) = match (f.get("rope_parameters"), f.get("rope_scaling")) {
        (Some(p), _) => ("rope_parameters", Some(p)),
        (None, Some(s)) => ("rope_scaling", Some(s)),
        (None, None) => ("rope_scaling", None),
    };
    let empty = Map::new();
    let params = match params {
        Some(Value::Object(map)) => map,
        Some(other) => return Err(Error::invalid(params_key, format!("must be an object, found {other}"))),
        None => &empty,
    };
    let p = Fields(params);
    let theta = p.float("rope_theta")?.or(f.float("rope_theta")?).unwrap_or(10_000.0);
    if theta <= 0.0 {
        return Err(Error::invalid("rope_theta", format!("must be positive, found {theta}")));
    }
    let rope_type = p.str("rope_type")?.or(p.str("type")?).unwrap_or("default");
    let field = |name: &str| format!("{params_key}.{name}");
    let factor = || -> Result<f64> {
        let factor = p.float("factor")?.ok_or_else(|| Error::invalid(&field("factor"), "is missing"))?;
        if factor < 1.0 {
            return Err(Error::invalid(&field("factor"), format!("must be at least 1, found {factor}")));
        }
        Ok(factor)
    };
    let scaling = match rope_type {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "llama3" => {
            let low_freq_factor =
                p.float("low_freq_factor")?.ok_or_else(|| Error::invalid(&field("low_freq_factor"), "is missing"))?;
            let high_freq_factor =
                p.float("high_freq_factor")?.ok_or_else(|| Error::invalid(&field("high_freq_factor"), "is missing"))?;
            if high_freq_factor <= low_freq_factor {
                return Err(Error::invalid(&field("high_freq_factor"), "must be greater than low_freq_factor"));
            }
            RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: positive(
                    &field("original_max_position_embeddings"),
                    p.req_int("original_max_position_embeddings")
                        .map_err(|_| Error::invalid(&field("original_max_position_embeddings"), "is missing"))?,
                )?,
            }
        }
        other => {
            return Err(Error::unsupported(
                &field("rope_type"),
                other,
                "supported rope types are default, linear and llama3",
            ));
        }
    };
    Ok(RopeConfig { theta, scaling })
}

/// The attention window of each layer, as transformers derives it: Mistral uses
/// `sliding_window` (4096 when the key is absent, none when null) on every layer; Qwen2/Qwen3
/// use it only with `use_sliding_window`, on layers from `max_window_layers` on (28 when
/// absent); `layer_types`, when present, says which layers are windowed.
fn sliding_windows(f: &Fields<'_>, architecture: Architecture, layers: i64) -> Result<Vec<Option<i64>>> {
    // 4096 when the key is absent, except for Mixtral (none).
    let absent = if architecture == Architecture::Mixtral { None } else { Some(4096) };
    let configured = if f.0.contains_key("sliding_window") { f.int("sliding_window")? } else { absent };
    if let Some(w) = configured {
        positive("sliding_window", w)?;
    }
    let use_sliding_window = f.bool("use_sliding_window")?.unwrap_or(false);
    let window = match architecture {
        Architecture::Llama => None,
        Architecture::Mistral | Architecture::Mixtral => configured,
        Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => configured.filter(|_| use_sliding_window),
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
                Some("sliding_attention") => window.map(Some).ok_or_else(|| {
                    Error::invalid("layer_types", "has sliding_attention but no sliding window is in effect")
                }),
                _ => {
                    Err(Error::unsupported("layer_types", t, "only full_attention and sliding_attention are supported"))
                }
            })
            .collect();
    }
    let first_windowed = match architecture {
        Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => f.int("max_window_layers")?.unwrap_or(28),
        _ => 0,
    };
    Ok((0..layers).map(|i| window.filter(|_| i >= first_windowed)).collect())
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
        assert!(qwen3.qk_norm);
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
