//! The run's trainer worker, as the drivers use it: one method per trainer operation, each
//! request filled in from the run (its id, spec and temperature), large bodies through the
//! object store.

use std::path::Path;

use keel_protocol::run::{RunSpec, WeightTransfer};
use keel_protocol::trainer::{
    CriticLoad, EvaluateReply, EvaluateRequest, ExportReply, ExportRequest, ExportTo, LoadReply, LoadRequest,
    LogprobsReply, LogprobsRequest, MemoryMoved, ModelSource, OffloadRequest, OnloadRequest, SaveReply, SaveRequest,
    Scorer, Sequences, TrainBatch, TrainReply, TrainRequest,
};

use super::{EXPORT_BUCKET_BYTES, Result, Start, Stop};
use crate::clients::Trainer;
use crate::data::Position;

#[derive(Debug, Clone, Copy)]
pub struct TrainerSession<'a> {
    trainer: &'a Trainer,
    run_id: uuid::Uuid,
    spec: &'a RunSpec,
}

impl<'a> TrainerSession<'a> {
    pub fn new(trainer: &'a Trainer, run_id: uuid::Uuid, spec: &'a RunSpec) -> Self {
        Self { trainer, run_id, spec }
    }

    fn run_id(&self) -> String {
        self.run_id.to_string()
    }

    /// Loads the policy (and reference) on the trainer. A resumed run restores its
    /// optimiser and scheduler; a run starting from another run's checkpoint does not.
    pub async fn load(&self, start: &Start) -> Result<LoadReply> {
        let Some(training) = self.spec.training.clone() else {
            return Err(Stop::Failed("this run has no training section".into()));
        };
        let critic = self.critic(start, &training);
        let request = LoadRequest {
            run_id: self.run_id(),
            policy: ModelSource { path: start.policy_dir.to_string_lossy().into_owned() },
            reference: self.reference(start),
            training,
            device: self.spec.device.clone(),
            dtype: self.spec.dtype.clone(),
            reference_offload: false,
            resume: start.resumed,
            seed: self.spec.seed,
            tensor_parallel_size: self.spec.tensor_parallel_size,
            data_parallel_size: self.spec.data_parallel_size,
            critic,
        };
        Ok(self.trainer.op(&request).await?)
    }

    /// PPO's critic: a new one on `start.critic_dir` (a resumed run's checkpoint holds its
    /// own, which the trainer loads instead).
    fn critic(&self, start: &Start, training: &keel_protocol::training::TrainingConfig) -> Option<CriticLoad> {
        let ppo = self.spec.ppo.as_ref()?;
        let dir = start.critic_dir.as_ref()?;
        Some(CriticLoad {
            model: ModelSource { path: dir.to_string_lossy().into_owned() },
            optimizer: ppo.optimizer.clone().unwrap_or_else(|| training.optimizer.clone()),
            value_clip: ppo.value_clip,
            warmup_steps: ppo.critic_warmup_steps,
        })
    }

    /// The reference the trainer loads: the teacher when distilling; else the base model,
    /// when the loss needs one (a KL penalty) and the run does not resume (a resumed run keeps
    /// the one it was trained against).
    fn reference(&self, start: &Start) -> Option<ModelSource> {
        let source = |dir: &std::path::Path| ModelSource { path: dir.to_string_lossy().into_owned() };
        if let Some(teacher) = &start.teacher_dir {
            return Some(source(teacher));
        }
        let needed = self.spec.training.as_ref().is_some_and(|t| t.loss.needs_reference());
        (needed && !start.resumed).then(|| source(&start.base_dir))
    }

    /// The logprobs of `model` (the policy or the reference) on `sequences`, at the
    /// sampling temperature.
    pub async fn logprobs(&self, model: Scorer, sequences: &Sequences) -> Result<Vec<Vec<f32>>> {
        let request = LogprobsRequest {
            run_id: self.run_id(),
            model,
            batch: self.trainer.bulk().wrap(sequences.clone()).await?,
            temperature: self.spec.generation.temperature,
        };
        let reply: LogprobsReply = self.trainer.op(&request).await?;
        Ok(self.trainer.bulk().fetch(reply.logprobs).await?.logprobs)
    }

    /// One train call on `batch` (the optimiser steps of a global batch), its logits divided
    /// by `temperature` (GRPO's sampling temperature; 1 for supervised losses).
    pub async fn train(&self, batch: TrainBatch, temperature: f64) -> Result<TrainReply> {
        let request =
            TrainRequest { run_id: self.run_id(), batch: self.trainer.bulk().wrap(batch).await?, temperature };
        Ok(self.trainer.op(&request).await?)
    }

    /// The loss on `batch` without an update (validation), logits at temperature 1.
    pub async fn evaluate(&self, batch: TrainBatch) -> Result<EvaluateReply> {
        let request =
            EvaluateRequest { run_id: self.run_id(), batch: self.trainer.bulk().wrap(batch).await?, temperature: 1.0 };
        Ok(self.trainer.op(&request).await?)
    }

    /// Saves the trainer's state to `dir` (replacing a copy left by an attempt that stopped
    /// before uploading it: a whole checkpoint, removed on the blocking pool).
    pub async fn save(&self, dir: &Path, step: u64, position: Position) -> Result<SaveReply> {
        if tokio::fs::try_exists(dir).await.unwrap_or(false) {
            tokio::fs::remove_dir_all(dir)
                .await
                .map_err(|e| Stop::Failed(format!("cannot clear {}: {e}", dir.display())))?;
        }
        let request = SaveRequest {
            run_id: self.run_id(),
            path: dir.to_string_lossy().into_owned(),
            info: serde_json::json!({"run_step": step, "dataloader": position}),
        };
        Ok(self.trainer.op(&request).await?)
    }

    /// Exports the policy's weights (weights only, in buckets) as `transfer` says: in the
    /// object store, as files in `/dev/shm` on the trainer's host, or in the trainer's GPU
    /// memory for CUDA IPC. `serving_dtype` (what the generators said they serve in) wins
    /// over the run's dtype.
    pub async fn export(&self, transfer: WeightTransfer, serving_dtype: Option<&str>) -> Result<ExportReply> {
        let to = match transfer {
            WeightTransfer::SharedMemory => {
                ExportTo::SharedMemory { dir: format!("{}/{}", keel_service::paths::SHARED_WEIGHTS_DIR, self.run_id) }
            }
            WeightTransfer::CudaIpc => ExportTo::CudaIpc,
            WeightTransfer::Collective => ExportTo::Collective,
            WeightTransfer::Memory | WeightTransfer::Directory => ExportTo::ObjectStore,
        };
        let request = ExportRequest {
            run_id: self.run_id(),
            dtype: serving_dtype.map(str::to_string).or_else(|| self.spec.dtype.clone()),
            bucket_bytes: EXPORT_BUCKET_BYTES,
            to,
        };
        Ok(self.trainer.op(&request).await?)
    }

    /// Colocated runs: the trainer's optimiser state (and weights, by the spec) to host
    /// memory (`offload`), or back (`onload`).
    pub async fn move_memory(&self, offload: bool) -> Result<()> {
        let moved: MemoryMoved = if offload {
            let weights = self.spec.generation.colocated.trainer_offload_weights;
            self.trainer.op(&OffloadRequest { run_id: self.run_id(), weights }).await?
        } else {
            self.trainer.op(&OnloadRequest { run_id: self.run_id() }).await?
        };
        tracing::debug!(run_id = %self.run_id, offload, bytes = moved.bytes, seconds = moved.seconds, "trainer memory moved");
        Ok(())
    }
}
