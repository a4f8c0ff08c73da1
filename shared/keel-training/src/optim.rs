//! AdamW as `torch.optim.AdamW` computes it (decoupled weight decay, bias-corrected moments),
//! with f32 master weights: when the model computes in bf16 or f16, the optimiser keeps an
//! f32 copy of every parameter, updates it, and copies it back. Weight decay skips norms and
//! biases (every tensor of rank ≤ 1). Global gradient-norm clipping comes first.
//!
//! Under tensor parallelism each rank's optimiser holds that rank's slices (AdamW is
//! element-wise, so slices step exactly as the whole tensor would); the gradient norm adds
//! up the squared slices over the ranks and counts replicated tensors once.
//!
//! Under data parallelism the state is sharded (ZeRO stage 1, [`AdamW::shard`]): every rank
//! has the whole summed gradient, but each parameter is stepped by one rank, its owner, which
//! alone keeps its moments (and master copy) and then sends the new values to the others.

use std::collections::BTreeMap;

use keel_collective::{Collective, ReduceOp, SharedComm};
use keel_model::model::Layout;
use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use keel_protocol::training::OptimizerConfig;

#[derive(Debug)]
struct Slot {
    name: String,
    /// The model's parameter (its gradient is read, its value overwritten after the step).
    param: Tensor,
    /// The f32 master copy when the parameter is not f32.
    master: Option<Tensor>,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    decay: bool,
    /// How the parameter is spread over tensor-parallel ranks (`Replicated` on a whole model).
    layout: Layout,
}

#[derive(Debug)]
pub struct AdamW {
    config: OptimizerConfig,
    slots: Vec<Slot>,
    /// Optimiser steps taken.
    step: u64,
    /// Under data parallelism: the group, and the rank that owns each slot.
    shard: Option<Shard>,
}

#[derive(Debug)]
struct Shard {
    comm: SharedComm,
    owner: Vec<usize>,
}

