//! Running one run: what every algorithm shares (start or resume, the trainer, recording
//! steps, checkpoints, publishing weights to the generators, stopping on cancel) and the
//! algorithms themselves.
//!
//! Layout:
//! - [`tokens`]: prompts, SFT examples and preference pairs as token ids.
//! - [`rollout`]: multi-turn rollouts through the generator and reward queue groups, and
//!   validation (accuracy, pass@k).
//! - [`grpo`]: the GRPO step (DAPO options included).
//! - [`supervised`]: SFT, DPO and reward-model steps.
//! - [`eval`]: generation and scoring only.
//!
//! Resume: a run starts from its latest checkpoint in the checkpoint service when it has one
//! (weights, optimiser and scheduler through the trainer, the dataloader position and step
//! from the checkpoint's info), and everything recorded after that step is forgotten first,
//! so the steps done again are recorded once.

pub mod eval;
pub mod grpo;
pub mod rollout;
pub mod supervised;
pub mod tokens;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use keel_client::checkpoint::{CheckpointClient, NewCheckpoint};
use keel_protocol::checkpoint::Retention;
use keel_protocol::generator::{
    MemoryAction, MemoryChange, MemoryReport, WeightBuckets, WeightsLoaded, WeightsUpdated,
};
use keel_protocol::run::{RunEvent, RunSpec, RunStatus};
use keel_protocol::trainer::{
    ExportReply, ExportRequest, LoadReply, LoadRequest, MemoryMoved, ModelSource, OffloadRequest, OnloadRequest,
    SaveReply, SaveRequest,
};
use sqlx::PgPool;
use uuid::Uuid;

use crate::clients::{CallError, Nats, Trainer};
use crate::data::Position;
use crate::db;

/// Why a driver stopped before the end.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Stop {
    #[error("cancelled by request")]
    Cancelled,
    /// Another orchestrator took the run over (this one missed its lease).
    #[error("the run was taken over by another orchestrator")]
    Lost,
    #[error("{0}")]
    Failed(String),
}

impl From<CallError> for Stop {
    fn from(e: CallError) -> Self {
        Self::Failed(e.to_string())
    }
}

impl From<keel_protocol::FieldError> for Stop {
    fn from(e: keel_protocol::FieldError) -> Self {
        Self::Failed(e.to_string())
    }
}

impl From<keel_service::BulkError> for Stop {
    fn from(e: keel_service::BulkError) -> Self {
        Self::Failed(e.to_string())
    }
}

impl From<sqlx::Error> for Stop {
    fn from(e: sqlx::Error) -> Self {
        Self::Failed(format!("database: {e}"))
    }
}

impl From<keel_client::Error> for Stop {
    fn from(e: keel_client::Error) -> Self {
        Self::Failed(format!("checkpoint service: {e}"))
    }
}

pub type Result<T, E = Stop> = std::result::Result<T, E>;

const RUNNING: u8 = 0;
const CANCELLED: u8 = 1;
const LOST: u8 = 2;

/// Set by the run's heartbeat task, read by the driver between phases.
#[derive(Debug, Clone, Default)]
pub struct StopFlag(Arc<AtomicU8>);

impl StopFlag {
    pub fn set_cancelled(&self) {
        let _ = self.0.compare_exchange(RUNNING, CANCELLED, Ordering::SeqCst, Ordering::SeqCst);
    }

    pub fn set_lost(&self) {
        self.0.store(LOST, Ordering::SeqCst);
    }

    pub fn check(&self) -> Result<()> {
        match self.0.load(Ordering::SeqCst) {
            RUNNING => Ok(()),
            CANCELLED => Err(Stop::Cancelled),
            _ => Err(Stop::Lost),
        }
    }
}

/// The run's calls that are waiting for a dependency past the grace period (see
/// [`keel_client::retry::Watcher`]); the heartbeat shows the run `waiting` while there are
/// any, and a cancelled or lost run stops waiting.
#[derive(Debug)]
pub struct Waits {
    stop: StopFlag,
    /// Calls waiting now, and the reason the latest one gave.
    state: std::sync::Mutex<(usize, String)>,
}

impl Waits {
    pub fn new(stop: StopFlag) -> Self {
        Self { stop, state: std::sync::Mutex::new((0, String::new())) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, String)> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// What the run is waiting for, if it is.
    pub fn reason(&self) -> Option<String> {
        let state = self.lock();
        (state.0 > 0).then(|| state.1.clone())
    }
}

impl keel_client::retry::Watcher for Waits {
    fn wait_started(&self, reason: &str) {
        let mut state = self.lock();
        state.0 += 1;
        state.1 = reason.to_string();
    }

