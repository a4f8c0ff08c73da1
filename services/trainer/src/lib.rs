//! keel-trainer: the policy-training worker. A run claims it over NATS and drives it: load
//! the policy and reference, compute logprobs, train with one of NeMo-RL's losses, score
//! with a reward head, save checkpoints, release.
//!
//! The engine (models, losses, optimiser, tensor-parallel ranks) is the `keel-training`
//! library; this crate is its process:
//! - [`worker`]: NATS subjects, claims and leases, request handling (typed error replies),
//!   weight exports to the generators.
//! - [`group`]: a run's ranks as trainer processes of their own (one per GPU, on one machine
//!   or several), led by the group's rank 0.
//! - this file: configuration, the HTTP health and metrics routes, lifecycle.
//!
//! The service also serves `GET /healthz` on its HTTP address (default 127.0.0.1:8084).

pub mod group;
pub mod worker;

use keel_collective::process::GroupConfig;
use keel_protocol::FieldError;
use std::future::Future;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use keel_protocol::Subjects;
use keel_protocol::subjects::is_subject_token;

pub const SERVICE: &str = "trainer";

/// Configuration: defaults, then `--config FILE`, then `KEEL_TRAINER__<FIELD>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// HTTP address (health).
    pub listen: SocketAddr,
    /// NATS server (default `KEEL_NATS_URL` or nats://127.0.0.1:4222).
    pub nats_url: String,
    /// Prefix of every subject (`keel.v1`).
    pub subject_prefix: String,
    /// This worker's id in its subjects (default: a new random id).
    pub worker_id: Option<String>,
    /// Default device for runs that name none: cpu, cuda or cuda:N.
    pub device: String,
    /// JetStream object-store bucket for batches larger than 1 MiB.
    pub bulk_bucket: String,
    /// The longest lease a run may ask for, in seconds.
    pub max_lease_seconds: f64,
    /// The directories `load` may read models from and `save` may write into (a path a
    /// request names must resolve inside one). Default: `.keel`, `/var/lib/keel` and the
    /// system's temporary directory.
    pub path_roots: Vec<std::path::PathBuf>,
    /// When set, `/metrics` wants `Authorization: Bearer <api_token>` (`/healthz` stays
    /// open). Default: `KEEL_TRAINER_TOKEN` when set.
    pub api_token: Option<String>,
    /// This process as one rank of a group of trainer processes (`{name, rank, size}`; see
    /// [`group`]). Unset: the worker runs a run's ranks as threads of its own.
    #[serde(default)]
    pub group: Option<GroupConfig>,
}

impl keel_service::ServiceConfig for Config {
    fn validate(&self) -> std::result::Result<(), FieldError> {
        keel_service::refuse_published_token(self.listen, self.api_token.as_deref(), "api_token")?;
        Subjects::new(&self.subject_prefix).map_err(|e| FieldError::new("subject_prefix", e.to_string()))?;
        if let Some(id) = &self.worker_id
            && !is_subject_token(id)
        {
            return Err(FieldError::new("worker_id", format!("`{id}` must be letters, digits, `-` and `_`")));
        }
        if self.worker_id.as_deref() == Some("group") {
            return Err(FieldError::new("worker_id", "`group` is reserved (the subjects of trainer groups)"));
        }
        let device_ok = self.device == "cpu"
            || self.device == "cuda"
            || self.device.strip_prefix("cuda:").is_some_and(|n| n.parse::<usize>().is_ok());
        if !device_ok {
            return Err(FieldError::new(
                "device",
                format!("unknown device `{}` (use cpu, cuda or cuda:N)", self.device),
            ));
        }
        if !(self.max_lease_seconds.is_finite() && self.max_lease_seconds > 0.0) {
            return Err(FieldError::new(
                "max_lease_seconds",
                format!("must be positive, got {}", self.max_lease_seconds),
            ));
        }
        if self.api_token.as_deref() == Some("") {
            return Err(FieldError::new("api_token", "must not be empty (leave it unset for no auth)"));
        }
        if let Some((field, message)) = self.group.as_ref().and_then(GroupConfig::problem) {
            return Err(FieldError::new(field, message));
        }
        Ok(())
    }
}