impl AdamW {
    /// Builds the optimiser over named parameters. `masters` holds f32 values for parameters
    /// whose own kind is not f32 (taken before they were cast), by name.
    pub fn new(
        config: OptimizerConfig,
        params: Vec<(String, Tensor, Layout)>,
        mut masters: BTreeMap<String, Tensor>,
    ) -> Result<Self> {
        let slots = params
            .into_iter()
            .map(|(name, param, layout)| {
                let master = match (param.kind(), masters.remove(&name)) {
                    (Kind::Float, _) => None,
                    (_, Some(master)) => Some(master),
                    (_, None) => Some(param.f_detach()?.f_to_kind(Kind::Float)?),
                };
                let zeros = || Tensor::f_zeros(param.size(), (Kind::Float, param.device()));
                let (exp_avg, exp_avg_sq) = (zeros()?, zeros()?);
                Ok(Slot { decay: param.dim() > 1, exp_avg, exp_avg_sq, name, param, master, layout })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { config, slots, step: 0, shard: None })
    }

    /// The optimiser over `params` of `model`, which then computes in `kind`: a parameter
    /// that is then not f32 keeps an f32 master copy, taken before the cast.
    pub fn for_parameters(
        config: OptimizerConfig,
        model: &mut keel_model::CausalLm,
        params: Vec<(String, Tensor, Layout)>,
        kind: Kind,
    ) -> Result<Self> {
        let masters: BTreeMap<String, Tensor> = if kind == Kind::Float {
            BTreeMap::new()
        } else {
            params.iter().map(|(n, p, _)| Ok((n.clone(), p.f_detach()?.copy()))).collect::<Result<_>>()?
        };
        model.set_kind(kind)?;
        Self::new(config, params, masters)
    }

    /// Adds `param` (f32, whole on every rank), before [`AdamW::shard`].
    pub fn add(&mut self, name: &str, param: &Tensor) -> Result<()> {
        if self.shard.is_some() {
            return Err(Error::Internal(format!("`{name}` added to an optimiser already sharded")));
        }
        let mut added = Self::new(
            self.config.clone(),
            vec![(name.to_string(), param.shallow_clone(), Layout::Replicated)],
            BTreeMap::new(),
        )?;
        self.slots.append(&mut added.slots);
        Ok(())
    }

    /// The tensors it trains, in its order.
    pub fn parameters(&self) -> Vec<Tensor> {
        self.slots.iter().map(|s| s.param.shallow_clone()).collect()
    }

    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// Shards the state over the data-parallel group `comm` (ZeRO stage 1): from now on this
    /// rank keeps moments and master copies only of the parameters it owns
    /// ([`crate::dp::owners`]) and steps only those; [`AdamW::step`] then sends every
    /// parameter's new value from its owner to the others. Every rank of the group calls it.
    pub fn shard(&mut self, comm: SharedComm) -> Result<()> {
        let sizes: Vec<i64> = self.slots.iter().map(|s| s.param.numel() as i64).collect();
        let owner = crate::dp::owners(&sizes, comm.world_size());
        for (slot, &owner) in self.slots.iter_mut().zip(&owner) {
            if owner != comm.rank() {
                let empty = || Tensor::f_zeros([0], (Kind::Float, slot.param.device()));
                slot.exp_avg = empty()?;
                slot.exp_avg_sq = empty()?;
                slot.master = None;
            }
        }
        self.shard = Some(Shard { comm, owner });
        Ok(())
    }

    /// Whether this rank steps slot `index` (every slot without data parallelism).
    fn owns(&self, index: usize) -> bool {
        self.shard.as_ref().is_none_or(|s| s.owner[index] == s.comm.rank())
    }

    /// Under data parallelism, every parameter's value from its owner on every rank.
    pub fn broadcast_parameters(&self) -> Result<()> {
        let Some(shard) = &self.shard else { return Ok(()) };
        let _guard = tch::no_grad_guard();
        for (slot, &owner) in self.slots.iter().zip(&shard.owner) {
            let mut value = slot.param.shallow_clone();
            shard.comm.broadcast(&mut value, owner)?;
        }
        Ok(())
    }

    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Moves the optimiser's state (both moments and the f32 master copies) to `device` in
    /// place: host memory while a colocated generator has the GPU. Returns the bytes moved.
    pub fn move_state(&self, device: tch::Device) -> Result<u64> {
        let state = self.slots.iter().flat_map(|s| [Some(&s.exp_avg), Some(&s.exp_avg_sq), s.master.as_ref()]);
        Ok(keel_model::device::move_in_place(state.flatten(), device)?)
    }

    pub fn zero_grad(&mut self) {
        for slot in &mut self.slots {
            slot.param.zero_grad();
        }
    }

    /// The global L2 norm of all gradients (over every rank's slices when `comm` is given);
    /// when above `max_norm`, every gradient is scaled by max_norm / (norm + 1e-6) (as
    /// torch's `clip_grad_norm_`). Returns the norm before.
    pub fn clip_grad_norm(&mut self, max_norm: Option<f64>, comm: Option<&SharedComm>) -> Result<f64> {
        let (mut replicated, mut split) = (0.0, 0.0);
        for slot in &self.slots {
            let grad = slot.param.grad();
            if grad.defined() {
                let squares = grad.f_to_kind(Kind::Double)?.f_square()?.f_sum(Kind::Double)?.f_double_value(&[])?;
                match slot.layout.weight_in_sum() {
                    Some(weight) => split += weight * squares,
                    None => replicated += squares,
                }
            }
        }
        if let Some(comm) = comm {
            // On the parameters' device: NCCL reduces GPU tensors only.
            let device = self.slots.first().map_or(tch::Device::Cpu, |s| s.param.device());
            let mut sum = Tensor::from_slice(&[split]).f_to_device(device)?;
            comm.all_reduce(&mut sum, ReduceOp::Sum)?;
            split = sum.f_double_value(&[0])?;
        }
        let norm = (replicated + split).sqrt();
        if !norm.is_finite() {
            return Err(Error::NonFinite(format!("gradient norm is {norm}; the step was skipped")));
        }
        if let Some(max) = max_norm {
            let factor = max / (norm + 1e-6);
            if factor < 1.0 {
                for slot in &self.slots {
                    let mut grad = slot.param.grad();
                    if grad.defined() {
                        let _ = grad.f_mul_scalar_(factor)?;
                    }
                }
            }
        }
        Ok(norm)
    }

    /// One AdamW step at learning rate `lr`.
    pub fn step(&mut self, lr: f64) -> Result<()> {
        let _guard = tch::no_grad_guard();
        self.step += 1;
        let [beta1, beta2] = self.config.betas;
        let bias1 = 1.0 - beta1.powi(self.step as i32);
        let bias2_sqrt = (1.0 - beta2.powi(self.step as i32)).sqrt();
        for index in 0..self.slots.len() {
            if !self.owns(index) {
                continue;
            }
            let slot = &mut self.slots[index];
            let grad = slot.param.grad();
            if !grad.defined() {
                continue;
            }
            let grad = grad.f_to_kind(Kind::Float)?;
            let mut value = slot.master.as_ref().map_or_else(|| slot.param.shallow_clone(), Tensor::shallow_clone);
            if slot.decay && self.config.weight_decay != 0.0 {
                let _ = value.f_mul_scalar_(1.0 - lr * self.config.weight_decay)?;
            }
            let _ = slot.exp_avg.f_lerp_(&grad, 1.0 - beta1)?;
            let _ = slot.exp_avg_sq.f_mul_scalar_(beta2)?;
            let _ = slot.exp_avg_sq.f_addcmul_(&grad, &grad.f_mul_scalar(1.0 - beta2)?)?;
            let denom = slot.exp_avg_sq.f_sqrt()?.f_div_scalar(bias2_sqrt)?.f_add_scalar(self.config.eps)?;
            let _ = value.f_addcdiv_(&slot.exp_avg.f_mul_scalar(-lr / bias1)?, &denom)?;
            if slot.master.is_some() {
                slot.param.f_copy_(&value)?;
            }
        }
        self.broadcast_parameters()
    }

    /// Optimiser state as named tensors (`exp_avg.<param>`, `exp_avg_sq.<param>`,
    /// `master.<param>`), sorted by name, each with its parameter's layout across
    /// tensor-parallel ranks (a rank holds its slice; the checkpoint holds the whole).
    pub fn state(&self) -> Vec<(String, Tensor, Layout)> {
        let mut tensors = Vec::new();
        for slot in &self.slots {
            let mut add = |prefix: &str, t: &Tensor| {
                tensors.push((format!("{prefix}.{}", slot.name), t.shallow_clone(), slot.layout));
            };
            add("exp_avg", &slot.exp_avg);
            add("exp_avg_sq", &slot.exp_avg_sq);
            if let Some(master) = &slot.master {
                add("master", master);
            }
        }
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        tensors
    }

    /// [`AdamW::state`] of every parameter under data parallelism too: each owner sends its
    /// parameters' state to every rank (every rank of the group calls it), for a checkpoint.
    pub fn gathered_state(&self) -> Result<Vec<(String, Tensor, Layout)>> {
        let Some(shard) = &self.shard else { return Ok(self.state()) };
        let mut tensors = Vec::new();
        for (index, slot) in self.slots.iter().enumerate() {
            let owner = shard.owner[index];
            let has_master = slot.param.kind() != Kind::Float;
            let own = [
                ("exp_avg", Some(&slot.exp_avg)),
                ("exp_avg_sq", Some(&slot.exp_avg_sq)),
                ("master", slot.master.as_ref()),
            ];
            for (prefix, mine) in own {
                if prefix == "master" && !has_master {
                    continue;
                }
                let mut tensor = match mine {
                    Some(t) if owner == shard.comm.rank() => t.copy(),
                    _ => Tensor::f_zeros(slot.param.size(), (Kind::Float, slot.param.device()))?,
                };
                shard.comm.broadcast(&mut tensor, owner)?;
                tensors.push((format!("{prefix}.{}", slot.name), tensor, slot.layout));
            }
        }
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(tensors)
    }

    /// Restores [`AdamW::state`] from whole tensors (a tensor-parallel rank takes its slice
    /// of each); every parameter's moments must be present with its shape.
    pub fn restore(&mut self, tensors: &BTreeMap<String, Tensor>, step: u64) -> Result<()> {
        let _guard = tch::no_grad_guard();
        let owned: Vec<bool> = (0..self.slots.len()).map(|i| self.owns(i)).collect();
        for (slot, owned) in self.slots.iter_mut().zip(owned) {
            // Under data parallelism a rank keeps the state of its own parameters only.
            if !owned {
                continue;
            }
            let targets = [
                ("exp_avg", Some(&mut slot.exp_avg)),
                ("exp_avg_sq", Some(&mut slot.exp_avg_sq)),
                ("master", slot.master.as_mut()),
            ];
            for (prefix, target) in targets {
                let Some(target) = target else { continue };
                let key = format!("{prefix}.{}", slot.name);
                let saved =
                    tensors.get(&key).ok_or_else(|| Error::Checkpoint(format!("optimizer state has no `{key}`")))?;
                let saved =
                    if saved.size() != target.size() { slot.layout.local(saved)? } else { saved.shallow_clone() };
                if saved.size() != target.size() {
                    return Err(Error::Checkpoint(format!(
                        "optimizer state `{key}` has shape {:?}, the parameter has {:?}",
                        saved.size(),
                        target.size()
                    )));
                }
                target.f_copy_(&saved)?;
            }
            if let Some(master) = &slot.master {
                slot.param.f_copy_(master)?;
            }
        }
        self.step = step;
        Ok(())
    }
}
