//! The training engine of one run: the policy (trainable), an optional frozen reference, an
//! optional scalar value head (reward models), an optional PPO critic ([`Critic`]), AdamW with
//! its schedule, and what the worker asks of them — logprobs, values, reward scores, training
//! on a batch, checkpoints.
//!
//! Training splits a batch into global batches of `global_batch_size` rows (one optimiser
//! step each) and each global batch into microbatches of `micro_batch_size` rows whose
//! gradients accumulate. Every microbatch loss divides by the counts of its whole global
//! batch, so loss and gradients do not depend on the split. Compute may be bf16/f16 while
//! the optimiser keeps f32 master weights.
//!
//! Under data parallelism ([`Engine::load_group`] with a data-parallel group) every rank gets
//! the whole batch and trains on its share of each global batch's rows ([`crate::dp`]);
//! gradients and metrics are summed over the group before the step, and the optimiser's
//! state is sharded over it. Each replica scores its share of the rows for logprobs, and the
//! shares are gathered; evaluation runs whole on every rank.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use keel_model::CausalLm;
use keel_model::model::Tape;
use keel_model::packed::PackedRow;
use tch::{Device, Kind, Tensor};

use crate::batch::{Batch, chunks, microbatches, pad_ids, unpad};
use crate::checkpoint;
use crate::critic::Critic;
use crate::error::{Error, Result};
use crate::loss::{self, GlobalCounts, LossInput};
use crate::metrics::Metrics;
use crate::optim::AdamW;
use crate::schedule::lr_factor;
use keel_collective::SharedComm;
use keel_protocol::trainer::{LoadRequest, Scorer, StepMetrics, Timing};
use keel_protocol::training::{LossConfig, TrainingConfig};

/// The frozen reference policy.
#[derive(Debug)]
enum Reference {
    /// A model of its own, optionally parked on the CPU between uses.
    Loaded { model: Box<CausalLm>, offload: bool },
    /// The policy's base model under LoRA: the policy with its adapters off (no second copy).
    Base,
}

#[derive(Debug)]
pub struct Engine {
    config: TrainingConfig,
    policy: CausalLm,
    /// Parameters of the whole model (every rank's slices counted once).
    parameter_count: i64,
    reference: Option<Reference>,
    value_head: Option<Tensor>,
    /// PPO's critic, trained beside the policy on batches that bring returns.
    critic: Option<Critic>,
    optimizer: AdamW,
    device: Device,
    source: PathBuf,
    /// The model the policy's LoRA adapters sit on (the source otherwise).
    base: PathBuf,
    reference_path: Option<PathBuf>,
    seed: u64,
    /// The data-parallel group this rank belongs to (`None`: no data parallelism).
    data: Option<SharedComm>,
}

/// Refuses a non-finite microbatch loss (of `rows`).
pub(crate) fn finite(loss: &Tensor, rows: &[usize], consequence: &str) -> Result<()> {
    let value = loss.f_double_value(&[])?;
    if value.is_finite() {
        return Ok(());
    }
    let rows = match (rows.first(), rows.last()) {
        (Some(first), Some(last)) if last - first + 1 == rows.len() => format!("rows {first}..{}", last + 1),
        _ => format!("rows {rows:?}"),
    };
    Err(Error::NonFinite(format!("the loss of {rows} is {value}; {consequence}")))
}

/// What one `evaluate` call found: the loss's metrics over the whole batch.
#[derive(Debug)]
pub struct Evaluated {
    pub metrics: BTreeMap<String, f64>,
    pub tokens: u64,
    pub timing: Timing,
}

/// What one `train` call did.
#[derive(Debug)]
pub struct Trained {
    pub steps: Vec<StepMetrics>,
    pub tokens: u64,
    pub timing: Timing,
}

fn load_error(what: &Path) -> impl Fn(keel_model::Error) -> Error + '_ {
    move |e| Error::Load { what: what.display().to_string(), reason: e.to_string() }
}

/// Whether two paths name the same directory.
fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

fn seconds(since: Instant) -> f64 {
    since.elapsed().as_secs_f64()
}

impl Engine {
    /// Loads the models for `request` (the configuration was validated by the caller).
    pub fn load(request: &LoadRequest, default_device: &str) -> Result<Self> {
        Self::load_rank(request, default_device, None)
    }

    /// Loads one tensor-parallel rank's slices of the models when `comm` is given (every
    /// rank of the group calls it, each on its own thread); on CUDA, rank r uses the r-th
    /// device from the one named ([`keel_collective::rank_device`]).
    pub fn load_rank(request: &LoadRequest, default_device: &str, comm: Option<SharedComm>) -> Result<Self> {
        Self::load_group(request, default_device, comm, None)
    }

