//! Running one run: what every algorithm shares (start or resume, the trainer, recording
//! steps, checkpoints, publishing weights to the generators, stopping on cancel) and the
//! algorithms themselves.
//!
//! Layout:
//! - [`store`]: the run's rows in Postgres, every write fenced by the run's claim.
//! - [`session`]: the run's trainer worker, one method per operation.
//! - [`weights`]: weights announced to the generators, their reports, sleep and wake.
//! - [`tokens`]: prompts, SFT examples and preference pairs as token ids.
//! - [`rollout`]: multi-turn rollouts through the generator and reward queue groups, and
//!   validation (accuracy, pass@k).
//! - [`grpo`]: the GRPO step (DAPO options included).
//! - [`async_grpo`]: GRPO with the next steps' rollouts generated while a step trains.
//! - [`supervised`]: SFT, DPO and reward-model steps.
//! - [`eval`]: generation and scoring only.
//!
//! Resume: a run starts from its latest checkpoint in the checkpoint service when it has one
//! (weights, optimiser and scheduler through the trainer, the dataloader position and step
//! from the checkpoint's info), and everything recorded after that step is forgotten first,
//! so the steps done again are recorded once.

pub mod agents;
pub mod async_grpo;
pub mod eval;
pub mod grpo;
pub mod rollout;
pub mod session;
pub mod store;
pub mod supervised;
pub mod tokens;
pub mod weights;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use keel_client::checkpoint::{CheckpointClient, NewCheckpoint};
use keel_protocol::checkpoint::Retention;
use keel_protocol::generator::LoadModel;
use keel_protocol::run::{RunEvent, RunSpec, RunStatus};
use sqlx::PgPool;
use uuid::Uuid;

use crate::clients::{CallError, Generator, Nats, Trainer};
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
const FAILED: u8 = 3;

/// Set by the run's heartbeat task, read by the driver between phases.
#[derive(Debug, Clone, Default)]
pub struct StopFlag(Arc<(AtomicU8, std::sync::Mutex<String>)>);

impl StopFlag {
    pub fn set_cancelled(&self) {
        let _ = self.0.0.compare_exchange(RUNNING, CANCELLED, Ordering::SeqCst, Ordering::SeqCst);
    }

    pub fn set_lost(&self) {
        self.0.0.store(LOST, Ordering::SeqCst);
    }

    /// The attempt cannot go on (a generator it holds is gone): it fails with `reason`, and
    /// is retried from the latest checkpoint while it has attempts left.
    pub fn set_failed(&self, reason: String) {
        let mut why = self.0.1.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.0.0.compare_exchange(RUNNING, FAILED, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            *why = reason;
        }
    }

    pub fn check(&self) -> Result<()> {
        match self.0.0.load(Ordering::SeqCst) {
            RUNNING => Ok(()),
            CANCELLED => Err(Stop::Cancelled),
            FAILED => Err(Stop::Failed(self.0.1.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone())),
            _ => Err(Stop::Lost),
        }
    }