pub fn default_config() -> Config {
    Config {
        listen: SocketAddr::from(([127, 0, 0, 1], 8084)),
        nats_url: keel_service::nats::default_url(),
        subject_prefix: Subjects::default().prefix().to_string(),
        worker_id: None,
        device: "cpu".into(),
        bulk_bucket: "keel-bulk".into(),
        max_lease_seconds: 3600.0,
        path_roots: keel_service::paths::default_roots(),
        api_token: std::env::var("KEEL_TRAINER_TOKEN").ok().filter(|t| !t.is_empty()),
        group: None,
    }
}

/// Serves NATS requests and HTTP health until `shutdown` completes.
pub async fn run(config: Config, shutdown: impl Future<Output = ()> + Send + 'static) -> keel_service::Result<()> {
    let client = keel_service::nats::connect(&config.nats_url).await?;
    let bulk = keel_service::nats::Bulk::open(client.clone(), &config.bulk_bucket).await?;
    let subjects = Subjects::new(&config.subject_prefix)?;
    let worker_id = config.worker_id.clone().unwrap_or_else(|| format!("w{}", uuid::Uuid::new_v4().simple()));
    let roots = keel_service::paths::PathRoots::new(&config.path_roots, "KEEL_TRAINER__PATH_ROOTS")?;
    let meeting = match &config.group {
        Some(group) => Some(
            group::Meeting::new(client.clone(), subjects.prefix(), SERVICE, group.clone(), &config.nats_url)
                .map_err(|e| keel_service::Error::start("find this rank's address", e))?,
        ),
        None => None,
    };
    if let Some(meeting) = meeting.clone().filter(|m| m.config.rank > 0) {
        return follow(config, meeting, shutdown).await;
    }
    let worker = worker::Worker::new(client, subjects, worker_id, &config, bulk, roots, meeting)
        .map_err(|e| keel_service::Error::start("start the engine thread", e))?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let http_stop = {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };
    let claimed = worker.claimed_probe();
    keel_service::metrics::install();
    metrics::describe_gauge!("keel_trainer_claimed", "1 while a run holds this worker.");
    let metrics = move || {
        let claimed = claimed.clone();
        async move {
            keel_service::metrics::set_gauge("keel_trainer_claimed", &[], f64::from(u8::from(claimed())));
            keel_service::metrics::response()
        }
    };
    let metrics = keel_service::require_bearer(
        axum::Router::new().route("/metrics", axum::routing::get(metrics)),
        config.api_token.clone(),
    );
    let app = metrics.merge(keel_service::health_routes(SERVICE));
    let http = tokio::spawn(keel_service::run_http(SERVICE, config.listen, app, http_stop));
    let worker_stop = {
        let mut rx = stop_rx;
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };
    let mut served = tokio::spawn(worker.serve(worker_stop));
    let outcome = tokio::select! {
        () = shutdown => None,
        finished = &mut served => Some(finished),
    };
    let _ = stop_tx.send(true);
    let served = match outcome {
        Some(finished) => finished,
        None => served.await,
    };
    let served = served.map_err(|e| keel_service::Error::Part { part: "worker", reason: e.to_string() })?;
    http.await.map_err(|e| keel_service::Error::Part { part: "http", reason: e.to_string() })??;
    served
}

/// A follower rank of a trainer group: no requests of its own, only the leader's commands
/// (see [`group`]), and HTTP health until `shutdown` completes.
async fn follow(
    config: Config,
    meeting: group::Meeting,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> keel_service::Result<()> {
    let engine = keel_training::actor::EngineThread::start()
        .map_err(|e| keel_service::Error::start("start the engine thread", e))?;
    tracing::info!(group = %meeting.config.name, rank = meeting.config.rank, "trainer group follower ready");
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let http_stop = async move {
        let _ = stop_rx.wait_for(|stop| *stop).await;
    };
    let metrics = keel_service::require_bearer(
        axum::Router::new().route("/metrics", axum::routing::get(keel_service::metrics::handler)),
        config.api_token.clone(),
    );
    let app = metrics.merge(keel_service::health_routes(SERVICE));
    let http = tokio::spawn(keel_service::run_http(SERVICE, config.listen, app, http_stop));
    let following = tokio::spawn(group::follow(meeting, engine, config.device.clone()));
    shutdown.await;
    following.abort();
    let _ = stop_tx.send(true);
    http.await.map_err(|e| keel_service::Error::Part { part: "http", reason: e.to_string() })??;
    Ok(())
}

// The settings reference names every field of this service's configuration.
#[cfg(test)]
keel_testkit::settings_reference_test!();