    fn keep_waiting(&self) -> bool {
        self.stop.check().is_ok()
    }

    fn wait_ended(&self) {
        let mut state = self.lock();
        state.0 = state.0.saturating_sub(1);
    }
}

/// Everything a driver works with.
#[derive(Debug)]
pub struct RunContext {
    pub id: Uuid,
    pub spec: RunSpec,
    /// This claim of the run (see `db`'s ownership): the fence on every write.
    pub owner: Uuid,
    pub pool: PgPool,
    pub nats: Nats,
    pub trainer: Option<Trainer>,
    pub checkpoints: CheckpointClient,
    /// This run's scratch directory on the disk shared with the trainer and generators.
    pub run_dir: PathBuf,
    pub stop: StopFlag,
    /// The run's waits for dependencies (its `nats` and `checkpoints` report to it).
    pub waits: Arc<Waits>,
    /// The weights last announced, and when (a refusal announces them again, at most every
    /// [`REANNOUNCE_AFTER`]).
    pub announced: std::sync::Mutex<Option<(WeightsUpdated, Instant)>>,
}

/// The largest object a weights-only export packs tensors into.
pub const EXPORT_BUCKET_BYTES: u64 = 256 << 20;

/// How long a step's weight sync waits for a generator to report the new weights loaded.
pub const REFIT_WAIT: Duration = Duration::from_secs(60);

/// How long a generator gets to load announced weights before they are announced again.
pub const REANNOUNCE_AFTER: Duration = Duration::from_secs(2);

/// Where a run starts: its base model, and the checkpoint it resumes from, if any.
#[derive(Debug, Clone)]
pub struct Start {
    /// The HF directory the run began from (tokenizer, reference model).
    pub base_dir: PathBuf,
    /// The directory the policy loads from now (the base, or the resumed checkpoint).
    pub policy_dir: PathBuf,
    pub step: u64,
    pub position: Position,
    pub resumed: bool,
}

impl RunContext {
    pub fn trainer(&self) -> Result<&Trainer> {
        self.trainer.as_ref().ok_or_else(|| Stop::Failed("this run holds no trainer".into()))
    }

    /// Finds the base model (downloading a checkpoint once) and the latest checkpoint, and
    /// forgets what was recorded after it.
    pub async fn start(&self) -> Result<Start> {
        let base_dir = match (&self.spec.model.path, self.spec.model.checkpoint) {
            (Some(path), _) => PathBuf::from(path),
            (None, Some(id)) => {
                let dir = self.run_dir.join(format!("base-{id}"));
                if !dir.exists() {
                    self.checkpoints.download_dir(id, &dir).await?;
                }
                dir
            }
            (None, None) => return Err(Stop::Failed("the spec names no model".into())),
        };
        let latest = self.checkpoints.latest(&self.id.to_string()).await?;
        let start = match latest {
            Some(checkpoint) => {
                let dir = self.run_dir.join(format!("resume-step-{}", checkpoint.step));
                if !dir.exists() {
                    self.checkpoints.download_dir(checkpoint.id, &dir).await?;
                }
                let position = serde_json::from_value(checkpoint.info["dataloader"].clone()).map_err(|e| {
                    Stop::Failed(format!("checkpoint {} has no dataloader position: {e}", checkpoint.id))
                })?;
                Start { base_dir, policy_dir: dir, step: checkpoint.step, position, resumed: true }
            }
            None => {
                let policy_dir = base_dir.clone();
                Start { base_dir, policy_dir, step: 0, position: Position::default(), resumed: false }
            }
        };
        if !db::rewind(&mut *self.pool.acquire().await?, self.id, self.owner, start.step).await? {
            return Err(Stop::Lost);
        }
        if start.resumed {
            tracing::info!(run_id = %self.id, step = start.step, "resuming from the latest checkpoint");
        }
        Ok(start)
    }

    /// Loads the policy (and reference) on the trainer. A resumed run restores its
    /// optimiser and scheduler; a run starting from another run's checkpoint does not.
    pub async fn load_trainer(&self, start: &Start) -> Result<LoadReply> {
        let Some(training) = self.spec.training.clone() else {
            return Err(Stop::Failed("this run has no training section".into()));
        };
        let request = LoadRequest {
            run_id: self.id.to_string(),
            policy: ModelSource { path: start.policy_dir.to_string_lossy().into_owned() },
            reference: (!start.resumed).then(|| ModelSource { path: start.base_dir.to_string_lossy().into_owned() }),
            training,
            device: self.spec.device.clone(),
            dtype: self.spec.dtype.clone(),
            reference_offload: false,
            resume: start.resumed,
            seed: self.spec.seed,
            tensor_parallel_size: self.spec.tensor_parallel_size,
        };
        Ok(self.trainer()?.op(&request).await?)
    }

