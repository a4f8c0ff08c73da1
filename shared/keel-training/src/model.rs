//! The models an engine trains and scores with: the whole model (tensor_parallel_size 1) or
//! this rank's slices of it ([`keel_model::model::tp::TpCausalLm`]). The engine asks the
//! same of both; only tensor parallelism needs the extra backward pass, the gradient sums
//! of replicated KV heads and the gather before saving.

use std::path::Path;

use keel_collective::{Collective, SharedComm};
use keel_model::model::tp::{Layout, Tape, TpCausalLm};
use keel_model::packed::PackedRow;
use keel_model::{CausalLm, ModelConfig};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

#[derive(Debug)]
pub enum Model {
    Full(CausalLm),
    Sharded(TpCausalLm<SharedComm>),
}

/// What a training forward pass leaves for the backward pass after the loss's.
#[derive(Debug)]
pub enum Pending {
    Nothing,
    Sharded(Tape),
}

impl Model {
    /// Loads `dir` whole, or this rank's slices when `comm` is given.
    pub fn load(dir: &Path, device: Device, kind: Kind, comm: Option<SharedComm>) -> keel_model::Result<Self> {
        Ok(match comm {
            None => Self::Full(CausalLm::load(dir, device, kind)?),
            Some(comm) => Self::Sharded(TpCausalLm::load(dir, comm, device, kind)?),
        })
    }

