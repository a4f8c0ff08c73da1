//! Mixtures of experts in `config.json`: Qwen3-MoE's and Mixtral's blocks.

use serde_json::Value;

use super::{Architecture, Fields, positive};
use crate::error::{Error, Result};

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

    pub(super) fn parse(f: &Fields<'_>, architecture: Architecture, layers: i64) -> Result<Option<Self>> {
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
