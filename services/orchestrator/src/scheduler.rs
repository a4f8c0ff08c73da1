//! Starts runs: the oldest queued run (or a running one whose orchestrator stopped renewing
//! its lease) is taken under a row lock, a trainer worker is claimed for it (the worker it
//! had before, if it still holds the run), and its driver runs in a task with a heartbeat.
//! A run waits in `queued` while no trainer is free. A run that fails is put back in the
//! queue and resumed from its latest checkpoint until `max_attempts`; then it ends `failed`
//! with the reason.

use std::path::PathBuf;
use std::time::Duration;

use keel_client::checkpoint::CheckpointClient;
use keel_protocol::run::{RunEvent, RunStatus};
use keel_protocol::subjects::TrainerOp;
use keel_protocol::trainer::{ClaimReply, ClaimRequest};
use sqlx::PgPool;
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::clients::{Nats, Trainer};
use crate::db;
use crate::driver::{self, RunContext, Stop, StopFlag};

#[derive(Debug, Clone)]
pub struct Scheduler {
    pub pool: PgPool,
    pub nats: Nats,
    pub checkpoints: CheckpointClient,
    pub work_dir: PathBuf,
    /// This instance.
    pub owner: Uuid,
    pub run_lease: Duration,
    pub trainer_lease: Duration,
    pub poll: Duration,
    pub max_concurrent_runs: usize,
    pub max_attempts: i32,
}