    /// The whole model (`None` for a tensor-parallel rank's slices).
    pub fn whole(&self) -> Option<&CausalLm> {
        match self {
            Self::Full(m) => Some(m),
            Self::Sharded(_) => None,
        }
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            Self::Full(m) => m.config(),
            Self::Sharded(m) => m.config(),
        }
    }

    pub fn kind(&self) -> Kind {
        match self {
            Self::Full(m) => m.kind(),
            Self::Sharded(m) => m.kind(),
        }
    }

    pub fn device(&self) -> Device {
        match self {
            Self::Full(m) => m.device(),
            Self::Sharded(m) => m.device(),
        }
    }

    /// The communicator of a tensor-parallel rank.
    pub fn comm(&self) -> Option<&dyn Collective> {
        match self {
            Self::Full(_) => None,
            Self::Sharded(m) => Some(m.comm()),
        }
    }

    pub fn set_kind(&mut self, kind: Kind) -> keel_model::Result<()> {
        match self {
            Self::Full(m) => m.set_kind(kind),
            Self::Sharded(m) => m.set_kind(kind),
        }
    }

    /// Stops gradients to every parameter (a frozen reference).
    pub fn freeze(&mut self) -> Result<()> {
        match self {
            Self::Full(m) => m.freeze(),
            Self::Sharded(m) => m.set_trainable(false)?,
        }
        Ok(())
    }

    /// Adds LoRA adapters (the only trainable tensors once [`Model::freeze`] has frozen
    /// the base); whole models only.
    pub fn add_adapters(&mut self, lora: &keel_protocol::training::LoraConfig) -> Result<()> {
        match self {
            Self::Full(m) => Ok(m.add_adapters(lora)?),
            Self::Sharded(_) => {
                Err(Error::InvalidConfig("LoRA trains on one rank: tensor_parallel_size must be 1".into()))
            }
        }
    }

    /// Whether the model has LoRA adapters.
    pub fn has_adapters(&self) -> bool {
        self.whole().is_some_and(|m| m.lora().is_some())
    }

    /// What the optimiser trains: the LoRA adapters where there are some, else every
    /// parameter ([`Model::parameters`]).
    pub fn trainable_parameters(&self) -> Vec<(String, Tensor, Option<Layout>)> {
        match self {
            Self::Full(m) if m.lora().is_some() => m.adapter_tensors().into_iter().map(|(n, t)| (n, t, None)).collect(),
            _ => self.parameters(),
        }
    }

    /// Runs `f` on the base model, the adapters off (itself without adapters).
    pub fn with_base<R>(&self, f: impl FnOnce(&Self) -> R) -> R {
        match self {
            Self::Full(m) => m.with_base(|_| f(self)),
            Self::Sharded(_) => f(self),
        }
    }

    /// Dropout of the adapters on (training passes) or off.
    pub fn set_adapter_training(&self, training: bool) {
        if let Self::Full(m) = self {
            m.set_adapter_training(training);
        }
    }

    /// Makes every parameter collect gradients (the policy).
    pub fn make_trainable(&self) -> Result<()> {
        if let Self::Sharded(m) = self {
            m.set_trainable(true)?;
        }
        Ok(())
    }

    pub fn set_device(&mut self, device: Device) -> Result<()> {
        match self {
            Self::Full(m) => Ok(m.set_device(device)?),
            Self::Sharded(m) if m.device() == device => Ok(()),
            Self::Sharded(_) => Err(Error::InvalidConfig("a tensor-parallel model cannot change device".into())),
        }
    }

    /// Token logprobs [B, S]; without gradients unless the caller's mode records them.
    pub fn token_logprobs(&self, ids: &Tensor, lengths: &[i64], temperature: f64) -> keel_model::Result<Tensor> {
        match self {
            Self::Full(m) => m.token_logprobs(ids, lengths, temperature),
            Self::Sharded(m) => m.token_logprobs(ids, lengths, temperature),
        }
    }

    /// Token logprobs with gradients, and what [`Model::backward`] needs after the loss's
    /// own backward pass.
    pub fn train_logprobs(&self, ids: &Tensor, lengths: &[i64], temperature: f64) -> Result<(Tensor, Pending)> {
        Ok(match self {
            Self::Full(m) => (m.token_logprobs(ids, lengths, temperature)?, Pending::Nothing),
            Self::Sharded(m) => {
                let (logprobs, tape) = m.train_logprobs(ids, lengths, temperature)?;
                (logprobs, Pending::Sharded(tape))
            }
        })
    }

    /// Token logprobs of the sequences packed in `row`, right-padded [n, S] (see
    /// [`keel_model::CausalLm::packed_token_logprobs`]); without gradients unless the
    /// caller's mode records them.
    pub fn packed_token_logprobs(&self, row: &PackedRow, temperature: f64) -> keel_model::Result<Tensor> {
        match self {
            Self::Full(m) => m.packed_token_logprobs(row, temperature),
            Self::Sharded(m) => m.packed_token_logprobs(row, temperature),
        }
    }

    /// [`Model::train_logprobs`] of the sequences packed in `row`.
    pub fn packed_train_logprobs(&self, row: &PackedRow, temperature: f64) -> Result<(Tensor, Pending)> {
        Ok(match self {
            Self::Full(m) => (m.packed_token_logprobs(row, temperature)?, Pending::Nothing),
            Self::Sharded(m) => {
                let (logprobs, tape) = m.packed_train_logprobs(row, temperature)?;
                (logprobs, Pending::Sharded(tape))
            }
        })
    }

    /// Finishes a backward pass that `loss.backward()` started.
    pub fn backward(&self, pending: Pending) -> Result<()> {
        if let (Self::Sharded(m), Pending::Sharded(tape)) = (self, pending) {
            m.backward(tape)?;
        }
        Ok(())
    }

    /// Completes gradients shared between ranks (once per optimiser step, before clipping).
    pub fn reduce_replicated_gradients(&self) -> Result<()> {
        if let Self::Sharded(m) = self {
            m.reduce_replicated_gradients()?;
        }
        Ok(())
    }

    /// Final hidden states of right-padded sequences (value heads; whole models only).
    pub fn last_hidden_states(&self, ids: &Tensor, lengths: &[i64]) -> Result<Tensor> {
        match self {
            Self::Full(m) => Ok(m.last_hidden_states(ids, lengths)?),
            Self::Sharded(_) => Err(Error::InvalidConfig(
                "value heads (reward models) are not supported with tensor_parallel_size > 1".into(),
            )),
        }
    }

    /// The parameters by HF name, sorted, with their layout across ranks (`None` for a
    /// whole model).
    pub fn parameters(&self) -> Vec<(String, Tensor, Option<Layout>)> {
        let mut params: Vec<(String, Tensor, Option<Layout>)> = match self {
            Self::Full(m) => m.var_store().variables().into_iter().map(|(n, t)| (n, t, None)).collect(),
            Self::Sharded(m) => m.parameters().into_iter().map(|(n, t, l)| (n, t, Some(l))).collect(),
        };
        params.sort_by(|a, b| a.0.cmp(&b.0));
        params
    }

    /// How many parameters the whole model has (every rank gets the same count).
    pub fn parameter_count(&self) -> Result<i64> {
        let local: f64 = self
            .parameters()
            .iter()
            .map(|(_, t, layout)| {
                let n = t.numel() as f64;
                match layout.map(|l| l.weight_in_sum()) {
                    // A replicated tensor counts once over the ranks.
                    Some(None) => n / self.world_size() as f64,
                    Some(Some(weight)) => n * weight,
                    None => n,
                }
            })
            .sum();
        Ok(self.all_reduce_sum(local)?.round() as i64)
    }

    pub fn world_size(&self) -> usize {
        self.comm().map_or(1, |c| c.world_size())
    }

    /// The sum of `value` over the ranks (itself for a whole model).
    pub fn all_reduce_sum(&self, value: f64) -> Result<f64> {
        let Some(comm) = self.comm() else { return Ok(value) };
        // On the rank's device: NCCL reduces GPU tensors only.
        let mut t = Tensor::from_slice(&[value]).f_to_device(self.device())?;
        comm.all_reduce(&mut t, keel_collective::ReduceOp::Sum)?;
        Ok(t.f_double_value(&[0])?)
    }

    /// The whole tensor from this rank's `local` part of a tensor laid out as `layout`
    /// (every rank must call it).
    pub fn gather(&self, local: &Tensor, layout: Option<Layout>) -> Result<Tensor> {
        match (self, layout) {
            (Self::Sharded(m), Some(layout)) => Ok(m.gather_parameter(local, layout)?),
            _ => Ok(local.shallow_clone()),
        }
    }

    /// Runs `f` on the whole model: itself, or gathered from the ranks onto rank 0's CPU
    /// (every rank must call it; `f` runs on rank 0 only, the others get `None`).
    pub fn with_full<R>(&self, f: impl FnOnce(&CausalLm) -> Result<R>) -> Result<Option<R>> {
        match self {
            Self::Full(m) => f(m).map(Some),
            // Rank 0 gathers onto the CPU (the checkpoint is written from there); the
            // device holds one whole parameter at a time.
            Self::Sharded(m) => match m.gather_full_on(Device::Cpu, m.rank() == 0)? {
                Some(full) => f(&full).map(Some),
                None => Ok(None),
            },
        }
    }

    pub fn rank(&self) -> usize {
        self.comm().map_or(0, |c| c.rank())
    }
}