    /// Tells the API how many steps the run will take.
    pub async fn set_total_steps(&self, total: u64) -> Result<()> {
        Ok(db::set_total_steps(&mut *self.pool.acquire().await?, self.id, total).await?)
    }

    /// Records a finished step, or stops if the run is no longer this instance's.
    pub async fn record(&self, record: &db::StepRecord) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        if !db::record_step(&mut tx, self.id, self.owner, record).await? {
            return Err(Stop::Lost);
        }
        tx.commit().await?;
        let algorithm = self.spec.algorithm.name();
        for (name, seconds) in &record.metrics {
            if let Some(phase) = name.strip_prefix("timing/train/") {
                keel_service::metrics::observe(
                    "keel_step_phase_seconds",
                    "Time of each phase of a recorded training step (NeMo-RL's timing/train/* names).",
                    &[("algorithm", algorithm), ("phase", phase)],
                    *seconds,
                );
            }
        }
        Ok(())
    }

    /// Saves the trainer's state to `dir` (replacing a copy left by an attempt that stopped
    /// before uploading it).
    pub async fn save(&self, dir: &Path, step: u64, position: Position) -> Result<SaveReply> {
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| Stop::Failed(format!("cannot clear {}: {e}", dir.display())))?;
        }
        let request = SaveRequest {
            run_id: self.id.to_string(),
            path: dir.to_string_lossy().into_owned(),
            info: serde_json::json!({"run_step": step, "dataloader": position}),
        };
        Ok(self.trainer()?.op(&request).await?)
    }

    /// Uploads a saved directory as the run's checkpoint for `step`.
    pub async fn upload_checkpoint(
        &self,
        dir: &Path,
        step: u64,
        position: Position,
        metrics: BTreeMap<String, f64>,
    ) -> Result<Uuid> {
        let c = &self.spec.checkpointing;
        let retention = match (c.keep_top_k, &c.metric_name) {
            (Some(k), Some(metric)) => {
                Some(Retention { keep_top_k: k as usize, metric: metric.clone(), higher_is_better: c.higher_is_better })
            }
            _ => None,
        };
        let new = NewCheckpoint {
            run_id: self.id.to_string(),
            step,
            metrics,
            info: serde_json::json!({"run_step": step, "dataloader": position, "algorithm": self.spec.algorithm}),
            retention,
        };
        let checkpoint = self.checkpoints.upload_dir(dir, new).await?;
        let mut db = self.pool.acquire().await?;
        db::append_event(&mut db, self.id, &RunEvent::Checkpoint { step, checkpoint_id: checkpoint.id }).await?;
        Ok(checkpoint.id)
    }

    /// Tells every generator to serve `dir` as this run's weights at `version`.
    pub async fn publish_weights(&self, dir: &Path, version: u64) -> Result<Announcement> {
        let path = dir.to_string_lossy().into_owned();
        self.announce(WeightsUpdated { run_id: self.id.to_string(), version, path, weights: None }).await
    }

    /// Has the trainer export the policy's weights (weights only, in the run's dtype, in
    /// buckets in the object store) and tells every generator to serve them as `version`.
    /// Returns the export (the caller deletes its buckets once no generator needs them) and
    /// the announcement. With `shared_memory` the buckets are files in `/dev/shm` on the
    /// trainer's host. `serving_dtype` (what the generators said they serve in) wins over
    /// the run's dtype.
    pub async fn publish_exported_weights(
        &self,
        version: u64,
        shared_memory: bool,
        serving_dtype: Option<&str>,
    ) -> Result<(ExportReply, Announcement)> {
        let shared_dir = shared_memory.then(|| format!("{}/{}", keel_service::paths::SHARED_WEIGHTS_DIR, self.id));
        let request = ExportRequest {
            run_id: self.id.to_string(),
            dtype: serving_dtype.map(str::to_string).or_else(|| self.spec.dtype.clone()),
            bucket_bytes: EXPORT_BUCKET_BYTES,
            shared_dir,
        };
        let exported: ExportReply = self.trainer()?.op(&request).await?;
        let event = WeightsUpdated {
            run_id: self.id.to_string(),
            version,
            path: String::new(),
            weights: Some(exported.weights.clone()),
        };
        let announcement = self.announce(event).await?;
        Ok((exported, announcement))
    }

    /// Publishes `event` with a reply subject of its own, on which generators report when
    /// they have loaded it.
    async fn announce(&self, event: WeightsUpdated) -> Result<Announcement> {
        let reports = self.broadcast(self.nats.subjects.weights_updated(), &event, "weights").await?;
        let version = event.version;
        if let Ok(mut announced) = self.announced.lock() {
            *announced = Some((event, Instant::now()));
        }
        Ok(Announcement { version, reports, stop: self.stop.clone() })
    }

    /// Publishes `body` on `subject` (every generator hears it) with a reply subject of its
    /// own, and returns the subscription on which the answers come.
    async fn broadcast(
        &self,
        subject: String,
        body: &impl serde::Serialize,
        what: &str,
    ) -> Result<async_nats::Subscriber> {
        let failed = |e: &dyn std::fmt::Display| Stop::Failed(format!("cannot publish {what}: {e}"));
        let body = serde_json::to_vec(body).map_err(|e| Stop::Failed(e.to_string()))?;
        let client = &self.nats.client;
        let inbox = client.new_inbox();
        let replies = client.subscribe(inbox.clone()).await.map_err(|e| failed(&e))?;
        client
            .publish_with_reply_and_headers(subject, inbox, keel_telemetry::nats_headers(), body.into())
            .await
            .map_err(|e| failed(&e))?;
        client.flush().await.map_err(|e| failed(&e))?;
        Ok(replies)
    }

    /// Colocated runs: has the generators sleep or wake, and waits for the first one's
    /// answer (up to [`REFIT_WAIT`]); a failure it reports fails the run.
    pub async fn generator_memory(&self, action: MemoryAction) -> Result<()> {
        let change = MemoryChange {
            run_id: self.id.to_string(),
            action,
            offload_weights: self.spec.generation.colocated.generator_offload_weights,
        };
        let mut replies = self.broadcast(self.nats.subjects.generator_memory(), &change, "a memory change").await?;
        let answer = first_answer(&mut replies, REFIT_WAIT, &self.stop, |_: &MemoryReport| true).await?;
        match answer {
            Some(MemoryReport { error: Some(e), .. }) => {
                Err(Stop::Failed(format!("the generator could not {}: {e}", action.verb())))
            }
            Some(_) => Ok(()),
            None => {
                tracing::warn!(run_id = %self.id, "no generator answered {action:?} within {REFIT_WAIT:?}");
                Ok(())
            }
        }
    }

    /// Colocated runs: the trainer's optimiser state (and weights, by the spec) to host
    /// memory (`offload`), or back (`onload`).
    pub async fn trainer_memory(&self, offload: bool) -> Result<()> {
        let trainer = self.trainer()?;
        let moved: MemoryMoved = if offload {
            let weights = self.spec.generation.colocated.trainer_offload_weights;
            trainer.op(&OffloadRequest { run_id: self.id.to_string(), weights }).await?
        } else {
            trainer.op(&OnloadRequest { run_id: self.id.to_string() }).await?
        };
        tracing::debug!(run_id = %self.id, offload, bytes = moved.bytes, seconds = moved.seconds, "trainer memory moved");
        Ok(())
    }

    /// Announces the weights of `version` again unless that was done within
    /// [`REANNOUNCE_AFTER`]: the same announcement when it was of that version, else `dir`.
    pub async fn reannounce_weights(&self, dir: &Path, version: u64) -> Result<()> {
        let last = self.announced.lock().ok().and_then(|a| a.clone());
        match last {
            Some((_, at)) if at.elapsed() < REANNOUNCE_AFTER => Ok(()),
            Some((event, _)) if event.version == version => self.announce(event).await.map(drop),
            _ => self.publish_weights(dir, version).await.map(drop),
        }
    }

    /// Deletes exported weight buckets no generator needs any more (best effort: the object
    /// store expires them after a day anyway).
    pub async fn delete_exported(&self, weights: &WeightBuckets) {
        // Files in shared memory are the trainer's to delete (it keeps the newest three).
        for object in weights.buckets.iter().filter_map(|b| b.object.as_ref()) {
            if let Err(e) = self.nats.bulk.delete(object).await {
                tracing::warn!(run_id = %self.id, "cannot delete exported weights: {e}");
            }
        }
    }

    /// Whether `step` is a checkpoint step.
    pub fn saves_at(&self, step: u64, last: bool) -> bool {
        let c = &self.spec.checkpointing;
        c.enabled && (last || step.is_multiple_of(c.save_period.max(1)))
    }

    /// Whether `step` is a validation step.
    pub fn validates_at(&self, step: u64, last: bool) -> bool {
        let period = self.spec.validation.period;
        last || (period > 0 && step.is_multiple_of(period))
    }
}

