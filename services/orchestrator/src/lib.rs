//! keel-orchestrator: the public run API and the drivers that carry runs out over the other
//! services — the trainer and generators (claimed per run over NATS), the reward queue
//! group, and the checkpoint store (REST).
//!
//! Layout:
//! - [`api`]: the REST routes and their OpenAPI document (`openapi/keel.yaml`, with the run
//!   spec's JSON Schema in `openapi/run-spec.schema.json`).
//! - [`spec`]: a submitted spec parsed and checked, every problem with its field path.
//! - [`db`]: runs, events, metrics, samples and dataloader state in Postgres (schema
//!   `orchestrator`, migrations in `migrations/`), with run ownership by lease.
//! - [`scheduler`]: takes queued (or orphaned) runs, claims trainers and generators, starts
//!   drivers.
//! - [`driver`]: the algorithms (GRPO, SFT, DPO, RM, eval), resume and checkpoints.
//! - [`clients`]: the NATS protocols of the trainer, generator and reward services.
//! - [`dashboard`]: the live dashboard page at `/dashboard` (assets built in).
//! - [`data`]: datasets (JSONL, Parquet, the built-in arithmetic generator) and the
//!   dataloader.
//! - [`datasets`]: dataset files uploaded through the API (`POST /v1/datasets`).
//!
//! Several orchestrators may share one database: a run belongs to the instance holding its
//! lease, and a run whose instance died is resumed by another (or the restarted one) from
//! its latest checkpoint.

pub mod api;
pub mod clients;
pub mod dashboard;
pub mod data;
pub mod datasets;
pub mod db;
pub mod driver;
pub mod loggers;
pub mod scheduler;
pub mod spec;

use keel_protocol::FieldError;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub const SERVICE: &str = "orchestrator";

/// Configuration: defaults, then `--config FILE`, then `KEEL_ORCHESTRATOR__<FIELD>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub listen: SocketAddr,
    pub database_url: String,
    pub nats_url: String,
    pub subject_prefix: String,
    /// The trainer's bulk bucket (training batches above 1 MiB go through it).
    pub bulk_bucket: String,
    pub checkpoint_url: String,
    /// The checkpoint store's API token, when it has one.
    pub checkpoint_token: Option<String>,
    /// Scratch space for runs (saved weights the generators load, downloaded checkpoints).
    /// It must be the same path on the trainer and generator machines (a shared volume).
    pub work_dir: PathBuf,
    /// Bearer token the API, `/metrics` and the dashboard require (unset: no auth). Default:
    /// `KEEL_API_TOKEN` when set (what `keel run` sends).
    pub api_token: Option<String>,
    /// A run whose orchestrator has not renewed it for this long is resumed by another.
    pub run_lease_seconds: f64,
    /// The lease of a run's claims of its trainer and generators (renewed by the run's
    /// heartbeat).
    pub trainer_lease_seconds: f64,
    /// How often the scheduler looks for runs to start.
    pub poll_seconds: f64,
    pub max_concurrent_runs: usize,
    /// How long one request to a trainer, generator or reward replica may take.
    pub request_timeout_seconds: f64,
    /// Retries of a generator or reward request that got no answer.
    pub request_retries: u32,
    /// Starts of a run (the first and resumes after failures) before it ends `failed`.
    pub max_attempts: i32,
    /// How long a run's call retries, with backoff, a dependency that is gone (the checkpoint
    /// store unreachable, nobody serving the generator or reward queue group) before the run
    /// shows `waiting` with the reason; it goes on waiting until the dependency is back or
    /// the run is cancelled, and no attempt is spent on it.
    pub dependency_grace_seconds: f64,
    /// The directories a run spec's `model.path` and JSONL `data.*.path` may be in (checked
    /// at submit, 422 naming the field). Default: `.keel`, `/var/lib/keel` and the system's
    /// temporary directory.
    pub path_roots: Vec<PathBuf>,
    /// The largest dataset file `POST /v1/datasets` takes, in bytes (uploads are kept in
    /// `work_dir/datasets`, which is always a path root).
    pub max_dataset_bytes: u64,
    /// The MLflow tracking servers the operator trusts (URL prefixes): a run logging to one
    /// of them is sent `MLFLOW_TRACKING_TOKEN` (when set) and may reach it on a private
    /// address. Any other `logger.mlflow.tracking_uri` gets no token and must be public
    /// (a private literal address is refused at submit). Default: `MLFLOW_TRACKING_URI` when
    /// set.
    pub mlflow_tracking_uris: Vec<String>,
    /// The longest line a JSONL dataset may have, in bytes: a longer one is refused at
    /// submit naming it (8 MiB).
    pub max_jsonl_line_bytes: u64,
}

impl keel_service::ServiceConfig for Config {
    fn validate(&self) -> Result<(), FieldError> {
        keel_service::refuse_published_token(self.listen, self.api_token.as_deref(), "api_token")?;
        loggers::TrackingServers::new(&self.mlflow_tracking_uris, None)?;
        if self.max_jsonl_line_bytes == 0 {
            return Err(FieldError::new("max_jsonl_line_bytes", "must be at least 1"));
        }
        keel_protocol::Subjects::new(&self.subject_prefix)
            .map_err(|e| FieldError::new("subject_prefix", e.to_string()))?;
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(FieldError::new(name, format!("must be positive, got {v}")))
            }
        };
        positive("run_lease_seconds", self.run_lease_seconds)?;
        positive("trainer_lease_seconds", self.trainer_lease_seconds)?;
        positive("poll_seconds", self.poll_seconds)?;
        positive("request_timeout_seconds", self.request_timeout_seconds)?;
        if !(self.dependency_grace_seconds.is_finite() && self.dependency_grace_seconds >= 0.0) {
            return Err(FieldError::new(
                "dependency_grace_seconds",
                format!("must be zero or more, got {}", self.dependency_grace_seconds),
            ));
        }
        if self.max_concurrent_runs == 0 {
            return Err(FieldError::new("max_concurrent_runs", "must be at least 1"));
        }
        if self.max_attempts < 1 {
            return Err(FieldError::new("max_attempts", "must be at least 1"));
        }
        if self.api_token.as_deref() == Some("") {
            return Err(FieldError::new("api_token", "must not be empty (leave it unset for no auth)"));
        }
        Ok(())
    }
}

