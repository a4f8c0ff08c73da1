//! The run's rows in Postgres, as one driver sees them: every write is fenced by this claim
//! of the run (`owner`), and a write the fence refuses stops the driver ([`Stop::Lost`]).
//! A database that is away for a while (a restart, a failover) is waited for, with backoff,
//! up to [`DATABASE_PATIENCE`], before it costs the run an attempt: getting a connection is
//! what is retried, since a statement whose answer was lost may have taken effect.

use std::sync::{Arc, Mutex};

use keel_protocol::run::{RunEvent, Sample};
use sqlx::PgPool;
use uuid::Uuid;

use super::{Result, Stop};
use crate::db;
use crate::loggers::Loggers;

/// The histogram of recorded steps' phases on the orchestrator's `/metrics`.
pub(crate) const STEP_PHASES: &str = "keel_step_phase_seconds";

/// How long a driver waits for the database to come back.
pub const DATABASE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(120);

#[derive(Debug, Clone)]
pub struct RunStore {
    pool: PgPool,
    /// How long to wait for a connection through a database that is away.
    patience: std::time::Duration,
    id: Uuid,
    owner: Uuid,
    /// The run's algorithm, as the step-phase histogram labels it.
    algorithm: &'static str,
    /// Where recorded metrics also go (TensorBoard).
    loggers: Arc<Mutex<Loggers>>,
}

impl RunStore {
    pub fn new(pool: PgPool, id: Uuid, owner: Uuid, algorithm: &'static str) -> Self {
        Self { pool, id, owner, algorithm, loggers: Arc::default(), patience: DATABASE_PATIENCE }
    }

    /// Waits at most `patience` for the database (tests).
    pub fn with_patience(self, patience: std::time::Duration) -> Self {
        Self { patience, ..self }
    }

    /// A connection, waiting with backoff while the database cannot be reached, up to the
    /// store's patience.
    async fn connection(&self) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>> {
        let deadline = std::time::Instant::now() + self.patience;
        let mut wait = std::time::Duration::from_millis(200);
        loop {
            match self.pool.acquire().await {
                Ok(connection) => return Ok(connection),
                Err(e) if unreachable(&e) && std::time::Instant::now() + wait < deadline => {
                    tracing::warn!(run_id = %self.id, "the database is away ({e}); waiting {wait:?} for it");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(std::time::Duration::from_secs(5));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// A transaction on a [`RunStore::connection`].
    async fn begin(&self) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
        let connection = self.connection().await?;
        Ok(sqlx::Transaction::begin(connection, None).await?)
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
        Ok(db::last_saved_checkpoint(&mut *self.connection().await?, self.id).await?)
    }

    /// Forgets what was recorded after `step` (a resumed run records those steps again).
    pub async fn rewind(&self, step: u64) -> Result<()> {
        if !db::rewind(&mut *self.connection().await?, self.id, self.owner, step).await? {
            return Err(Stop::Lost);
        }
        Ok(())
    }

    /// Tells the API how many steps the run will take.
    pub async fn set_total_steps(&self, total: u64) -> Result<()> {
        Ok(db::set_total_steps(&mut *self.connection().await?, self.id, total).await?)
    }

    /// Records a finished step (its metrics, samples and dataloader position) and observes
    /// its phase timings in `/metrics`.
    pub async fn record(&self, record: &db::StepRecord) -> Result<()> {
        let mut tx = self.begin().await?;
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
        let mut db = self.connection().await?;
        db::insert_metrics(&mut db, self.id, 0, metrics).await?;
        db::insert_samples(&mut db, self.id, samples).await?;
        self.log(0, metrics);
        Ok(())
    }

    pub async fn append_event(&self, event: &RunEvent) -> Result<()> {
        Ok(db::append_event(&mut *self.connection().await?, self.id, event).await?)
    }
}

/// Whether `error` says the database could not be reached (worth waiting for), rather than
/// that a statement was wrong.
fn unreachable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::Tls(_) => true,
        // Connection exceptions (08...), and the server shutting down or starting (57P0x).
        sqlx::Error::Database(e) => e.code().is_some_and(|c| c.starts_with("08") || c.starts_with("57P0")),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::str::FromStr;
    use std::time::Duration;

    use super::*;

    /// A pool on the test database through `port`, where nothing listens until the test says.
    fn pool_through(url: &str, port: u16) -> PgPool {
        let options = sqlx::postgres::PgConnectOptions::from_str(url)
            .unwrap()
            .port(port)
            .options([("search_path", crate::db::SCHEMA)]);
        sqlx::postgres::PgPoolOptions::new().acquire_timeout(Duration::from_millis(300)).connect_lazy_with(options)
    }

    /// Forwards every connection on `port` to Postgres (5432), from now on.
    async fn forward(port: u16) {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.unwrap();
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect("127.0.0.1:5432").await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
    }

    /// A database that is away when a driver writes is waited for: the write lands once it
    /// is back, and the run's attempt is not spent on it; one away past the patience fails
    /// the write, saying it was the database.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_database_blip_is_waited_for() {
        let database = keel_testkit::TestDatabase::new("keel_orch_blip");
        let pool = crate::db::connect(&database.url).await.unwrap();
        let spec = crate::spec::parse(
            b"algorithm: eval\nmodel: {path: /m}\ndata: {train: {kind: arithmetic, size: 4}}\n",
            Some("application/yaml"),
        )
        .unwrap();
        let run = crate::db::insert_run(&mut pool.acquire().await.unwrap(), &spec).await.unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let away = RunStore::new(pool_through(&database.url, port), run.id, Uuid::new_v4(), "eval");

        let gone = away.clone().with_patience(Duration::from_millis(500));
        let event = RunEvent::Checkpoint { step: 1, checkpoint_id: Uuid::new_v4() };
        let refused = gone.append_event(&event).await.unwrap_err().to_string();
        assert!(refused.contains("database"), "{refused}");

        let back = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            forward(port).await;
        });
        away.with_patience(Duration::from_secs(60)).append_event(&event).await.unwrap();
        back.await.unwrap();
        let saved = crate::db::last_saved_checkpoint(&mut pool.acquire().await.unwrap(), run.id).await.unwrap();
        assert_eq!(saved.map(|(step, _)| step), Some(1), "the write landed once the database was back");
    }
}
