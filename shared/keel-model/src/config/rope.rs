//! Rotary embeddings in `config.json`: the v4 layout (`rope_theta`, `rope_scaling`, Gemma 3's
//! `rope_local_base_freq`) and v5 (`rope_parameters`, one object per layer type for Gemma 3
//! and OLMo 3), partial and interleaved rotation, LongRoPE, and SmolLM3's NoPE layers.

use serde_json::{Map, Value};

use super::{Architecture, Fields, finite_positive, positive};
use crate::error::{Error, Result};

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

/// The rotary embeddings of full-attention and (where they differ) sliding-window layers.
pub(super) struct Ropes {
    pub(super) full: RopeConfig,
    pub(super) local: Option<RopeConfig>,
}

impl Ropes {
    /// Reads both layouts transformers writes: v4 (`rope_theta`, `rope_scaling`, Gemma 3's
    /// `rope_local_base_freq`) and v5 (`rope_parameters`, for Gemma 3 and OLMo 3 one object per
    /// layer type).
    pub(super) fn parse(f: &Fields<'_>, architecture: Architecture, head_dim: i64, max_positions: i64) -> Result<Self> {
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
pub(super) fn nope_layers(f: &Fields<'_>, architecture: Architecture, layers: i64) -> Result<Vec<bool>> {
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
