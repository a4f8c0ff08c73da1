//! The run's rows in Postgres, as one driver sees them: every write is fenced by this claim
//! of the run (`owner`), and a write the fence refuses stops the driver ([`Stop::Lost`]).

use std::sync::{Arc, Mutex};

use keel_protocol::run::{RunEvent, Sample};
use sqlx::PgPool;
use uuid::Uuid;

use super::{Result, Stop};
use crate::db;
use crate::loggers::Loggers;

/// The histogram of recorded steps' phases on the orchestrator's `/metrics`.
pub(crate) const STEP_PHASES: &str = "keel_step_phase_seconds";

#[derive(Debug, Clone)]
pub struct RunStore {
    pool: PgPool,
    id: Uuid,
    owner: Uuid,
    /// The run's algorithm, as the step-phase histogram labels it.
    algorithm: &'static str,
    /// Where recorded metrics also go (TensorBoard).
    loggers: Arc<Mutex<Loggers>>,
}

impl RunStore {
    pub fn new(pool: PgPool, id: Uuid, owner: Uuid, algorithm: &'static str) -> Self {
        Self { pool, id, owner, algorithm, loggers: Arc::default() }
    }

    /// Sends every metric recorded from now on to `loggers` too.
    pub fn with_loggers(self, loggers: Loggers) -> Self {
        Self { loggers: Arc::new(Mutex::new(loggers)), ..self }
    }

    fn log(&self, step: u64, metrics: &std::collections::BTreeMap<String, f64>) {
        self.loggers.lock().unwrap_or_else(std::sync::PoisonError::into_inner).log(step, metrics);
    }

    /// The run ended with `status`: the loggers that keep a run's state say so.
    pub fn finish_loggers(&self, status: keel_protocol::run::RunStatus) {
        self.loggers.lock().unwrap_or_else(std::sync::PoisonError::into_inner).finish(status);
    }

    /// The step and id of the last checkpoint this run recorded saving.
    pub async fn last_saved_checkpoint(&self) -> Result<Option<(i64, String)>> {
        Ok(db::last_saved_checkpoint(&mut *self.pool.acquire().await?, self.id).await?)
    }

    /// Forgets what was recorded after `step` (a resumed run records those steps again).
    pub async fn rewind(&self, step: u64) -> Result<()> {
        if !db::rewind(&mut *self.pool.acquire().await?, self.id, self.owner, step).await? {
            return Err(Stop::Lost);
        }
        Ok(())
    }

    /// Tells the API how many steps the run will take.
    pub async fn set_total_steps(&self, total: u64) -> Result<()> {
        Ok(db::set_total_steps(&mut *self.pool.acquire().await?, self.id, total).await?)
    }

    /// Records a finished step (its metrics, samples and dataloader position) and observes
    /// its phase timings in `/metrics`.
    pub async fn record(&self, record: &db::StepRecord) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        if !db::record_step(&mut tx, self.id, self.owner, record).await? {
            return Err(Stop::Lost);
        }
        tx.commit().await?;
        self.log(record.step, &record.metrics);
        for (name, seconds) in &record.metrics {
            if let Some(phase) = name.strip_prefix("timing/train/") {
                keel_service::metrics::observe(
                    STEP_PHASES,
                    &[("algorithm", self.algorithm), ("phase", phase)],
                    *seconds,
                );
            }
        }
        Ok(())
    }

    /// Records the validation of the starting weights, as step 0.
    pub async fn record_baseline(
        &self,
        metrics: &std::collections::BTreeMap<String, f64>,
        samples: &[Sample],
    ) -> Result<()> {
        let mut db = self.pool.acquire().await?;
        db::insert_metrics(&mut db, self.id, 0, metrics).await?;
        db::insert_samples(&mut db, self.id, samples).await?;
        self.log(0, metrics);
        Ok(())
    }

    pub async fn append_event(&self, event: &RunEvent) -> Result<()> {
        Ok(db::append_event(&mut *self.pool.acquire().await?, self.id, event).await?)
    }
}