    /// Loads one rank of a data-parallel × tensor-parallel grid: `comm` is its
    /// tensor-parallel group (`None`: TP 1), `data` its data-parallel group (the ranks with
    /// the same tensor-parallel rank; `None`: DP 1). On CUDA the rank with data-parallel rank
    /// d and tensor-parallel rank t of a TP-T grid uses the (d·T + t)-th device from the one
    /// named.
    pub fn load_group(
        request: &LoadRequest,
        default_device: &str,
        comm: Option<SharedComm>,
        data: Option<SharedComm>,
    ) -> Result<Self> {
        let device_name = request.device.as_deref().unwrap_or(default_device);
        let device = keel_model::device::parse_device(device_name).map_err(|e| Error::InvalidConfig(e.to_string()))?;
        let (tp_rank, tp_world) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.world_size()));
        let index = data.as_ref().map_or(0, |d| d.rank()) * tp_world + tp_rank;
        let device =
            if comm.is_some() || data.is_some() { keel_collective::rank_device(device, index) } else { device };
        Self::load_on(request, device, comm, data)
    }

    /// Loads one rank of a data-parallel × tensor-parallel grid on `device`, this rank's
    /// own: what a rank in a process of its own (one GPU per process) loads with.
    pub fn load_on(
        request: &LoadRequest,
        device: Device,
        comm: Option<SharedComm>,
        data: Option<SharedComm>,
    ) -> Result<Self> {
        if comm.is_some() && request.reference_offload {
            return Err(Error::InvalidConfig(
                "reference_offload is not supported with tensor_parallel_size > 1".into(),
            ));
        }
        let kind = match &request.dtype {
            Some(name) => keel_model::device::parse_kind(name).map_err(|e| Error::InvalidConfig(e.to_string()))?,
            None if device == Device::Cpu => Kind::Float,
            None => Kind::BFloat16,
        };
        tch::manual_seed(request.seed as i64);
        let source = PathBuf::from(&request.policy.path);
        let config = request.training.clone();
        let lora = config.lora.enabled.then_some(&config.lora);
        if lora.is_some() && comm.is_some() {
            return Err(Error::InvalidConfig("LoRA trains on one rank: tensor_parallel_size must be 1".into()));
        }
        let saved_state = checkpoint::read_state(&source)?;
        let saved_lora = saved_state.as_ref().is_some_and(|s| s.training.lora.enabled);
        // A LoRA run resuming from a LoRA checkpoint goes on training its adapters over their
        // base; any other start puts new adapters on the source model (an adapter directory
        // loads as its base with the adapters merged).
        let resumes_adapters =
            lora.is_some() && request.resume && saved_lora && keel_model::lora::is_adapter_dir(&source);
        let (mut policy, base) = if resumes_adapters {
            let adapters = keel_model::lora::AdapterDir::read(&source).map_err(load_error(&source))?;
            if !config.lora.same_adapters(&adapters.config) {
                return Err(Error::InvalidConfig(format!(
                    "training.lora {:?} differs from the adapters of the checkpoint being resumed ({:?})",
                    config.lora, adapters.config
                )));
            }
            let model = adapters.load(device, Kind::Float).map_err(load_error(&source))?;
            (model, adapters.base)
        } else {
            let mut model =
                CausalLm::load_on(&source, comm.clone(), device, Kind::Float).map_err(load_error(&source))?;
            if let Some(lora) = lora {
                model.add_adapters(lora)?;
            }
            (model, source.clone())
        };
        if lora.is_some() {
            policy.freeze()?;
        } else {
            policy.set_trainable(true)?;
        }

        // The reference is the one named, else the one a resumed checkpoint was trained
        // against, else the policy as loaded (under LoRA: the base the adapters sit on).
        let reference_path = match (&request.reference, saved_state.and_then(|s| s.reference)) {
            (Some(explicit), _) => Some(PathBuf::from(&explicit.path)),
            (None, Some(saved)) => Some(PathBuf::from(saved)),
            (None, None) => config.loss.needs_reference().then(|| base.clone()),
        };
        let reference = match &reference_path {
            Some(path) if lora.is_some() && same_dir(path, &base) => Some(Reference::Base),
            Some(path) if request.reference.is_some() || config.loss.needs_reference() => {
                let at = if request.reference_offload { Device::Cpu } else { device };
                let mut model = CausalLm::load_on(path, comm.clone(), at, kind).map_err(load_error(path))?;
                model.freeze()?;
                Some(Reference::Loaded { model: Box::new(model), offload: request.reference_offload })
            }
            _ => None,
        };

        let head_file = source.join(checkpoint::VALUE_HEAD_FILE);
        let value_head = if head_file.is_file() {
            Some(checkpoint::load_value_head(&head_file, policy.config().hidden_size, device)?)
        } else if matches!(config.loss, LossConfig::BradleyTerry) {
            let hidden = policy.config().hidden_size;
            // The ranks of a tensor-parallel group are threads sharing torch's generator: each
            // draws the head as the first numbers after the seed, one at a time, so every
            // rank (and a run at TP 1) starts from the same head.
            static DRAW: std::sync::Mutex<()> = std::sync::Mutex::new(());
            let init = {
                let _one_at_a_time = DRAW.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                tch::manual_seed(request.seed as i64);
                Tensor::f_randn([1, hidden], (Kind::Float, device))?.f_mul_scalar(1.0 / (hidden as f64).sqrt())?
            };
            Some(init.f_set_requires_grad(true)?)
        } else {
            None
        };

        let params = policy.trainable_parameters();
        let mut optimizer = AdamW::for_parameters(config.optimizer.clone(), &mut policy, params, kind)?;
        let mut parameter_count = policy.parameter_count()?;
        if let Some(head) = &value_head {
            optimizer.add(checkpoint::VALUE_HEAD_TENSOR, head)?;
            parameter_count += head.numel() as i64;
        }
        if let Some(data) = &data {
            optimizer.shard(data.clone())?;
        }
        // The optimiser's state is restored where it holds the same tensors: LoRA moments
        // from a LoRA checkpoint, whole-model moments from a whole one.
        if request.resume && saved_lora == lora.is_some() {
            checkpoint::restore_optimizer(&source, &mut optimizer)?;
        }
        // Data-parallel replicas start from the same values (new LoRA adapters and value
        // heads are random; a restored master copy is its owner's).
        optimizer.broadcast_parameters()?;
        let critic = match &request.critic {
            Some(critic) => {
                Some(Critic::load(critic, &source, request.resume, device, kind, comm.clone(), data.as_ref())?)
            }
            None => None,
        };
        Ok(Self {
            config,
            policy,
            parameter_count,
            reference,
            value_head,
            critic,
            optimizer,
            device,
            source,
            base,
            reference_path,
            seed: request.seed,
            data,
        })
    }

    /// The data-parallel replicas this engine is one of (1 without data parallelism).
    pub fn data_parallel_size(&self) -> usize {
        self.data.as_ref().map_or(1, |d| d.world_size())
    }

    pub fn step(&self) -> u64 {
        self.optimizer.step_count()
    }

    /// Parameters of the whole model, value head included.
    pub fn parameters(&self) -> i64 {
        self.parameter_count
    }

    /// The model directory the policy's LoRA adapters sit on (`None` without LoRA).
    pub fn lora_base(&self) -> Option<&Path> {
        self.policy.lora().is_some().then_some(self.base.as_path())
    }

    pub fn has_reference(&self) -> bool {
        self.reference.is_some()
    }

    pub fn has_value_head(&self) -> bool {
        self.value_head.is_some()
    }

    pub fn critic(&self) -> Option<&Critic> {
        self.critic.as_ref()
    }

    pub fn policy(&self) -> &CausalLm {
        &self.policy
    }

    pub fn config(&self) -> &TrainingConfig {
        &self.config
    }

    /// Padded [B, S] logprobs (CPU, f32) without gradients, computed `micro_batch_size` rows
    /// at a time, or by the token budget of sequence packing or dynamic batching.
    /// Under data parallelism each replica scores its share of the rows and the shares are
    /// gathered, so every replica returns the whole.
    fn padded_logprobs(&mut self, scorer: Scorer, ids: &Tensor, lengths: &[i64], temperature: f64) -> Result<Tensor> {
        let Some(data) = self.data.clone() else {
            return self.local_logprobs(scorer, ids, lengths, temperature);
        };
        let rows = crate::dp::shard(lengths.len(), data.rank(), data.world_size());
        let mine = if rows.is_empty() {
            Tensor::f_zeros([0, ids.size()[1]], (Kind::Float, Device::Cpu))?
        } else {
            let index = Tensor::from_slice(&rows.clone().map(|r| r as i64).collect::<Vec<_>>());
            self.local_logprobs(scorer, &ids.f_index_select(0, &index)?, &lengths[rows], temperature)?
        };
        crate::dp::all_gather_rows(&mine, lengths.len(), data.as_ref(), self.device)
    }

    /// [`Engine::padded_logprobs`] of this rank alone.
    fn local_logprobs(&mut self, scorer: Scorer, ids: &Tensor, lengths: &[i64], temperature: f64) -> Result<Tensor> {
        let _no_grad = tch::no_grad_guard();
        let micro = self.config.micro_batch_size;
        let device = self.device;
        let budget = self.config.token_budget().map(|(_, logprobs, packed)| (logprobs, packed));
        let score = |forward: &dyn Fn(&Tensor, &[i64]) -> Result<Tensor>| -> Result<Tensor> {
            let width = ids.size()[1];
            let mut rows: Vec<Option<Tensor>> = (0..lengths.len()).map(|_| None).collect();
            for bin in microbatches(lengths, micro, budget, false) {
                let picked: Vec<i64> = bin.iter().map(|&r| lengths[r]).collect();
                let max = picked.iter().copied().max().unwrap_or(1);
                let index = Tensor::from_slice(&bin.iter().map(|&r| r as i64).collect::<Vec<_>>());
                let slice = ids.f_index_select(0, &index)?.f_narrow(1, 0, max)?;
                let lp = forward(&slice, &picked)?.f_to_device(Device::Cpu)?.f_constant_pad_nd([0, width - max])?;
                for (k, &r) in bin.iter().enumerate() {
                    rows[r] = Some(lp.f_select(0, k as i64)?);
                }
            }
            let rows: Vec<Tensor> = rows.into_iter().flatten().collect();
            Ok(Tensor::f_stack(&rows, 0)?)
        };
        let logprobs_of = |model: &CausalLm| {
            score(&|slice: &Tensor, picked: &[i64]| -> Result<Tensor> {
                Ok(match budget {
                    Some((_, true)) => model.packed_token_logprobs(&PackedRow::new(slice, picked)?, temperature)?,
                    _ => model.token_logprobs(slice, picked, temperature)?,
                })
            })
        };
        match (scorer, &mut self.reference) {
            (Scorer::Policy, _) => logprobs_of(&self.policy),
            (Scorer::Critic, _) => {
                let critic = self.critic.as_ref().ok_or_else(|| {
                    Error::InvalidRequest("no critic is loaded (the run is not PPO: it has no `ppo` section)".into())
                })?;
                score(&|slice: &Tensor, picked: &[i64]| critic.values(slice, picked))
            }
            (Scorer::Reference, Some(Reference::Base)) => self.policy.with_base(logprobs_of),
            (Scorer::Reference, Some(Reference::Loaded { model, offload })) => {
                if *offload {
                    model.set_device(device)?;
                }
                let result = logprobs_of(model);
                if *offload {
                    model.set_device(Device::Cpu)?;
                }
                result
            }
            (Scorer::Reference, None) => Err(Error::InvalidRequest(
                "no reference model is loaded (the loss needs none and none was given)".into(),
            )),
        }
    }

    /// Per-token logprobs of `sequences` under the policy or the reference at `temperature`.
    pub fn logprobs(&mut self, scorer: Scorer, sequences: &[Vec<i64>], temperature: f64) -> Result<Vec<Vec<f32>>> {
        let (ids, lengths) = pad_ids(sequences)?;
        let padded = self.padded_logprobs(scorer, &ids, &lengths, temperature)?;
        unpad(&padded, &lengths)
    }

    /// Value-head scores [B] at each row's last token; with `train`, with gradients and what
    /// the model's backward pass needs after the loss's (a tensor-parallel rank's tape).
    fn padded_scores(&self, ids: &Tensor, lengths: &[i64], train: bool) -> Result<(Tensor, Tape)> {
        let head = self.value_head.as_ref().ok_or_else(|| {
            Error::InvalidRequest(
                "this model has no value head (train with bradley_terry or load a reward model)".into(),
            )
        })?;
        let (hidden, tape) = if train {
            self.policy.train_hidden_states(ids, lengths)?
        } else {
            (self.policy.last_hidden_states(ids, lengths)?, Tape::default())
        };
        let last = Tensor::from_slice(&lengths.iter().map(|l| l - 1).collect::<Vec<_>>()).f_to_device(self.device)?;
        let (b, h) = (hidden.size()[0], hidden.size()[2]);
        let index = last.f_view([b, 1, 1])?.f_expand([b, 1, h], false)?;
        let final_token = hidden.f_gather(1, &index, false)?.f_squeeze_dim(1)?.f_to_kind(Kind::Float)?;
        Ok((final_token.f_matmul(&head.f_transpose(0, 1)?)?.f_squeeze_dim(1)?, tape))
    }

    /// Reward-model scores of `sequences`.
    pub fn scores(&self, sequences: &[Vec<i64>]) -> Result<Vec<f32>> {
        let _no_grad = tch::no_grad_guard();
        let (ids, lengths) = pad_ids(sequences)?;
        let mut scores = Vec::with_capacity(lengths.len());
        for (start, len) in chunks(lengths.len(), self.config.micro_batch_size) {
            let rows = &lengths[start..start + len];
            let max = rows.iter().copied().max().unwrap_or(1);
            let slice = ids.f_narrow(0, start as i64, len as i64)?.f_narrow(1, 0, max)?;
            let (batch, _) = self.padded_scores(&slice, rows, false)?;
            scores.extend(Vec::<f32>::try_from(batch.f_to_device(Device::Cpu)?)?);
        }
        Ok(scores)
    }

    /// Fills in prev and reference logprobs the loss needs and the batch lacks. The policy's
    /// logprobs before the update need a pass of their own only when the batch takes more than
    /// one optimiser step: with one, every microbatch's forward runs on the weights before the
    /// update, and its detached logprobs are those ([`Engine::microbatch_loss`]).
    fn complete(&mut self, batch: &mut Batch, temperature: f64, timing: &mut Timing) -> Result<()> {
        if matches!(self.config.loss, LossConfig::ClippedPg(_))
            && batch.prev_logprobs.is_none()
            && batch.len() > self.config.global_batch_size
        {
            let start = Instant::now();
            batch.prev_logprobs =
                Some(self.padded_logprobs(Scorer::Policy, &batch.input_ids, &batch.lengths, temperature)?);
            timing.insert("prev_logprobs".into(), seconds(start));
        }
        if self.config.loss.needs_reference() && batch.reference_logprobs.is_none() {
            let start = Instant::now();
            batch.reference_logprobs =
                Some(self.padded_logprobs(Scorer::Reference, &batch.input_ids, &batch.lengths, temperature)?);
            timing.insert("reference_logprobs".into(), seconds(start));
        }
        Ok(())
    }

    /// Loss and metrics of one microbatch, normalised by the global batch's counts, and
    /// what the policy's backward pass needs after the loss's.
    fn microbatch_loss(
        &self,
        micro: &Batch,
        global: &GlobalCounts,
        temperature: f64,
    ) -> Result<(Tensor, Metrics, Tape)> {
        let device = self.device;
        let on_device = |x: &Option<Tensor>| x.as_ref().map(|t| t.f_to_device(device)).transpose();
        let (logprobs, scores, pending) = if matches!(self.config.loss, LossConfig::BradleyTerry) {
            let (scores, tape) = self.padded_scores(&micro.input_ids, &micro.lengths, true)?;
            (Tensor::f_zeros([0], (Kind::Float, device))?, Some(scores), tape)
        } else {
            let (logprobs, pending) = if self.config.sequence_packing.enabled {
                let row = PackedRow::new(&micro.input_ids, &micro.lengths)?;
                self.policy.packed_train_logprobs(&row, temperature)?
            } else {
                self.policy.train_logprobs(&micro.input_ids, &micro.lengths, temperature)?
            };
            (logprobs, None, pending)
        };
        let sample_mask = micro.sample_mask.f_to_device(device)?;
        let input = LossInput {
            logprobs: &logprobs,
            mask: loss::shifted_mask(&micro.token_mask.f_to_device(device)?, &sample_mask)?,
            sample_mask,
            advantages: on_device(&micro.advantages)?,
            prev_logprobs: match on_device(&micro.prev_logprobs)? {
                // One optimiser step over the batch: this forward is the policy before it.
                None if matches!(self.config.loss, LossConfig::ClippedPg(_)) => Some(logprobs.f_detach()?),
                prev => prev,
            },
            generation_logprobs: on_device(&micro.generation_logprobs)?,
            reference_logprobs: on_device(&micro.reference_logprobs)?,
            scores,
        };
        let (loss, mut metrics) = match &self.config.loss {
            LossConfig::ClippedPg(c) => loss::policy::clipped_pg(c, &input, global),
            LossConfig::Nll => loss::nll::nll(&input, global),
            LossConfig::Dpo(c) => loss::dpo::dpo(c, &input, global),
            LossConfig::BradleyTerry => loss::reward::bradley_terry(&input, global),
        }?;
        let loss = with_router_loss(loss, &pending, &input.sample_mask, global, &mut metrics)?;
        Ok((loss, metrics, pending))
    }

    /// Forward and backward over `global`'s microbatches of `micro_batch_size` rows,
    /// accumulating gradients (no optimiser step). Returns the summed metrics.
    ///
    /// Under data parallelism every rank passes the whole global batch and runs its share of
    /// the rows; the gradients and metrics returned are the group's sums (every rank of the
    /// group calls it, and when one fails they all fail).
    pub fn accumulate_gradients(
        &mut self,
        global: &Batch,
        micro_batch_size: usize,
        temperature: f64,
    ) -> Result<Metrics> {
        Ok(self.timed_accumulate_gradients(global, micro_batch_size, temperature)?.0)
    }

    /// [`Self::accumulate_gradients`], with the seconds spent in the microbatches' forward
    /// passes (the loss included) and in their backward passes (host time: on a GPU it is
    /// the time to queue the kernels).
    fn timed_accumulate_gradients(
        &mut self,
        global: &Batch,
        micro_batch_size: usize,
        temperature: f64,
    ) -> Result<(Metrics, f64, f64)> {
        let (mut forward, mut backward) = (0.0, 0.0);
        let counts = GlobalCounts::of(&global.token_mask, &global.sample_mask)?;
        // LoRA's dropout is on for these passes only.
        self.policy.set_adapter_training(true);
        let mut trainable: Vec<Tensor> = self.policy.trainable_parameters().into_iter().map(|(_, p, _)| p).collect();
        trainable.extend(self.value_head.iter().map(Tensor::shallow_clone));
        let this = &*self;
        let accumulated = accumulate(
            global,
            &|lengths: &[i64]| this.plan(lengths, micro_batch_size),
            &mut |micro: &Batch, rows: &[usize]| {
                let start = Instant::now();
                let (loss, part, pending) = this.microbatch_loss(micro, &counts, temperature)?;
                finite(&loss, rows, "no step was taken")?;
                forward += seconds(start);
                let start = Instant::now();
                loss.f_backward()?;
                this.policy.backward(pending)?;
                backward += seconds(start);
                Ok(part)
            },
            &trainable,
            self.data.as_ref(),
            self.device,
        );
        self.policy.set_adapter_training(false);
        let mut metrics = accumulated?;
        metrics.global("global_valid_tokens", counts.tokens);
        Ok((metrics, forward, backward))
    }

    /// One optimiser step of the critic on `global` (which brings values and returns):
    /// gradients accumulated over its microbatches as the policy's are, clipped to
    /// `max_grad_norm`. Returns the value loss's metrics and `critic_grad_norm`, `critic_lr`.
    fn train_critic(&mut self, global: &Batch) -> Result<Metrics> {
        let Some(critic) = self.critic.as_ref() else { return Ok(Metrics::default()) };
        let counts = GlobalCounts::of(&global.token_mask, &global.sample_mask)?;
        let micro_batch_size = self.config.micro_batch_size;
        let accumulated = accumulate(
            global,
            &|lengths: &[i64]| self.plan(lengths, micro_batch_size),
            &mut |micro: &Batch, rows: &[usize]| critic.microbatch(micro, &counts, rows),
            &critic.trainable(),
            self.data.as_ref(),
            self.device,
        );
        let max_grad_norm = self.config.max_grad_norm;
        let Some(critic) = self.critic.as_mut() else { return Ok(Metrics::default()) };
        let mut metrics = match accumulated {
            Ok(metrics) => metrics,
            Err(e) => {
                critic.zero_grad();
                return Err(e);
            }
        };
        let (norm, lr) = critic.step(max_grad_norm)?;
        metrics.global("critic_grad_norm", norm);
        metrics.global("critic_lr", lr);
        Ok(metrics)
    }

    /// The microbatches of a global batch with `lengths`: `micro_batch_size` rows at a time,
    /// or by the training token budget of sequence packing or dynamic batching.
    fn plan(&self, lengths: &[i64], micro_batch_size: usize) -> Vec<Vec<usize>> {
        let budget = self.config.token_budget().map(|(train, _, packed)| (train, packed));
        microbatches(lengths, micro_batch_size, budget, self.config.loss.is_pairwise())
    }

    /// The gradients of every trainable tensor (for tests and diagnostics), by name, whole
    /// (gathered from the ranks under tensor parallelism: every rank must call it).
    pub fn gradients(&self) -> Result<BTreeMap<String, Tensor>> {
        self.policy.reduce_replicated_gradients()?;
        let mut grads = BTreeMap::new();
        for (name, param, layout) in self.policy.trainable_parameters() {
            let grad = param.grad().f_to_kind(Kind::Float)?;
            grads.insert(name, self.policy.gather_parameter(&grad, layout)?.copy());
        }
        if let Some(head) = &self.value_head {
            grads.insert(checkpoint::VALUE_HEAD_TENSOR.into(), head.grad().copy());
        }
        Ok(grads)
    }

    pub fn zero_grad(&mut self) {
        self.optimizer.zero_grad();
    }

    /// The loss and its metrics on `batch` as one global batch, changing nothing: no
    /// gradients, no optimiser step (validation). Microbatches of `micro_batch_size` rows
    /// divide by the whole batch's counts, so the metrics are those of the whole batch.
    pub fn evaluate(&mut self, mut batch: Batch, temperature: f64) -> Result<Evaluated> {
        let _no_grad = tch::no_grad_guard();
        let total = Instant::now();
        let mut timing = Timing::new();
        self.complete(&mut batch, temperature, &mut timing)?;
        let counts = GlobalCounts::of(&batch.token_mask, &batch.sample_mask)?;
        let mut metrics = Metrics::default();
        for rows in self.plan(&batch.lengths, self.config.micro_batch_size) {
            let micro = batch.select(&rows)?;
            let (loss, part, _) = self.microbatch_loss(&micro, &counts, temperature)?;
            finite(&loss, &rows, "nothing was evaluated")?;
            metrics.merge(part);
        }
        metrics.global("global_valid_tokens", counts.tokens);
        timing.insert("total".into(), seconds(total));
        let tokens = batch.lengths.iter().sum::<i64>() as u64;
        Ok(Evaluated { metrics: metrics.into_map(), tokens, timing })
    }

    /// Trains on `batch`: one optimiser step per global batch.
    pub fn train(&mut self, mut batch: Batch, temperature: f64) -> Result<Trained> {
        let total = Instant::now();
        let mut timing = Timing::new();
        self.complete(&mut batch, temperature, &mut timing)?;
        let training = Instant::now();
        let mut steps = Vec::new();
        for (start, len) in chunks(batch.len(), self.config.global_batch_size) {
            let global = batch.rows(start, len)?;
            let trains_critic = self.critic.is_some() && global.returns.is_some();
            // PPO's critic warms up alone: the policy waits for its first steps.
            if trains_critic && self.critic.as_ref().is_some_and(|c| !c.warmed_up()) {
                let metrics = self.train_critic(&global)?;
                steps.push(StepMetrics { step: self.optimizer.step_count(), metrics: metrics.into_map() });
                continue;
            }
            self.optimizer.zero_grad();
            let accumulated = self.timed_accumulate_gradients(&global, self.config.micro_batch_size, temperature);
            let mut metrics = match accumulated {
                Ok((metrics, forward, backward)) => {
                    *timing.entry("forward".into()).or_default() += forward;
                    *timing.entry("backward".into()).or_default() += backward;
                    metrics
                }
                Err(e) => {
                    self.optimizer.zero_grad();
                    return Err(e);
                }
            };
            let optimizer = Instant::now();
            let clipped = self
                .policy
                .reduce_replicated_gradients()
                .map_err(Error::from)
                .and_then(|()| self.optimizer.clip_grad_norm(self.config.max_grad_norm, self.policy.comm()));
            let grad_norm = match clipped {
                Ok(norm) => norm,
                Err(e) => {
                    self.optimizer.zero_grad();
                    return Err(e);
                }
            };
            let lr = self.config.optimizer.lr * lr_factor(&self.config.scheduler, self.optimizer.step_count());
            self.optimizer.step(lr)?;
            self.optimizer.zero_grad();
            *timing.entry("optimizer".into()).or_default() += seconds(optimizer);
            metrics.global("grad_norm", grad_norm);
            metrics.global("lr", lr);
            if trains_critic {
                metrics.merge(self.train_critic(&global)?);
            }
            steps.push(StepMetrics { step: self.optimizer.step_count(), metrics: metrics.into_map() });
        }
        timing.insert("training".into(), seconds(training));
        timing.insert("total".into(), seconds(total));
        let tokens = batch.lengths.iter().sum::<i64>() as u64;
        Ok(Trained { steps, tokens, timing })
    }

    /// Colocated runs, before the generators take the GPU: the optimiser's state (and, with
    /// `weights`, the policy's parameters and gradients) moved to host memory. Returns the
    /// bytes moved (none on a CPU device, where everything already is).
    pub fn offload(&self, weights: bool) -> Result<u64> {
        let mut bytes = self.optimizer.move_state(Device::Cpu)?;
        if weights {
            bytes += self.move_weights(Device::Cpu)?;
        }
        if let Some(critic) = &self.critic {
            bytes += critic.move_to(Device::Cpu, weights)?;
        }
        // What was freed goes back to the driver, for the generators on the same GPU.
        keel_model::device::return_cached_memory(self.device)?;
        Ok(bytes)
    }

    /// Everything [`Engine::offload`] moved, back on the training device.
    pub fn onload(&self) -> Result<u64> {
        let critic = match &self.critic {
            Some(critic) => critic.move_to(self.device, true)?,
            None => 0,
        };
        Ok(self.move_weights(self.device)? + self.optimizer.move_state(self.device)? + critic)
    }

    /// The policy's parameters with their gradients (and a reward model's value head).
    fn move_weights(&self, device: Device) -> Result<u64> {
        let mut tensors: Vec<Tensor> = self.policy.parameters().into_iter().map(|(_, p, _)| p).collect();
        if self.policy.lora().is_some() {
            tensors.extend(self.policy.trainable_parameters().into_iter().map(|(_, p, _)| p));
        }
        tensors.extend(self.value_head.iter().map(Tensor::shallow_clone));
        move_with_gradients(&tensors, device)
    }

    /// The policy's parameters (weights only, by Hugging Face name, in name order), packed in
    /// buckets of `kind` of at most `bucket_bytes`, for a refit in memory: host buffers, files
    /// written in place in a directory (in shared memory), or one buffer on the policy's
    /// device (for CUDA IPC, or the collective transfer), as `to` says. Under LoRA, only the
    /// adapters (the generators keep the base). Under tensor parallelism every rank calls it
    /// (each takes part in the gathers) and rank 0 returns the buckets; the others return
    /// none.
    pub fn export(
        &self,
        kind: tch::Kind,
        bucket_bytes: u64,
        to: &keel_model::packing::PackTarget,
    ) -> Result<keel_model::packing::Packed> {
        use keel_model::packing::{PackTarget, Packed, pack, pack_on_device, pack_to_files};
        // The training device, even while a colocated trainer's weights are in host memory.
        let device = self.device;
        if *to == PackTarget::Device && !device.is_cuda() {
            return Err(Error::InvalidRequest(format!(
                "an export for CUDA IPC stays in GPU memory, and this policy trains on {device:?}"
            )));
        }
        // Every data-parallel replica holds the same weights: the first one exports them.
        if self.data.as_ref().is_some_and(|d| d.rank() != 0) {
            return Ok(Packed::default());
        }
        let packed = self.policy.with_full(|full| {
            let mut tensors: Vec<(String, Tensor)> = match full.lora() {
                Some(_) => full.adapter_tensors(),
                None => full.var_store().variables().into_iter().collect(),
            };
            tensors.sort_by(|a, b| a.0.cmp(&b.0));
            let _no_grad = tch::no_grad_guard();
            Ok::<_, Error>(match to {
                PackTarget::Files(dir) => Packed::Files(pack_to_files(&tensors, kind, bucket_bytes, dir)?),
                PackTarget::Memory => Packed::Memory(pack(&tensors, kind, bucket_bytes)?),
                PackTarget::Device | PackTarget::Buffer => {
                    Packed::Device(pack_on_device(&tensors, kind, bucket_bytes, device)?)
                }
            })
        })?;
        Ok(packed.unwrap_or_default())
    }

    /// Writes a checkpoint directory at `path` (see [`checkpoint`]). Under tensor
    /// parallelism every rank calls it: the weights and optimiser state are gathered into
    /// the whole model's layout and rank 0 writes them (the others return no files).
    pub fn save(&self, path: &Path, info: serde_json::Value) -> Result<Vec<String>> {
        let state = checkpoint::TrainerState {
            format: checkpoint::FORMAT.into(),
            step: self.optimizer.step_count(),
            seed: self.seed,
            compute_dtype: keel_model::weights::dtype_name(self.policy.kind()).into(),
            training: self.config.clone(),
            reference: self.reference_path.as_ref().map(|p| p.display().to_string()),
            info,
        };
        // Under TP every rank takes part in each gather; rank 0 keeps the whole tensors, on
        // the CPU, for the file.
        // Under data parallelism the owners send their optimiser state to every rank, and
        // the first replica writes the checkpoint.
        let state_tensors = self.optimizer.gathered_state()?;
        let critic_tensors = self.critic.as_ref().map(Critic::gathered_state).transpose()?;
        if self.data.as_ref().is_some_and(|d| d.rank() != 0) {
            return Ok(Vec::new());
        }
        let optimizer_state = checkpoint::whole_optimizer_state(&self.policy, state_tensors)?;
        let critic_state = match (&self.critic, critic_tensors) {
            (Some(critic), Some(tensors)) => Some(critic.whole(tensors)?),
            _ => None,
        };
        let head = self.value_head.as_ref();
        let critic_trainer_state = self.critic.as_ref().map(|c| c.state(self.seed, &self.config));
        let critic_state = critic_state.as_ref().map(|(tensors, whole)| (tensors, whole.as_ref()));
        let files = self.policy.with_full(|full| {
            let weights = match full.lora() {
                Some(_) => checkpoint::Weights::Adapters { model: full, base: &self.base },
                None => checkpoint::Weights::Whole(full),
            };
            let policy = checkpoint::Part {
                source: &self.source,
                weights,
                value_head: head,
                optimizer_state: &optimizer_state,
                state: &state,
            };
            let critic = match (&self.critic, critic_state, &critic_trainer_state) {
                (Some(critic), Some((tensors, whole)), Some(state)) => Some(critic.part(tensors, whole, state)?),
                _ => None,
            };
            checkpoint::save(path, policy, critic)
        })?;
        Ok(files.unwrap_or_default())
    }
}

