//! Starts runs: the oldest queued run (or a running one whose orchestrator stopped renewing
//! its lease) is taken under a row lock, a trainer worker and the generators it needs are
//! claimed for it (those it had before, if they still hold the run), and its driver runs in
//! a task with a heartbeat. A run waits in `queued` while no trainer, or too few
//! generators, are free. A run that fails is put back in the
//! queue and resumed from its latest checkpoint until `max_attempts`; then it ends `failed`
//! with the reason. Every start counts as an attempt, however the one before ended — a
//! poison run that crashes each orchestrator that drives it ends `failed` too — except one
//! handed over by an orchestrator that shut down cleanly. A shared service that is away
//! costs no attempt: the run's calls wait for it (the run shows `waiting` past the grace
//! period).

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_client::checkpoint::CheckpointClient;
use keel_protocol::run::{RunEvent, RunStatus};
use sqlx::PgPool;
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::clients::{Generator, Nats, Trainer};
use crate::db;
use crate::driver::store::RunStore;
use crate::driver::weights::WeightPublisher;
use crate::driver::{self, RunContext, Stop, StopFlag, Waits};
use crate::loggers::Loggers;

/// What [`Scheduler::claim_next`] found.
enum Next {
    /// A run whose driver is to start.
    Start(Box<RunContext>),
    /// A run that cannot start now (no free workers, or it ran out of attempts).
    Pass(Uuid),
    /// No run to start.
    Idle,
}

#[derive(Debug, Clone)]
pub struct Scheduler {
    pub pool: PgPool,
    pub nats: Nats,
    pub checkpoints: CheckpointClient,
    pub work_dir: PathBuf,
    /// The claims this instance's drivers hold. Every claim of a run — even a second claim
    /// by this instance, after it stalled past the lease — gets an owner id of its own, so a
    /// driver whose lease lapsed fails its next fenced write (step, rewind, end) and stops.
    pub claims: Arc<Mutex<HashSet<Uuid>>>,
    pub run_lease: Duration,
    pub trainer_lease: Duration,
    pub poll: Duration,
    pub max_concurrent_runs: usize,
    pub max_attempts: i32,
    /// The MLflow servers runs may log to with the operator's token.
    pub mlflow: Arc<crate::loggers::TrackingServers>,
}