    /// Awaits `work`, giving up as soon as the run is stopped (looked at every second).
    pub async fn guard<T>(&self, work: impl std::future::Future<Output = T>) -> Result<T> {
        let mut work = std::pin::pin!(work);
        loop {
            self.check()?;
            if let Ok(out) = tokio::time::timeout(Duration::from_secs(1), &mut work).await {
                return Ok(out);
            }
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

/// What a driver works with: the run, and a facade for each party it talks to.
#[derive(Debug)]
pub struct RunContext {
    pub id: Uuid,
    pub spec: RunSpec,
    /// This claim of the run (see `db`'s ownership): the fence on every write.
    pub owner: Uuid,
    /// The run's rows.
    pub store: store::RunStore,
    /// Rollouts and scoring through the generator and reward queue groups.
    pub nats: Nats,
    pub trainer: Option<Trainer>,
    /// The generators the run holds (they load its model at start, and serve only it).
    pub generators: Vec<Generator>,
    /// The generators' side: weights announced, sleep and wake.
    pub weights: weights::WeightPublisher,
    pub checkpoints: CheckpointClient,
    /// This run's scratch directory on the disk shared with the trainer and generators.
    pub run_dir: PathBuf,
    pub stop: StopFlag,
    /// The run's waits for dependencies (its `nats` and `checkpoints` report to it).
    pub waits: Arc<Waits>,
}

/// A teacher distils only into a student that reads the same token ids, and a critic scores
/// only the token ids the policy samples: the `tokenizer.json` of the model named at `field`
/// must hold the same vocabulary, merges and added tokens as the student's (the policy's).
fn same_tokenizer(field: &str, student: &Path, teacher: &Path) -> Result<()> {
    let read = |dir: &Path| -> Result<serde_json::Value> {
        let file = dir.join("tokenizer.json");
        let text = std::fs::read_to_string(&file)
            .map_err(|e| Stop::Failed(format!("{field}: cannot read {}: {e}", file.display())))?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Stop::Failed(format!("{field}: {} is not JSON: {e}", file.display())))?;
        Ok(serde_json::json!([value["model"], value["added_tokens"]]))
    };
    if read(student)? != read(teacher)? {
        return Err(Stop::Failed(format!(
            "{field}: {} has another tokenizer than the policy ({}): it would read other tokens (models with \
             another tokenizer are not supported)",
            teacher.display(),
            student.display()
        )));
    }
    Ok(())
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
    /// With `distillation`: the teacher's HF directory (the trainer's reference).
    pub teacher_dir: Option<PathBuf>,
    /// With `ppo`: the HF directory a new critic starts from (a resumed run's checkpoint
    /// holds its critic).
    pub critic_dir: Option<PathBuf>,
}

impl RunContext {
    pub fn trainer(&self) -> Result<&Trainer> {
        self.trainer.as_ref().ok_or_else(|| Stop::Failed("this run holds no trainer".into()))
    }

    /// The run's trainer worker, for its operations.
    pub fn session(&self) -> Result<session::TrainerSession<'_>> {
        Ok(session::TrainerSession::new(self.trainer()?, self.id, &self.spec))
    }

    /// Finds the base model (downloading a checkpoint once) and the latest checkpoint, and
    /// forgets what was recorded after it.
    pub async fn start(&self) -> Result<Start> {
        let base_dir = self.model_dir(&self.spec.model, "model").await?;
        let teacher_dir = match &self.spec.distillation {
            Some(d) => {
                let dir = self.model_dir(&d.teacher, "distillation.teacher").await?;
                same_tokenizer("distillation.teacher", &base_dir, &dir)?;
                Some(dir)
            }
            None => None,
        };
        let critic_dir = match self.spec.ppo.as_ref().map(|p| &p.critic) {
            Some(Some(critic)) => {
                let dir = self.model_dir(critic, "ppo.critic").await?;
                same_tokenizer("ppo.critic", &base_dir, &dir)?;
                Some(dir)
            }
            Some(None) => Some(base_dir.clone()),
            None => None,
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
                Start {
                    base_dir,
                    policy_dir: dir,
                    step: checkpoint.step,
                    position,
                    resumed: true,
                    teacher_dir,
                    critic_dir,
                }
            }
            None => {
                // A run that saved checkpoints and finds none must not start again from its
                // base model: that would rewind its recorded history to step 0.
                if let Some((step, id)) = self.store.last_saved_checkpoint().await? {
                    return Err(Stop::Failed(format!(
                        "the run saved checkpoint {id} at step {step}, and the checkpoint store has no checkpoint \
                         of it now: resuming from the base model would rewind its history to step 0"
                    )));
                }
                let policy_dir = base_dir.clone();
                Start {
                    base_dir,
                    policy_dir,
                    step: 0,
                    position: Position::default(),
                    resumed: false,
                    teacher_dir,
                    critic_dir,
                }
            }
        };
        self.store.rewind(start.step).await?;
        if start.resumed {
            tracing::info!(run_id = %self.id, step = start.step, "resuming from the latest checkpoint");
        }
        Ok(start)
    }

    /// The directory of a model the spec names at `field` (a checkpoint downloaded once).
    async fn model_dir(&self, model: &keel_protocol::run::ModelRef, field: &str) -> Result<PathBuf> {
        Ok(match (&model.path, model.checkpoint) {
            (Some(path), _) => PathBuf::from(path),
            (None, Some(id)) => {
                let dir = self.run_dir.join(format!("base-{id}"));
                if !dir.exists() {
                    self.checkpoints.download_dir(id, &dir).await?;
                }
                dir
            }
            (None, None) => match &model.name {
                Some(name) => crate::spec::model_by_name(name, model.revision.as_deref())
                    .map_err(|e| Stop::Failed(format!("{field}.name: {e}")))?,
                None => return Err(Stop::Failed(format!("the spec names no {field}"))),
            },
        })
    }