/// Runs `pass` (forward, loss and backward of one microbatch, given its rows as numbered in
/// `global`, for error messages) over this rank's microbatches of `global` as `plan` splits
/// them: every row without data parallelism, this rank's share with. Under data parallelism
/// the gradients of `trainable` and the metrics are then summed over the group; when one rank
/// fails they all fail (every rank of the group calls it).
fn accumulate(
    global: &Batch,
    plan: &dyn Fn(&[i64]) -> Vec<Vec<usize>>,
    pass: &mut dyn FnMut(&Batch, &[usize]) -> Result<Metrics>,
    trainable: &[Tensor],
    data: Option<&SharedComm>,
    device: Device,
) -> Result<Metrics> {
    let shard = match data {
        Some(data) => {
            let rows: Vec<usize> = crate::dp::shard(global.len(), data.rank(), data.world_size()).collect();
            Some((global.select(&rows)?, rows))
        }
        None => None,
    };
    // This rank's rows, numbered as in the global batch (for error messages).
    let (mine, numbers) = match &shard {
        Some((batch, rows)) => (batch, rows.clone()),
        None => (global, (0..global.len()).collect()),
    };
    let mut metrics = Metrics::default();
    let microbatches = if mine.is_empty() { Vec::new() } else { plan(&mine.lengths) };
    let passes: Result<()> = microbatches.into_iter().try_for_each(|rows| {
        let micro = mine.select(&rows)?;
        let numbered: Vec<usize> = rows.iter().map(|&r| numbers[r]).collect();
        metrics.merge(pass(&micro, &numbered)?);
        Ok(())
    });
    if let Some(data) = data {
        if !crate::dp::all_succeeded(passes.is_ok(), data.as_ref(), device)? {
            passes?;
            return Err(Error::Collective(keel_collective::Error::Aborted {
                rank: data.rank(),
                operation: "accumulate_gradients",
                reason: "another data-parallel rank failed this step".into(),
            }));
        }
        let grads = defined_gradients(trainable, device)?;
        crate::dp::all_reduce_gradients(&grads, data.as_ref())?;
        metrics = crate::dp::combine_metrics(metrics, data.as_ref(), device)?;
    }
    passes?;
    Ok(metrics)
}

