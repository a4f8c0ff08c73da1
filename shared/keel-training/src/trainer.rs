//! [`Trainer`]: what the worker drives: the run's engines, one per rank, each on a thread of
//! its own in a [`RankGroup`], every call run on all of them at once (the ranks meet in
//! their collectives). In one process the ranks are a DP × TP grid (rank d·TP + t is
//! tensor-parallel rank t of data-parallel replica d; one rank when both are 1), each
//! holding its slices of the models and optimiser. A rank whose process is one of a group
//! of processes (one per GPU, on one machine or several) is a trainer of one engine over
//! communicators that cross processes ([`Trainer::of_process`]); its process keeps it in
//! step with the others. Rank 0's answer is returned; any rank's error fails the call.

use std::path::{Path, PathBuf};

use keel_collective::{RankGroup, SharedComm, rank_zero};
use keel_protocol::trainer::{LoadRequest, Scorer, TrainBatch};
use keel_protocol::training::TrainingConfig;
use tch::Device;

use crate::batch::Batch;
use crate::engine::{Engine, Evaluated, Trained};
use crate::error::{Error, Result};

/// The most tensor-parallel ranks a trainer runs.
pub const MAX_TENSOR_PARALLEL: usize = 64;

#[derive(Debug)]
pub struct Trainer {
    group: RankGroup<Engine>,
    /// Rank 0's answers to what does not change between calls (the step: until it trains).
    summary: Summary,
}

#[derive(Debug)]
struct Summary {
    tensor_parallel_size: usize,
    data_parallel_size: usize,
    config: TrainingConfig,
    parameters: i64,
    step: u64,
    has_reference: bool,
    has_value_head: bool,
    lora_base: Option<PathBuf>,
}

impl Summary {
    fn of(engine: &Engine) -> Self {
        Self {
            tensor_parallel_size: engine.policy().world_size(),
            data_parallel_size: engine.data_parallel_size(),
            config: engine.config().clone(),
            parameters: engine.parameters(),
            step: engine.step(),
            has_reference: engine.has_reference(),
            has_value_head: engine.has_value_head(),
            lora_base: engine.lora_base().map(Path::to_path_buf),
        }
    }
}

/// The communicators of a DP × TP grid on `device`, in rank order (d·TP + t): each rank's
/// tensor-parallel group (the ranks of its replica; `None` at TP 1) and data-parallel group
/// (the ranks with its tensor-parallel rank; `None` at DP 1).
type GridComms = (Option<SharedComm>, Option<SharedComm>);

fn grid(dp: usize, tp: usize, device: Device) -> Result<Vec<GridComms>> {
    let on = |ranks: Vec<usize>| -> Result<Vec<SharedComm>> {
        let devices: Vec<Device> = ranks.iter().map(|&r| keel_collective::rank_device(device, r)).collect();
        keel_collective::new_group_on(&devices).map_err(|e| Error::InvalidConfig(format!("parallel ranks: {e}")))
    };
    let mut comms: Vec<GridComms> = (0..dp * tp).map(|_| (None, None)).collect();
    if tp > 1 {
        for d in 0..dp {
            for (t, comm) in on((0..tp).map(|t| d * tp + t).collect())?.into_iter().enumerate() {
                comms[d * tp + t].0 = Some(comm);
            }
        }
    }
    if dp > 1 {
        for t in 0..tp {
            for (d, comm) in on((0..dp).map(|d| d * tp + t).collect())?.into_iter().enumerate() {
                comms[d * tp + t].1 = Some(comm);
            }
        }
    }
    Ok(comms)
}

/// Rank 0's value, or the error that started a failure (not a peer's timeout after it).
fn first<T>(results: Vec<keel_collective::Result<Result<T>>>) -> Result<T> {
    rank_zero(results, Error::is_consequence)
}

impl Trainer {
    /// Loads the models for `request`, split over `request.tensor_parallel_size` ranks in
    /// each of `request.data_parallel_size` replicas.
    pub fn load(request: &LoadRequest, default_device: &str) -> Result<Self> {
        let (tp, dp) = (request.tensor_parallel_size, request.data_parallel_size);
        if !(1..=MAX_TENSOR_PARALLEL).contains(&tp) {
            return Err(Error::InvalidConfig(format!(
                "tensor_parallel_size must be 1 to {MAX_TENSOR_PARALLEL}, got {tp}"
            )));
        }
        if !(1..=MAX_TENSOR_PARALLEL).contains(&dp) || dp * tp > MAX_TENSOR_PARALLEL {
            return Err(Error::InvalidConfig(format!(
                "data_parallel_size × tensor_parallel_size must be at most {MAX_TENSOR_PARALLEL}, got {dp} × {tp}"
            )));
        }
        let comms = if tp == 1 && dp == 1 {
            vec![(None, None)]
        } else {
            let device_name = request.device.as_deref().unwrap_or(default_device);
            let device =
                keel_model::device::parse_device(device_name).map_err(|e| Error::InvalidConfig(e.to_string()))?;
            grid(dp, tp, device)?
        };
        let (request, default_device) = (request.clone(), default_device.to_string());
        Self::spawn(comms, move |(tensor, data)| Engine::load_group(&request, &default_device, tensor, data))
    }