    /// Has every generator the run holds load the model the run starts from (its base, or
    /// the checkpoint it resumes from, as weight version `start.step`). A model a generator
    /// cannot load fails the run here, with the loader's reason.
    pub async fn load_generators(&self, start: &Start) -> Result<()> {
        let g = &self.spec.generation;
        let request = LoadModel {
            run_id: self.id.to_string(),
            path: start.policy_dir.to_string_lossy().into_owned(),
            version: start.step,
            served_model_name: None,
            dtype: g.dtype.clone(),
            max_model_len: Some(g.max_model_len.unwrap_or(self.spec.max_total_sequence_length)),
            tensor_parallel_size: g.tensor_parallel_size,
        };
        let loads = self.generators.iter().map(|generator| async {
            let loaded = self.stop.guard(generator.load(&request)).await?;
            loaded.map_err(|e| Stop::Failed(format!("generator {} cannot load the run's model: {e}", generator.id())))
        });
        for loaded in futures::future::try_join_all(loads).await? {
            tracing::info!(
                run_id = %self.id,
                generator = %loaded.generator_id,
                seconds = loaded.seconds,
                kv_blocks = loaded.kv_blocks,
                "a generator loaded the run's model"
            );
        }
        Ok(())
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
        self.store.append_event(&RunEvent::Checkpoint { step, checkpoint_id: checkpoint.id }).await?;
        Ok(checkpoint.id)
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

/// Seconds since `since`.
pub fn seconds(since: Instant) -> f64 {
    since.elapsed().as_secs_f64()
}

/// Generators a run holds: `generation.replicas` when it generates (GRPO, eval, and SFT
/// validated by generation), else none.
pub fn generators_needed(spec: &RunSpec) -> usize {
    use keel_protocol::run::Algorithm;
    let generates = match spec.algorithm {
        Algorithm::Grpo | Algorithm::Eval => true,
        Algorithm::Sft => spec.data.validation.is_some() && crate::data::validation_algorithm(spec) == Algorithm::Eval,
        Algorithm::Dpo | Algorithm::Rm => false,
    };
    if generates { spec.generation.replicas } else { 0 }
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

/// Renews the run's lease (and its trainer's and generators') until dropped; sets `stop` on
/// cancel or loss, and fails the attempt when a generator it holds is gone (it lost the
/// claim, or has not answered for a whole `lease`: restarted, or dead);
/// shows the run `waiting` while its calls wait for a dependency, `running` when they no
/// longer do.
pub fn heartbeat(pool: PgPool, ctx: &RunContext, every: Duration, lease: Duration) -> tokio::task::JoinHandle<()> {
    let (run_id, owner, trainer, generators) = (ctx.id, ctx.owner, ctx.trainer.clone(), ctx.generators.clone());
    let (stop, waits) = (ctx.stop.clone(), ctx.waits.clone());
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        // Since when each generator's heartbeats have failed.
        let mut silent: std::collections::HashMap<String, Instant> = std::collections::HashMap::new();
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
                tracing::warn!(%run_id, worker = %trainer.worker(), "trainer heartbeat failed: {e}");
            }
            // All at once: a generator that does not answer holds up no other, nor the
            // run's own lease.
            let beats = futures::future::join_all(generators.iter().map(Generator::heartbeat)).await;
            for (generator, beat) in generators.iter().zip(beats) {
                let id = generator.id().to_string();
                match beat {
                    Ok(_) => {
                        silent.remove(&id);
                    }
                    // It no longer holds the run's claim: it was restarted, or its lease ran out.
                    Err(e) if matches!(e.kind(), Some("wrong_run")) => {
                        stop.set_failed(format!("generator {id} no longer holds the run: {e}"));
                    }
                    Err(e) => {
                        let since = *silent.entry(id.clone()).or_insert_with(Instant::now);
                        tracing::warn!(%run_id, generator = %id, "generator heartbeat failed: {e}");
                        if since.elapsed() >= lease {
                            stop.set_failed(format!(
                                "generator {id} has not answered for {:.0} s (its claim's lease): {e}",
                                lease.as_secs_f64()
                            ));
                        }
                    }
                }
            }
        }
    })
}
