//! PPO's critic: a causal LM of the policy's kind whose final hidden state at each position
//! goes through a scalar value head ([1, hidden], starting at zero), with an AdamW of its own.
//! Value t of a sequence is the head on the hidden state at position t − 1: the value of the
//! state before token t is chosen, laid out as the logprobs are (entry 0 is 0). It trains on
//! the returns a batch brings ([`crate::loss::value`]) and is saved in a checkpoint's
//! `critic/` directory (a checkpoint of its own: HF weights, `value_head.safetensors`,
//! optimiser and state), from which a resumed run loads it. Under tensor parallelism each rank
//! holds its slices of the critic as of the policy (the value head whole on every rank); under
//! data parallelism each replica trains on its share of the rows, as the policy does.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use keel_collective::SharedComm;
use keel_model::CausalLm;
use keel_model::model::Layout;
use keel_protocol::trainer::CriticLoad;
use keel_protocol::training::TrainingConfig;
use tch::{Device, Kind, Tensor};

use crate::batch::Batch;
use crate::checkpoint::{self, TrainerState};
use crate::error::{Error, Result};
use crate::loss::value::{ValueInput, value_loss};
use crate::loss::{self, GlobalCounts};
use crate::metrics::Metrics;
use crate::optim::AdamW;

/// The critic's directory inside a checkpoint.
pub const CRITIC_DIR: &str = "critic";

/// The tensor the critic leaves untrained: its LM head (when not tied to the embeddings).
const LM_HEAD: &str = "lm_head.weight";

#[derive(Debug)]
pub struct Critic {
    model: CausalLm,
    head: Tensor,
    optimizer: AdamW,
    value_clip: Option<f64>,
    warmup_steps: u64,
    /// Where the critic was loaded from (its tokenizer and side files are copied from there).
    source: PathBuf,
}

impl Critic {
    /// The critic of `request`: the one a checkpoint at `policy_source` saved when `resume`
    /// is set and there is one, else a new one on `request.model` (value head of zeros).
    /// Computes in `kind` with f32 master weights, like the policy; its optimiser's state is
    /// sharded over `data` when given; with `comm` it is this tensor-parallel rank's slices.
    pub fn load(
        request: &CriticLoad,
        policy_source: &Path,
        resume: bool,
        device: Device,
        kind: Kind,
        comm: Option<SharedComm>,
        data: Option<&SharedComm>,
    ) -> Result<Self> {
        let saved = policy_source.join(CRITIC_DIR);
        let resumes = resume && checkpoint::read_state(&saved)?.is_some();
        let source = if resumes { saved } else { PathBuf::from(&request.model.path) };
        let mut model = CausalLm::load_on(&source, comm, device, Kind::Float)
            .map_err(|e| Error::Load { what: format!("critic {}", source.display()), reason: e.to_string() })?;
        let hidden = model.config().hidden_size;
        let head = if resumes {
            checkpoint::load_value_head(&source.join(checkpoint::VALUE_HEAD_FILE), hidden, device)?
        } else {
            Tensor::f_zeros([1, hidden], (Kind::Float, device))?.f_set_requires_grad(true)?
        };
        model.set_trainable(true)?;
        let mut params = Vec::new();
        for (name, param, layout) in model.parameters() {
            if name == LM_HEAD {
                let _ = param.f_set_requires_grad(false)?;
            } else {
                params.push((name, param, layout));
            }
        }
        let mut optimizer = AdamW::for_parameters(request.optimizer.clone(), &mut model, params, kind)?;
        optimizer.add(checkpoint::VALUE_HEAD_TENSOR, &head)?;
        if let Some(data) = data {
            optimizer.shard(data.clone())?;
        }
        if resumes {
            checkpoint::restore_optimizer(&source, &mut optimizer)?;
        }
        optimizer.broadcast_parameters()?;
        Ok(Self { model, head, optimizer, value_clip: request.value_clip, warmup_steps: request.warmup_steps, source })
    }

    /// The critic's optimiser steps so far.
    pub fn steps(&self) -> u64 {
        self.optimizer.step_count()
    }

    /// Whether the policy may be updated: the critic's warm-up steps are done.
    pub fn warmed_up(&self) -> bool {
        self.steps() >= self.warmup_steps
    }

    /// Values [b, S] (f32, on the critic's device) of right-padded sequences, laid out as the
    /// logprobs; with gradients when the caller's mode records them.
    pub fn values(&self, ids: &Tensor, lengths: &[i64]) -> Result<Tensor> {
        self.head_values(&self.model.last_hidden_states(ids, lengths)?)
    }

    /// The value head over final hidden states [b, S, hidden], shifted to the logprobs' layout.
    fn head_values(&self, hidden: &Tensor) -> Result<Tensor> {
        let hidden = hidden.f_to_kind(Kind::Float)?;
        let after = hidden.f_matmul(&self.head.f_transpose(0, 1)?)?.f_squeeze_dim(2)?;
        let (rows, width) = (after.size()[0], after.size()[1]);
        let first = Tensor::f_zeros([rows, 1], (Kind::Float, after.device()))?;
        Ok(Tensor::f_cat(&[first, after.f_narrow(1, 0, width - 1)?], 1)?)
    }