    /// One rank of a group of processes: its engine, loaded on `device` with its
    /// tensor-parallel (`tensor`) and data-parallel (`data`) communicators, which cross
    /// processes.
    pub fn of_process(
        request: &LoadRequest,
        device: Device,
        tensor: Option<SharedComm>,
        data: Option<SharedComm>,
    ) -> Result<Self> {
        let request = request.clone();
        Self::spawn(vec![(tensor, data)], move |(tensor, data)| Engine::load_on(&request, device, tensor, data))
    }

    /// The group of one engine per item of `comms`, each made by `load` on its own thread.
    fn spawn(
        comms: Vec<GridComms>,
        load: impl Fn(GridComms) -> Result<Engine> + Send + Clone + 'static,
    ) -> Result<Self> {
        let group = RankGroup::spawn("keel-trainer", comms, move |_, comms| load(comms))?;
        let summary = first(group.run_all((), |engine, ()| Ok(Summary::of(engine))))?;
        Ok(Self { group, summary })
    }

    pub fn tensor_parallel_size(&self) -> usize {
        self.summary.tensor_parallel_size
    }

    pub fn data_parallel_size(&self) -> usize {
        self.summary.data_parallel_size
    }

    pub fn parameters(&self) -> i64 {
        self.summary.parameters
    }

    pub fn step(&self) -> u64 {
        self.summary.step
    }

    pub fn has_reference(&self) -> bool {
        self.summary.has_reference
    }

    pub fn has_value_head(&self) -> bool {
        self.summary.has_value_head
    }

    pub fn config(&self) -> &TrainingConfig {
        &self.summary.config
    }

    /// Per-token logprobs of `sequences` under the policy or the reference.
    pub fn logprobs(&mut self, scorer: Scorer, sequences: Vec<Vec<i64>>, temperature: f64) -> Result<Vec<Vec<f32>>> {
        first(self.group.run_all(sequences, move |engine, sequences| engine.logprobs(scorer, &sequences, temperature)))
    }

    /// Reward-model scores (value heads are refused at load under TP; every data-parallel
    /// replica holds the whole model and scores alike).
    pub fn scores(&self, sequences: &[Vec<i64>]) -> Result<Vec<f32>> {
        first(self.group.run_all(sequences.to_vec(), |engine, sequences| engine.scores(&sequences)))
    }

    /// Trains on the wire batch `batch` (each rank builds its own tensors from it).
    pub fn train(&mut self, batch: TrainBatch, temperature: f64) -> Result<Trained> {
        let trained = first(self.group.run_all(batch, move |engine, batch| {
            let batch = Batch::new(&batch, &engine.config().loss)?;
            engine.train(batch, temperature)
        }));
        // A failed call may still have stepped; read the step back either way.
        self.summary.step = first(self.group.run_all((), |engine, ()| Ok(engine.step())))?;
        trained
    }

    /// The loss on the wire batch `batch` without an update (see [`Engine::evaluate`]).
    pub fn evaluate(&mut self, batch: TrainBatch, temperature: f64) -> Result<Evaluated> {
        first(self.group.run_all(batch, move |engine, batch| {
            let batch = Batch::new(&batch, &engine.config().loss)?;
            engine.evaluate(batch, temperature)
        }))
    }

    /// The model directory a LoRA run's adapters sit on (`None` without LoRA).
    pub fn lora_base(&self) -> Option<&std::path::Path> {
        self.summary.lora_base.as_deref()
    }

    /// Writes a checkpoint at `path`; returns the optimiser step and the files written.
    pub fn save(&mut self, path: PathBuf, info: serde_json::Value) -> Result<(u64, Vec<String>)> {
        let files = first(self.group.run_all((path, info), |engine, (path, info)| engine.save(&path, info)))?;
        Ok((self.summary.step, files))
    }

    /// The policy's weights in buckets (see [`Engine::export`]); with the optimiser step.
    /// `kind` None exports in the policy's own dtype; the dtype used is returned.
    pub fn export(
        &mut self,
        kind: Option<tch::Kind>,
        bucket_bytes: u64,
        to: keel_model::packing::PackTarget,
    ) -> Result<(u64, tch::Kind, keel_model::packing::Packed)> {
        let exported = first(self.group.run_all((kind, bucket_bytes, to), |engine, (kind, bytes, to)| {
            let kind = kind.unwrap_or(engine.policy().kind());
            Ok((kind, engine.export(kind, bytes, &to)?))
        }))?;
        Ok((self.summary.step, exported.0, exported.1))
    }

    /// [`Engine::offload`] on every rank; the bytes are rank 0's.
    pub fn offload(&mut self, weights: bool) -> Result<u64> {
        self.on_every_rank(move |engine| engine.offload(weights))
    }

    /// [`Engine::onload`] on every rank; the bytes are rank 0's.
    pub fn onload(&mut self) -> Result<u64> {
        self.on_every_rank(|engine| engine.onload())
    }

    /// Runs `f` on every rank's engine and returns rank 0's result: for tests and
    /// diagnostics that need an engine method.
    pub fn on_every_rank<T: Send + 'static>(
        &mut self,
        f: impl Fn(&mut Engine) -> Result<T> + Send + Clone + 'static,
    ) -> Result<T> {
        first(self.group.run_all((), move |engine, ()| f(engine)))
    }
}
