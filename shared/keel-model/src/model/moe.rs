//! Mixtures of experts (Qwen3-MoE, Mixtral): the sparse MLP block and the router's
//! load-balancing loss, both as transformers computes them.
//!
//! Tokens are grouped per expert: the router's choices are sorted by expert, and each expert
//! runs once over its tokens (a gather, the expert's SwiGLU MLP, a weighted scatter-add),
//! which is what the CPU and a GPU without grouped-GEMM kernels do best. Every expert is held
//! on every rank; under tensor parallelism each rank holds its slice of every expert's MLP
//! (split as a dense MLP is) and the router whole. Expert parallelism (whole experts on
//! different GPUs, tokens sent to them with all-to-all) is described in ARCHITECTURE.md.

use tch::{Device, Kind, Tensor};

use super::{Mlp, Params};
use crate::config::{ModelConfig, MoeConfig};
use crate::cuda::Kernels;
use crate::error::Result;

/// A mixture of experts ([`crate::config::MoeConfig`]): the router picks each token's
/// experts, and each expert runs once over the tokens routed to it (grouped, not per token).
/// On a tensor-parallel rank every expert is this rank's slice of it, as a dense MLP is.
#[derive(Debug)]
pub(crate) struct Experts {
    /// The router's weight [experts, hidden] (HF `gate.weight`).
    pub(crate) router: Tensor,
    pub(crate) experts: Vec<Mlp>,
    top_k: i64,
    normalize: bool,
}

impl Experts {
    pub(super) fn new(p: &Params<'_>, cfg: &ModelConfig, moe: &MoeConfig) -> Result<Self> {
        let (_, names) = MoeConfig::names(cfg.architecture);
        let h = cfg.hidden_size;
        let experts = p.sub("experts");
        Ok(Self {
            router: p.sub("gate").weight("weight", &[moe.experts, h])?,
            experts: (0..moe.experts)
                .map(|e| Mlp::new(&experts.sub(e), cfg, moe.expert_intermediate_size, false, names))
                .collect::<Result<_>>()?,
            top_k: moe.experts_per_token,
            normalize: moe.normalize_top_k,
        })
    }

    pub(crate) fn with(router: Tensor, experts: Vec<Mlp>, moe: &MoeConfig) -> Self {
        Self { router, experts, top_k: moe.experts_per_token, normalize: moe.normalize_top_k }
    }

    /// The block over `x` [.., hidden]; the router's logits [tokens, experts] go to `routers`
    /// when given (training collects them for the load-balancing loss).
    pub(super) fn forward(&self, x: &Tensor, kernels: Option<&Kernels>, routers: Option<&Routers>) -> Result<Tensor> {
        let shape = x.size();
        let hidden = shape[shape.len() - 1];
        let flat = x.f_reshape([-1, hidden])?;
        let logits = flat.f_linear::<Tensor>(&self.router, None)?;
        if let Some(routers) = routers {
            // On a tensor-parallel rank the loss's backward runs before the segments' (see
            // `tp`): the load-balancing loss then needs a graph of its own.
            let kept =
                if routers.own_graph { flat.f_linear::<Tensor>(&self.router, None)? } else { logits.shallow_clone() };
            routers.push(kept);
        }
        let probs = logits.f_softmax(-1, Kind::Float)?;
        let (weights, chosen) = probs.f_topk(self.top_k, -1, true, true)?;
        let weights = if self.normalize {
            weights.f_div(&weights.f_sum_dim_intlist(&[-1][..], true, Kind::Float)?)?
        } else {
            weights
        };
        // The (token, choice) slots sorted by expert: each expert's tokens are one run.
        let chosen = chosen.f_flatten(0, -1)?;
        let order = chosen.f_argsort_stable(true, 0, false)?;
        let counts = Vec::<i64>::try_from(
            chosen.f_bincount(None::<&Tensor>, self.experts.len() as i64)?.f_to_device(Device::Cpu)?,
        )?;
        let tokens = order.f_div_scalar_mode(self.top_k, "floor")?;
        let slot_weights = weights.f_flatten(0, -1)?.f_index_select(0, &order)?.f_to_kind(x.kind())?;
        let mut out = flat.f_zeros_like()?;
        let mut start = 0;
        for (expert, &count) in self.experts.iter().zip(&counts) {
            if count == 0 {
                continue;
            }
            let rows = tokens.f_narrow(0, start, count)?;
            let weight = slot_weights.f_narrow(0, start, count)?.f_unsqueeze(-1)?;
            let y = expert.forward(&flat.f_index_select(0, &rows)?, kernels)?.f_mul(&weight)?;
            let _ = out.f_index_add_(0, &rows, &y)?;
            start += count;
        }
        Ok(out.f_reshape(shape.as_slice())?)
    }
}

/// The router logits of a training pass's MoE layers, in layer order.
#[derive(Debug)]
pub(crate) struct Routers {
    logits: std::cell::RefCell<Vec<Tensor>>,
    /// Whether the logits kept are computed apart from those the block uses.
    own_graph: bool,
}

impl Routers {
    /// Router logits of a pass whose whole graph one backward call runs through.
    pub(crate) fn shared() -> Self {
        Self { logits: Default::default(), own_graph: false }
    }

    /// Router logits with a graph of their own (a tensor-parallel rank's taped pass, whose
    /// segments are run backward after the loss).
    pub(crate) fn own_graph() -> Self {
        Self { logits: Default::default(), own_graph: true }
    }

    fn push(&self, logits: Tensor) {
        self.logits.borrow_mut().push(logits);
    }

    /// transformers' `load_balancing_loss_func` over this pass's router logits: with
    /// `p` the softmax of a token's logits and `f_j` the share of (token, choice) slots that
    /// chose expert j among its top k, `experts · Σ_j mean(f_j) · mean(p_j)`, the means over
    /// the real tokens of every MoE layer (`padding` [B, S] marks the rest; `None`: all are
    /// real). `None` when the pass had no MoE layer.
    pub(crate) fn load_balancing_loss(self, moe: &MoeConfig, padding: Option<&Tensor>) -> Result<Option<Tensor>> {
        let logits = self.logits.into_inner();
        if logits.is_empty() {
            return Ok(None);
        }
        let layers = logits.len() as i64;
        let all = Tensor::f_cat(&logits, 0)?;
        let probs = all.f_softmax(-1, Kind::Float)?;
        let (_, chosen) = probs.f_topk(moe.experts_per_token, -1, true, true)?;
        let picked = chosen.f_one_hot(moe.experts)?.f_to_kind(Kind::Float)?;
        let keep = match padding {
            Some(padding) => padding.f_logical_not()?.f_flatten(0, -1)?.f_to_kind(Kind::Float)?.f_repeat([layers])?,
            None => Tensor::f_ones([all.size()[0]], (Kind::Float, all.device()))?,
        };
        let real = keep.f_sum(Kind::Float)?;
        let tokens_per_expert =
            picked.f_mul(&keep.f_view([-1, 1, 1])?)?.f_sum_dim_intlist(&[0][..], false, Kind::Float)?.f_div(&real)?;
        let prob_per_expert =
            probs.f_mul(&keep.f_view([-1, 1])?)?.f_sum_dim_intlist(&[0][..], false, Kind::Float)?.f_div(&real)?;
        let loss = tokens_per_expert.f_mul(&prob_per_expert.f_unsqueeze(0)?)?.f_sum(Kind::Float)?;
        Ok(Some(loss.f_mul_scalar(moe.experts as f64)?))
    }
}