/// The gradient of every tensor of `params`, zeros where none was computed (a data-parallel
/// rank with no rows this step), so that every rank has the same list.
fn defined_gradients(params: &[Tensor], device: Device) -> Result<Vec<Tensor>> {
    let missing: Vec<&Tensor> = params.iter().filter(|p| !p.grad().defined()).collect();
    if !missing.is_empty() {
        let mut zero = Tensor::f_zeros([], (Kind::Float, device))?;
        for p in missing {
            zero = zero.f_add(&p.f_sum(Kind::Float)?.f_mul_scalar(0.0)?)?;
        }
        zero.f_backward()?;
    }
    Ok(params.iter().map(Tensor::grad).collect())
}

/// Moves `tensors` and their gradients to `device` in place; returns the bytes moved.
pub(crate) fn move_with_gradients(tensors: &[Tensor], device: Device) -> Result<u64> {
    let grads: Vec<Tensor> = tensors.iter().map(Tensor::grad).filter(Tensor::defined).collect();
    Ok(keel_model::device::move_in_place(tensors.iter().chain(&grads), device)?)
}

/// A mixture of experts' router load-balancing loss (transformers' `aux_loss`, a mean over the
/// microbatch's tokens) added to a microbatch's `loss` with the microbatch's share of the
/// global batch's sequences, so the step trains their weighted mean; `router_aux_loss` in
/// the metrics is that mean whether or not the config trains it.
fn with_router_loss(
    loss: Tensor,
    tape: &Tape,
    sample_mask: &Tensor,
    global: &GlobalCounts,
    metrics: &mut Metrics,
) -> Result<Tensor> {
    let Some(aux) = tape.router_aux_loss() else { return Ok(loss) };
    let share = sample_mask.f_sum(Kind::Double)?.f_double_value(&[])? / global.sequences.max(1.0);
    metrics.sum("router_aux_loss", aux.f_double_value(&[])? * share);
    Ok(match tape.router_loss()? {
        Some(term) => loss.f_add(&term.f_mul_scalar(share)?)?,
        None => loss,
    })
}