/// Weights published to the generators, whose reports of loading them can be waited for.
#[derive(Debug)]
pub struct Announcement {
    version: u64,
    reports: async_nats::Subscriber,
    stop: StopFlag,
}

impl Announcement {
    /// The first generator's report of loading the announced version, waited for up to
    /// `limit` (None when no generator answered in time: the run's rollouts then wait for
    /// the weights themselves). A cancelled or lost run stops waiting.
    pub async fn first_report(mut self, limit: Duration) -> Result<Option<WeightsLoaded>> {
        let version = self.version;
        first_answer(&mut self.reports, limit, &self.stop, |r: &WeightsLoaded| r.version == version).await
    }
}

/// The first answer on `replies` that parses as a `T` that `wanted` accepts, waited for up
/// to `limit`; a cancelled or lost run stops waiting.
async fn first_answer<T: serde::de::DeserializeOwned>(
    replies: &mut async_nats::Subscriber,
    limit: Duration,
    stop: &StopFlag,
    wanted: impl Fn(&T) -> bool,
) -> Result<Option<T>> {
    use futures::StreamExt;
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        stop.check()?;
        let tick = (tokio::time::Instant::now() + Duration::from_secs(1)).min(deadline);
        match tokio::time::timeout_at(tick, replies.next()).await {
            Ok(Some(message)) => match serde_json::from_slice::<T>(&message.payload) {
                Ok(answer) if wanted(&answer) => return Ok(Some(answer)),
                Ok(_) => {}
                Err(e) => tracing::warn!("malformed answer ignored: {e}"),
            },
            Ok(None) => return Ok(None),
            Err(_) if tick >= deadline => return Ok(None),
            Err(_) => {}
        }
    }
}