pub fn default_config() -> Config {
    Config {
        listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
        database_url: std::env::var("KEEL_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/keel".into()),
        nats_url: keel_service::nats::default_url(),
        subject_prefix: keel_protocol::Subjects::default().prefix().to_string(),
        bulk_bucket: "keel-bulk".into(),
        checkpoint_url: std::env::var("KEEL_CHECKPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:8083".into()),
        checkpoint_token: std::env::var("KEEL_CHECKPOINT_TOKEN").ok().filter(|t| !t.is_empty()),
        work_dir: PathBuf::from(".keel/orchestrator"),
        api_token: std::env::var("KEEL_API_TOKEN").ok().filter(|t| !t.is_empty()),
        run_lease_seconds: 20.0,
        trainer_lease_seconds: 60.0,
        poll_seconds: 1.0,
        max_concurrent_runs: 4,
        request_timeout_seconds: 600.0,
        request_retries: 5,
        max_attempts: 3,
        dependency_grace_seconds: 120.0,
        path_roots: keel_service::paths::default_roots(),
        max_jsonl_line_bytes: data::DEFAULT_MAX_LINE_BYTES,
        mlflow_tracking_uris: std::env::var("MLFLOW_TRACKING_URI").ok().filter(|u| !u.is_empty()).into_iter().collect(),
        max_dataset_bytes: 16 << 30,
    }
}

/// Serves the API and runs the scheduler until `shutdown` completes.
pub async fn run(config: Config, shutdown: impl Future<Output = ()> + Send + 'static) -> keel_service::Result<()> {
    data::set_max_line_bytes(config.max_jsonl_line_bytes);
    let pool = db::connect(&config.database_url).await?;
    let client = keel_service::nats::connect(&config.nats_url).await?;
    let subjects = keel_protocol::Subjects::new(&config.subject_prefix)?;
    let bulk = keel_service::nats::Bulk::open(client.clone(), &config.bulk_bucket).await?;
    let patience = Duration::from_secs_f64(config.dependency_grace_seconds);
    let nats = clients::Nats {
        client,
        subjects,
        bulk,
        timeout: Duration::from_secs_f64(config.request_timeout_seconds),
        retries: config.request_retries,
        patience: keel_client::retry::Patience::new(patience),
    };
    let work_dir =
        std::path::absolute(&config.work_dir).map_err(|e| keel_service::Error::start("resolve work_dir", e))?;
    std::fs::create_dir_all(&work_dir)
        .map_err(|e| keel_service::Error::start("create work_dir", format!("{}: {e}", work_dir.display())))?;
    let datasets = datasets::dir(&work_dir);
    // The API answers at once (a submit is not held while the store is away); runs wait.
    let checkpoints = keel_client::checkpoint::CheckpointClient::new(&config.checkpoint_url)
        .with_token(config.checkpoint_token.as_deref());
    let mlflow = std::sync::Arc::new(
        loggers::TrackingServers::new(
            &config.mlflow_tracking_uris,
            std::env::var("MLFLOW_TRACKING_TOKEN").ok().filter(|t| !t.is_empty()),
        )
        .map_err(|e| keel_service::Error::start("read mlflow_tracking_uris", e))?,
    );
    let scheduler = scheduler::Scheduler {
        pool: pool.clone(),
        nats,
        checkpoints: checkpoints.clone().with_patience(keel_client::retry::Patience::new(patience)),
        work_dir,
        claims: Default::default(),
        run_lease: Duration::from_secs_f64(config.run_lease_seconds),
        trainer_lease: Duration::from_secs_f64(config.trainer_lease_seconds),
        poll: Duration::from_secs_f64(config.poll_seconds),
        max_concurrent_runs: config.max_concurrent_runs,
        max_attempts: config.max_attempts,
        mlflow: mlflow.clone(),
    };
    let mut parts = keel_service::parts::Parts::default();
    parts.spawn("scheduler", scheduler.run(parts.stopped()));
    std::fs::create_dir_all(&datasets).map_err(|e| {
        keel_service::Error::start("create the datasets directory", format!("{}: {e}", datasets.display()))
    })?;
    let roots = [config.path_roots.as_slice(), std::slice::from_ref(&datasets)].concat();
    let roots = keel_service::paths::PathRoots::new(&roots, "KEEL_ORCHESTRATOR__PATH_ROOTS")?;
    let token = config.api_token.clone();
    let state = api::AppState {
        pool,
        checkpoints,
        token,
        roots,
        datasets,
        max_dataset_bytes: config.max_dataset_bytes,
        mlflow,
    };
    let app = api::routes(state)
        .merge(dashboard::routes(config.api_token.clone()))
        .merge(keel_service::health_routes(SERVICE));
    let http = keel_service::run_http(SERVICE, config.listen, app, parts.stopped());
    parts.spawn("http", http);
    parts.run_until(shutdown).await
}

// The settings reference names every field of this service's configuration.
#[cfg(test)]
keel_testkit::settings_reference_test!();