    /// The loss of one microbatch (its `values` and `returns` set), normalised by the global
    /// batch's counts, back-propagated; returns its metrics.
    pub fn microbatch(&self, micro: &Batch, global: &GlobalCounts, rows: &[usize]) -> Result<Metrics> {
        let missing = || Error::InvalidRequest("a batch that trains the critic needs both values and returns".into());
        let device = self.model.device();
        let (hidden, tape) = self.model.train_hidden_states(&micro.input_ids, &micro.lengths)?;
        let values = self.head_values(&hidden)?;
        let sample_mask = micro.sample_mask.f_to_device(device)?;
        let input = ValueInput {
            values: &values,
            old_values: micro.values.as_ref().ok_or_else(missing)?.f_to_device(device)?,
            returns: micro.returns.as_ref().ok_or_else(missing)?.f_to_device(device)?,
            mask: loss::shifted_mask(&micro.token_mask.f_to_device(device)?, &sample_mask)?,
        };
        let (loss, metrics) = value_loss(self.value_clip, &input, global)?;
        crate::engine::finite(&loss, rows, "the critic took no step")?;
        loss.f_backward()?;
        self.model.backward(tape)?;
        Ok(metrics)
    }

    /// Every tensor the critic's optimiser trains (their gradients are summed over the
    /// data-parallel ranks).
    pub fn trainable(&self) -> Vec<Tensor> {
        self.optimizer.parameters()
    }

    /// Clips the gradients to `max_norm` and takes one optimiser step at the critic's
    /// learning rate; returns the gradient norm before clipping and the learning rate.
    pub fn step(&mut self, max_norm: Option<f64>) -> Result<(f64, f64)> {
        let clipped = self
            .model
            .reduce_replicated_gradients()
            .map_err(Error::from)
            .and_then(|()| self.optimizer.clip_grad_norm(max_norm, self.model.comm()));
        let norm = match clipped {
            Ok(norm) => norm,
            Err(e) => {
                self.optimizer.zero_grad();
                return Err(e);
            }
        };
        let lr = self.optimizer.config().lr;
        self.optimizer.step(lr)?;
        self.optimizer.zero_grad();
        Ok((norm, lr))
    }

    pub fn zero_grad(&mut self) {
        self.optimizer.zero_grad();
    }

    /// Moves the critic's weights (with `weights`) and optimiser state to `device` in place;
    /// returns the bytes moved.
    pub fn move_to(&self, device: Device, weights: bool) -> Result<u64> {
        let mut bytes = self.optimizer.move_state(device)?;
        if weights {
            let mut tensors: Vec<Tensor> = self.model.parameters().into_iter().map(|(_, p, _)| p).collect();
            tensors.push(self.head.shallow_clone());
            bytes += crate::engine::move_with_gradients(&tensors, device)?;
        }
        Ok(bytes)
    }

    /// The optimiser's state gathered from the data-parallel ranks (every rank calls it).
    pub fn gathered_state(&self) -> Result<Vec<(String, Tensor, Layout)>> {
        self.optimizer.gathered_state()
    }

    /// What a checkpoint's `critic/` directory needs from the tensor-parallel ranks (every
    /// rank of the group calls it): the optimiser's `state` made whole and, on a rank, the
    /// whole model (both kept, on the CPU, by rank 0).
    pub fn whole(&self, state: Vec<(String, Tensor, Layout)>) -> Result<(BTreeMap<String, Tensor>, Option<CausalLm>)> {
        let state = checkpoint::whole_optimizer_state(&self.model, state)?;
        let keep = self.model.rank() == 0;
        let whole = if self.model.is_shard() { self.model.gather_full_on(Device::Cpu, keep)? } else { None };
        Ok((state, whole))
    }

    /// The critic's part of a checkpoint, with `optimizer_state` and (under tensor
    /// parallelism) the `whole` model from [`Critic::whole`], and the policy's
    /// `training` configuration.
    pub fn part<'a>(
        &'a self,
        optimizer_state: &'a BTreeMap<String, Tensor>,
        whole: Option<&'a CausalLm>,
        state: &'a TrainerState,
    ) -> Result<checkpoint::Part<'a>> {
        Ok(checkpoint::Part {
            source: &self.source,
            weights: checkpoint::Weights::Whole(whole.unwrap_or(&self.model)),
            value_head: Some(&self.head),
            optimizer_state,
            state,
        })
    }

    /// The critic's trainer state in a checkpoint: its own step, the run's configuration with
    /// the critic's optimiser.
    pub fn state(&self, seed: u64, training: &TrainingConfig) -> TrainerState {
        TrainerState {
            format: checkpoint::FORMAT.into(),
            step: self.steps(),
            seed,
            compute_dtype: keel_model::weights::dtype_name(self.model.kind()).into(),
            training: TrainingConfig { optimizer: self.optimizer.config().clone(), ..training.clone() },
            reference: None,
            info: serde_json::Value::Null,
        }
    }
}