impl Scheduler {
    /// Starts runs until `shutdown`; then stops its drivers and gives their leases up, so
    /// the next orchestrator resumes them at once.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) -> Result<(), std::convert::Infallible> {
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
            // A run that cannot start now (its workers are not free) does not hold up the
            // runs behind it: it is passed over until the next tick.
            let mut passed = Vec::new();
            while drivers.len() < self.max_concurrent_runs {
                match self.claim_next(&passed).await {
                    Ok(Next::Start(ctx)) => {
                        let scheduler = self.clone();
                        drivers.spawn(async move { scheduler.drive(*ctx).await });
                    }
                    Ok(Next::Pass(run_id)) => passed.push(run_id),
                    Ok(Next::Idle) => break,
                    Err(e) => {
                        tracing::warn!("cannot start a run: {e}");
                        break;
                    }
                }
            }
        }
        drivers.shutdown().await;
        let claims: Vec<Uuid> = self.claims.lock().map(|c| c.iter().copied().collect()).unwrap_or_default();
        if let Ok(mut db) = self.pool.acquire().await {
            let _ = db::hand_over(&mut db, &claims).await;
        }
        Ok(())
    }

    /// Takes the next run, other than those in `passed`, and starts it if its workers are
    /// free.
    async fn claim_next(&self, passed: &[Uuid]) -> Result<Next, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let Some((run, attempts)) = db::next_claimable(&mut tx, self.run_lease.as_secs_f64(), passed).await? else {
            return Ok(Next::Idle);
        };
        // Queued runs have attempts left (`settle` checked); a run whose driver vanished
        // (its orchestrator crashed or hung) may not.
        let resumed = attempts > 0 || run.status != RunStatus::Queued;
        if run.status != RunStatus::Queued && attempts >= self.max_attempts {
            let reason = format!(
                "its orchestrator stopped while driving it {attempts} times (the last time at step {}); \
                 the run may be what stops it",
                run.step
            );
            tracing::error!(run_id = %run.id, "run failed: {reason}");
            db::abandon(&mut tx, run.id, &reason).await?;
            tx.commit().await?;
            return Ok(Next::Pass(run.id));
        }
        let run_key = run.id.to_string();
        let owner = Uuid::new_v4();
        // Generators first: while another run holds them all, nobody answers the claim at
        // once, and no trainer is claimed and let go on every poll.
        let previous = db::generators(&mut tx, run.id).await?;
        let Some(generators) = self.claim_generators(&run_key, &run.spec, &previous, owner).await else {
            return Ok(Next::Pass(run.id));
        };
        let trainer = if run.algorithm.loss_name().is_some() {
            let previous = db::trainer_worker(&mut tx, run.id).await?;
            match self.claim_trainer(&run_key, previous.as_deref(), owner).await {
                Some(trainer) => Some(trainer),
                None => {
                    futures::future::join_all(generators.iter().map(Generator::release)).await;
                    return Ok(Next::Pass(run.id));
                }
            }
        } else {
            None
        };
        db::start_run(&mut tx, run.id, owner, resumed).await?;
        db::set_trainer_worker(&mut tx, run.id, trainer.as_ref().map(Trainer::worker)).await?;
        let ids: Vec<String> = generators.iter().map(|g| g.id().to_string()).collect();
        db::set_generators(&mut tx, run.id, &ids).await?;
        tx.commit().await?;
        if let Ok(mut claims) = self.claims.lock() {
            claims.insert(owner);
        }
        tracing::info!(
            run_id = %run.id,
            algorithm = run.algorithm.name(),
            resumed,
            worker = ?trainer.as_ref().map(Trainer::worker),
            generators = ?ids,
            "run started"
        );
        let stop = StopFlag::default();
        let waits = Arc::new(Waits::new(stop.clone()));
        let mut nats = self.nats.clone();
        nats.patience = nats.patience.watched_by(waits.clone());
        let weights = WeightPublisher::new(run.id, &nats, stop.clone(), &run.spec);
        Ok(Next::Start(Box::new(RunContext {
            id: run.id,
            owner,
            store: RunStore::new(self.pool.clone(), run.id, owner, run.spec.algorithm.name())
                .with_loggers(Loggers::open(&run.spec, &run.id.to_string(), &self.work_dir.join("logs"), &self.mlflow)),
            spec: run.spec,
            trainer: trainer.map(|t| t.with_nats(nats.clone())),
            generators: generators.into_iter().map(|g| g.with_nats(nats.clone())).collect(),
            nats,
            weights,
            checkpoints: self.checkpoints.clone().watched_by(waits.clone()),
            run_dir: self.work_dir.join("runs").join(run.id.to_string()),
            stop,
            waits,
        })))
    }

    /// The worker the run held before (it renews the claim for the same run, and from now
    /// on refuses the previous claim's requests), else any free one.
    async fn claim_trainer(&self, run_id: &str, previous: Option<&str>, holder: Uuid) -> Option<Trainer> {
        let lease_seconds = self.trainer_lease.as_secs_f64();
        match self.nats.claim_trainer(run_id, previous, lease_seconds, holder).await {
            Ok(trainer) => trainer,
            Err(e) => {
                tracing::warn!(run_id, "trainer claim failed: {e}");
                None
            }
        }
    }

    /// The generators the run needs ([`driver::generators_needed`]): those it held before
    /// first, then free ones. None when too few are free (those claimed are released).
    async fn claim_generators(
        &self,
        run_id: &str,
        spec: &keel_protocol::run::RunSpec,
        previous: &[String],
        holder: Uuid,
    ) -> Option<Vec<Generator>> {
        let needed = driver::generators_needed(spec);
        let lease_seconds = self.trainer_lease.as_secs_f64();
        let mut claimed: Vec<Generator> = Vec::with_capacity(needed);
        // A generator claimed a moment ago may answer a second claim before it leaves the
        // claim group: a few tries more than needed.
        for attempt in 0..needed + 4 {
            if claimed.len() == needed {
                break;
            }
            let before = previous.get(attempt).map(String::as_str);
            match self.nats.claim_generator(run_id, before, lease_seconds, holder).await {
                Ok(Some(generator)) if claimed.iter().all(|g| g.id() != generator.id()) => claimed.push(generator),
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(run_id, "generator claim failed: {e}");
                    break;
                }
            }
        }
        if claimed.len() == needed {
            return Some(claimed);
        }
        tracing::debug!(run_id, needed, free = claimed.len(), "too few free generators; the run waits");
        for generator in &claimed {
            generator.release().await;
        }
        None
    }

    async fn drive(&self, ctx: RunContext) {
        self.drive_with(ctx, |ctx| Box::pin(driver::drive(ctx))).await;
    }

    /// Runs `drive` for the run with its heartbeat, then records how it ended. A driver that
    /// panics ends its attempt as a failure (its heartbeat stops with it), instead of leaving
    /// the run `running` with a heartbeat and no driver.
    async fn drive_with<F>(&self, ctx: RunContext, drive: F)
    where
        F: for<'a> FnOnce(&'a RunContext) -> futures::future::BoxFuture<'a, driver::Result<()>>,
    {
        use futures::FutureExt;
        let every = (self.run_lease / 3).min(self.trainer_lease / 3);
        let heartbeat = driver::heartbeat(self.pool.clone(), &ctx, every, self.trainer_lease);
        let result = std::panic::AssertUnwindSafe(drive(&ctx)).catch_unwind().await.unwrap_or_else(|panic| {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            Err(Stop::Failed(format!("the orchestrator's driver of this run panicked: {message}")))
        });
        heartbeat.abort();
        // A call that stopped waiting because the run was cancelled or lost fails with the
        // dependency's error; the run ended for the stop's reason.
        let result = match (result, ctx.stop.check()) {
            (Err(Stop::Failed(_)), Err(stop)) => Err(stop),
            (result, _) => result,
        };
        // A run taken over by another orchestrator keeps its trainer: the new owner renews
        // the same claim.
        if !matches!(result, Err(Stop::Lost)) {
            if let Some(trainer) = &ctx.trainer {
                trainer.release().await;
            }
            futures::future::join_all(ctx.generators.iter().map(Generator::release)).await;
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
        if let Ok(mut claims) = self.claims.lock() {
            claims.remove(&ctx.owner);
        }
    }

    /// Records the end of a run, or puts a failed one back in the queue while it has
    /// attempts left.
    async fn settle(&self, ctx: &RunContext, result: &driver::Result<()>) -> sqlx::Result<()> {
        let mut tx = self.pool.begin().await?;
        if let Err(Stop::Failed(reason)) = result {
            let attempts = db::attempts(&mut tx, ctx.id, ctx.owner).await?.unwrap_or(i32::MAX);
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
            ctx.store.finish_loggers(status);
            db::finish_run(&mut tx, ctx.id, ctx.owner, status, reason.as_deref()).await?;
        }
        tx.commit().await
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn started(next: Next) -> RunContext {
        match next {
            Next::Start(ctx) => *ctx,
            Next::Pass(id) => panic!("run {id} was passed over"),
            Next::Idle => panic!("no run to start"),
        }
    }

    /// The report's case: an orchestrator stalled past its lease claims its own live run
    /// again. The second claim gets an owner of its own, so the first driver's next step,
    /// heartbeat and end are refused (it stops) while the second driver's step is recorded:
    /// no step is recorded twice.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_second_claim_fences_out_the_first_driver_even_on_the_same_instance() {
        let fixture = Fixture::start(
            "keel_orch_fence",
            &["algorithm: eval\nmodel: {path: /m}\ndata: {train: {kind: arithmetic, size: 4}}\n"],
        )
        .await;
        let (scheduler, pool, run) = (&fixture.scheduler, &fixture.scheduler.pool, &fixture.runs[0]);
        let first = started(scheduler.claim_next(&[]).await.unwrap());
        assert_eq!(first.id, run.id);
        let step = |n: u64| db::StepRecord {
            step: n,
            metrics: [("train/loss".to_string(), n as f64)].into(),
            samples: Vec::new(),
            dataloader: serde_json::json!({}),
        };
        assert!(db::record_step(&mut pool.acquire().await.unwrap(), run.id, first.owner, &step(1)).await.unwrap());
        // The first driver stalls past its lease; the same instance claims the run again.
        sqlx::query("UPDATE runs SET heartbeat_at = now() - interval '1 day' WHERE id = $1")
            .bind(run.id)
            .execute(pool)
            .await
            .unwrap();
        let second = started(scheduler.claim_next(&[]).await.unwrap());
        assert_eq!(second.id, run.id);
        assert_ne!(second.owner, first.owner, "every claim has an owner of its own");
        let mut db = pool.acquire().await.unwrap();
        assert!(!db::record_step(&mut db, run.id, first.owner, &step(2)).await.unwrap(), "the stale driver is fenced");
        assert_eq!(db::heartbeat(&mut db, run.id, first.owner).await.unwrap(), db::Lease::Lost);
        assert!(db::record_step(&mut db, run.id, second.owner, &step(2)).await.unwrap());
        assert!(
            !db::finish_run(&mut db, run.id, first.owner, keel_protocol::run::RunStatus::Failed, None).await.unwrap(),
            "nor can it end the run"
        );
        let losses: Vec<i64> = sqlx::query_scalar("SELECT step::bigint FROM metrics WHERE run_id = $1 ORDER BY step")
            .bind(run.id)
            .fetch_all(pool)
            .await
            .unwrap();
        assert_eq!(losses, [1, 2], "each step recorded once");
        assert_eq!(second.generators.iter().map(|g| g.id()).collect::<Vec<_>>(), ["g1"], "the same generator again");
    }

    /// A driver that panics ends its attempt as a failure: the run goes back to the queue
    /// with the panic's message (a later attempt may pass), its heartbeat stops, and its
    /// generator is let go; the last attempt fails the run.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_driver_that_panics_fails_its_attempt_and_stops_its_heartbeat() {
        let fixture = Fixture::start(
            "keel_orch_panic",
            &["algorithm: eval\nmodel: {path: /m}\ndata: {train: {kind: arithmetic, size: 4}}\n"],
        )
        .await;
        let (scheduler, pool, run) = (&fixture.scheduler, &fixture.scheduler.pool, &fixture.runs[0]);
        let status = || async {
            sqlx::query_as::<_, (String, Option<String>)>("SELECT status, reason FROM runs WHERE id = $1")
                .bind(run.id)
                .fetch_one(pool)
                .await
                .unwrap()
        };
        for attempt in 1..=scheduler.max_attempts {
            let ctx = started(scheduler.claim_next(&[]).await.unwrap());
            scheduler.drive_with(ctx, move |_| Box::pin(async move { panic!("step {attempt} went wrong") })).await;
            let (now, error) = status().await;
            if attempt < scheduler.max_attempts {
                assert_eq!(now, "queued", "attempt {attempt}");
            } else {
                assert_eq!(now, "failed");
                let error = error.unwrap_or_default();
                assert!(error.contains("panicked") && error.contains("went wrong"), "{error}");
            }
        }
        let beat = || async {
            sqlx::query_scalar::<_, Option<f64>>(
                "SELECT extract(epoch FROM heartbeat_at)::float8 FROM runs WHERE id = $1",
            )
            .bind(run.id)
            .fetch_one(pool)
            .await
            .unwrap()
        };
        let before = beat().await;
        tokio::time::sleep(scheduler.run_lease / 2).await;
        assert_eq!(beat().await, before, "a heartbeat goes on after the driver panicked");
    }

    /// A run that saved a checkpoint and, resumed, finds the store has none of it any more
    /// fails to start, saying so, instead of starting from its base model and rewinding its
    /// recorded steps to 0; a run that never saved one starts from its base as before.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_resumed_run_whose_checkpoints_are_gone_keeps_its_history() {
        let eval = "algorithm: eval\nmodel: {path: /m}\ndata: {train: {kind: arithmetic, size: 4}}\n";
        let mut fixture = Fixture::start("keel_orch_gone", &[eval, eval]).await;
        // A checkpoint store that has no checkpoint of any run.
        let app = axum::Router::new().fallback(|| async {
            (
                axum::http::StatusCode::NOT_FOUND,
                axum::Json(serde_json::json!({"error": {"type": "not_found", "message": "none"}})),
            )
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let store = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        fixture.scheduler.checkpoints = CheckpointClient::new(&store);
        let (scheduler, pool) = (&fixture.scheduler, &fixture.scheduler.pool);
        let (saved, fresh) = (fixture.runs[0].id, fixture.runs[1].id);
        let event = RunEvent::Checkpoint { step: 3, checkpoint_id: Uuid::new_v4() };
        db::append_event(&mut pool.acquire().await.unwrap(), saved, &event).await.unwrap();

        let ctx = started(scheduler.claim_next(&[]).await.unwrap());
        assert_eq!(ctx.id, saved);
        let refused = ctx.start().await.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused.contains("at step 3") && refused.contains("rewind"), "{refused}");
        let ctx = started(scheduler.claim_next(&[saved]).await.unwrap());
        assert_eq!(ctx.id, fresh);
        let start = ctx.start().await.unwrap();
        assert_eq!((start.step, start.resumed), (0, false));
    }

    /// A run that cannot get its generators (it wants two; the one there answers every
    /// claim) is passed over, and the run behind it starts.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_run_waiting_for_generators_does_not_hold_up_the_next() {
        let eval = "algorithm: eval\nmodel: {path: /m}\ndata: {train: {kind: arithmetic, size: 4}}\n";
        let wants_two = format!("{eval}generation: {{replicas: 2}}\n");
        let fixture = Fixture::start("keel_orch_pass", &[&wants_two, eval]).await;
        let scheduler = &fixture.scheduler;
        let (first, second) = (fixture.runs[0].id, fixture.runs[1].id);
        match scheduler.claim_next(&[]).await.unwrap() {
            Next::Pass(id) => assert_eq!(id, first, "the oldest is passed over"),
            _ => panic!("the run that wants two generators started"),
        }
        assert_eq!(started(scheduler.claim_next(&[first]).await.unwrap()).id, second);
        assert!(matches!(scheduler.claim_next(&[first]).await.unwrap(), Next::Idle));
    }

    /// A scheduler on a database and subjects of its own, with `specs` submitted (oldest
    /// first) and one generator, `g1`, that takes every claim.
    struct Fixture {
        scheduler: Scheduler,
        runs: Vec<keel_protocol::run::Run>,
        generator: tokio::task::JoinHandle<()>,
        _database: keel_testkit::TestDatabase,
        _work_dir: tempfile::TempDir,
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            self.generator.abort();
        }
    }

    impl Fixture {
        async fn start(name: &str, specs: &[&str]) -> Self {
            let database = keel_testkit::TestDatabase::new(name);
            let pool = db::connect(&database.url).await.unwrap();
            let mut runs = Vec::new();
            for spec in specs {
                let spec = crate::spec::parse(spec.as_bytes(), Some("application/yaml")).unwrap();
                runs.push(db::insert_run(&mut pool.acquire().await.unwrap(), &spec).await.unwrap());
            }
            let client = keel_service::nats::connect(&keel_service::nats::default_url()).await.unwrap();
            let bulk = keel_service::nats::Bulk::open(client.clone(), "keel-test-bulk").await.unwrap();
            let nats = Nats {
                client,
                subjects: keel_protocol::Subjects::new(&format!("keeltest.sched{}", Uuid::new_v4().simple())).unwrap(),
                bulk,
                timeout: Duration::from_secs(5),
                retries: 0,
                patience: keel_client::retry::Patience::none(),
            };
            let generator = {
                use futures::StreamExt;
                let (client, subjects) = (nats.client.clone(), nats.subjects.clone());
                let mut free = client.subscribe(subjects.generator_claim()).await.unwrap();
                let mut own = client.subscribe(subjects.generator_all("g1")).await.unwrap();
                client.flush().await.unwrap();
                tokio::spawn(async move {
                    loop {
                        let message = tokio::select! {
                            Some(m) = free.next() => m,
                            Some(m) = own.next() => m,
                            else => break,
                        };
                        let reply = serde_json::json!({"ok": {"worker_id": "g1", "lease_seconds": 60.0}});
                        if let Some(to) = message.reply {
                            client.publish(to, reply.to_string().into()).await.unwrap();
                        }
                    }
                })
            };
            let work_dir = tempfile::tempdir().unwrap();
            let scheduler = Scheduler {
                pool,
                nats,
                checkpoints: CheckpointClient::new("http://127.0.0.1:9"),
                work_dir: work_dir.path().to_path_buf(),
                claims: Arc::default(),
                run_lease: Duration::from_secs(20),
                trainer_lease: Duration::from_secs(60),
                poll: Duration::from_secs(1),
                max_concurrent_runs: 1,
                max_attempts: 3,
                mlflow: Arc::default(),
            };
            Self { scheduler, runs, generator, _database: database, _work_dir: work_dir }
        }
    }
}