impl Scheduler {
    /// Starts runs until `shutdown`; then stops its drivers and gives their leases up, so
    /// the next orchestrator resumes them at once.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) -> Result<(), String> {
        let mut drivers = JoinSet::new();
        let mut tick = tokio::time::interval(self.poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                _ = tick.tick() => {}
                Some(_) = drivers.join_next(), if !drivers.is_empty() => continue,
            }
            while drivers.len() < self.max_concurrent_runs {
                match self.claim_next().await {
                    Ok(Some(ctx)) => {
                        let scheduler = self.clone();
                        drivers.spawn(async move { scheduler.drive(ctx).await });
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!("cannot start a run: {e}");
                        break;
                    }
                }
            }
        }
        drivers.shutdown().await;
        if let Ok(mut db) = self.pool.acquire().await {
            let _ = sqlx::query(
                "UPDATE runs SET heartbeat_at = now() - interval '1 day' WHERE owner = $1 AND status = 'running'",
            )
            .bind(self.owner)
            .execute(&mut *db)
            .await;
        }
        Ok(())
    }

    /// Takes the next run that can start now.
    async fn claim_next(&self) -> Result<Option<RunContext>, String> {
        let mut tx = self.pool.begin().await.map_err(|e| e.to_string())?;
        let Some((run, attempts)) =
            db::next_claimable(&mut tx, self.run_lease.as_secs_f64()).await.map_err(|e| e.to_string())?
        else {
            return Ok(None);
        };
        let resumed = attempts > 0;
        let run_key = run.id.to_string();
        let trainer = if run.algorithm.loss_name().is_some() {
            let previous: Option<String> = sqlx::query_scalar("SELECT trainer_worker FROM runs WHERE id = $1")
                .bind(run.id)
                .fetch_one(&mut *tx)
                .await
                .map_err(|e| e.to_string())?;
            match self.claim_trainer(&run_key, previous).await {
                Some(trainer) => Some(trainer),
                None => return Ok(None),
            }
        } else {
            None
        };
        db::start_run(&mut tx, run.id, self.owner, resumed).await.map_err(|e| e.to_string())?;
        sqlx::query("UPDATE runs SET trainer_worker = $2 WHERE id = $1")
            .bind(run.id)
            .bind(trainer.as_ref().map(|t| t.worker.clone()))
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
        tx.commit().await.map_err(|e| e.to_string())?;
        tracing::info!(run_id = %run.id, algorithm = run.algorithm.name(), resumed, worker = ?trainer.as_ref().map(|t| &t.worker), "run started");
        Ok(Some(RunContext {
            id: run.id,
            spec: run.spec,
            owner: self.owner,
            pool: self.pool.clone(),
            nats: self.nats.clone(),
            trainer,
            checkpoints: self.checkpoints.clone(),
            run_dir: self.work_dir.join("runs").join(run.id.to_string()),
            stop: StopFlag::default(),
            announced: std::sync::Mutex::new(None),
        }))
    }

    /// The worker the run held before (it renews the claim for the same run), else any
    /// free one.
    async fn claim_trainer(&self, run_id: &str, previous: Option<String>) -> Option<Trainer> {
        let lease_seconds = self.trainer_lease.as_secs_f64();
        if let Some(worker) = previous {
            let request = ClaimRequest { run_id: run_id.to_string(), lease_seconds };
            let subject = self.nats.subjects.trainer(&worker, TrainerOp::Claim);
            if let Ok(reply) = self.nats.call::<_, ClaimReply>(subject, &request, Duration::from_secs(5)).await {
                return Some(Trainer::new(self.nats.clone(), reply.worker_id, run_id.to_string()));
            }
        }
        match self.nats.claim_trainer(run_id, lease_seconds).await {
            Ok(trainer) => trainer,
            Err(e) => {
                tracing::warn!(run_id, "trainer claim failed: {e}");
                None
            }
        }
    }

    async fn drive(&self, ctx: RunContext) {
        let heartbeat = driver::heartbeat(
            self.pool.clone(),
            ctx.id,
            self.owner,
            ctx.trainer.clone(),
            ctx.stop.clone(),
            (self.run_lease / 3).min(self.trainer_lease / 3),
        );
        let result = driver::drive(&ctx).await;
        heartbeat.abort();
        // A run taken over by another orchestrator keeps its trainer: the new owner renews
        // the same claim.
        if let Some(trainer) = ctx.trainer.as_ref().filter(|_| !matches!(result, Err(Stop::Lost))) {
            trainer.release().await;
        }
        if let Err(e) = self.settle(&ctx, &result).await {
            tracing::error!(run_id = %ctx.id, "cannot record how the run ended: {e}");
        }
        // A failed run may be retried from this directory's downloads; a lost one is another's.
        if matches!(result, Ok(()) | Err(Stop::Cancelled))
            && ctx.run_dir.exists()
            && let Err(e) = tokio::fs::remove_dir_all(&ctx.run_dir).await
        {
            tracing::warn!("cannot remove {}: {e}", ctx.run_dir.display());
        }
    }

    /// Records the end of a run, or puts a failed one back in the queue while it has
    /// attempts left.
    async fn settle(&self, ctx: &RunContext, result: &driver::Result<()>) -> sqlx::Result<()> {
        let mut tx = self.pool.begin().await?;
        if let Err(Stop::Failed(reason)) = result {
            let attempts: i32 = sqlx::query_scalar("SELECT attempts FROM runs WHERE id = $1 AND owner = $2")
                .bind(ctx.id)
                .bind(self.owner)
                .fetch_optional(&mut *tx)
                .await?
                .unwrap_or(i32::MAX);
            if attempts < self.max_attempts {
                tracing::warn!(run_id = %ctx.id, attempts, "run failed, retrying from its latest checkpoint: {reason}");
                db::requeue(&mut tx, ctx.id).await?;
                let event = RunEvent::Status {
                    status: RunStatus::Queued,
                    reason: Some(format!("attempt {attempts} failed, retrying: {reason}")),
                };
                db::append_event(&mut tx, ctx.id, &event).await?;
                return tx.commit().await;
            }
        }
        if let Some((status, reason)) = driver::outcome(result) {
            if status == RunStatus::Failed {
                tracing::error!(run_id = %ctx.id, "run failed: {}", reason.as_deref().unwrap_or_default());
            }
            db::finish_run(&mut tx, ctx.id, self.owner, status, reason.as_deref()).await?;
        }
        tx.commit().await
    }
}