/// Seconds since `since`.
pub fn seconds(since: Instant) -> f64 {
    since.elapsed().as_secs_f64()
}

/// Runs the run's algorithm to its end.
pub async fn drive(ctx: &RunContext) -> Result<()> {
    use keel_protocol::run::Algorithm;
    match ctx.spec.algorithm {
        Algorithm::Grpo => grpo::run(ctx).await,
        Algorithm::Sft | Algorithm::Dpo | Algorithm::Rm => supervised::run(ctx).await,
        Algorithm::Eval => eval::run(ctx).await,
    }
}

/// How a run ended, for the runs table.
pub fn outcome(result: &Result<()>) -> Option<(RunStatus, Option<String>)> {
    match result {
        Ok(()) => Some((RunStatus::Succeeded, None)),
        Err(Stop::Cancelled) => Some((RunStatus::Cancelled, Some("cancelled by request".into()))),
        Err(Stop::Failed(reason)) => Some((RunStatus::Failed, Some(reason.clone()))),
        Err(Stop::Lost) => None,
    }
}

/// Renews the run's lease (and the trainer's) until dropped; sets `stop` on cancel or loss;
/// shows the run `waiting` while its calls wait for a dependency, `running` when they no
/// longer do.
pub fn heartbeat(
    pool: PgPool,
    run_id: Uuid,
    owner: Uuid,
    trainer: Option<Trainer>,
    stop: StopFlag,
    waits: Arc<Waits>,
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        // What the database shows: waiting (true) or running.
        let mut shown_waiting = false;
        loop {
            tick.tick().await;
            match pool.acquire().await {
                Ok(mut db) => {
                    match db::heartbeat(&mut db, run_id, owner).await {
                        Ok(db::Lease::Held { cancel_requested: true }) => stop.set_cancelled(),
                        Ok(db::Lease::Held { .. }) => {}
                        Ok(db::Lease::Lost) => stop.set_lost(),
                        Err(e) => tracing::warn!(%run_id, "heartbeat failed: {e}"),
                    }
                    let reason = waits.reason();
                    if reason.is_some() != shown_waiting {
                        match db::set_waiting(&mut db, run_id, owner, reason.as_deref()).await {
                            Ok(true) => {
                                shown_waiting = reason.is_some();
                                match &reason {
                                    Some(reason) => tracing::warn!(%run_id, "run waiting: {reason}"),
                                    None => tracing::info!(%run_id, "run no longer waiting"),
                                }
                            }
                            Ok(false) => stop.set_lost(),
                            Err(e) => tracing::warn!(%run_id, "cannot show the run waiting: {e}"),
                        }
                    }
                }
                Err(e) => tracing::warn!(%run_id, "heartbeat failed: {e}"),
            }
            if let Some(trainer) = &trainer
                && let Err(e) = trainer.heartbeat().await
            {
                tracing::warn!(%run_id, worker = %trainer.worker, "trainer heartbeat failed: {e}");
            }
        }
    })
}
