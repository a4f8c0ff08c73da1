//! keel-reward: environments and scorers behind NATS and REST.
//!
//! The environments and the scorer are the `keel-environments` library; this crate is its
//! process:
//! - [`api`]: REST (`/v1/score`, `/v1/env/step`, `/metrics`) and the OpenAPI document.
//! - [`nats`]: the queue group `reward` (scoring and environment steps).
//! - this file: configuration, the handlers' state, lifecycle.

pub mod api;
pub mod nats;

use keel_environments::{registry, sandbox, scoring};
use keel_protocol::FieldError;

use std::future::Future;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

pub const SERVICE: &str = "reward";

/// Configuration: defaults, then `--config FILE`, then `KEEL_REWARD__<FIELD>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub listen: SocketAddr,
    /// NATS server for the queue group and trainer requests (empty: REST only).
    pub nats_url: String,
    /// Prefix of every subject (`keel.v1`).
    pub subject_prefix: String,
    /// Requests scored at once before new ones get 503 / `unavailable`.
    pub max_in_flight: usize,
    /// Samples per request.
    pub max_samples: usize,
    /// The JetStream object-store bucket for bodies over 1 MiB (the trainers' `bulk_bucket`).
    pub bulk_bucket: String,
    pub sandbox: sandbox::SandboxConfig,
    /// Whether the `http` environment may call loopback, private and link-local addresses
    /// (a plugin on this host or network). Off: a run spec cannot make this service reach
    /// what only it can reach.
    pub http_allow_private_addresses: bool,
    /// Hosts (names or literal addresses) whose loopback or private addresses the `http` and
    /// `agent` environments may call while `http_allow_private_addresses` is off: an agent or
    /// plugin beside this service (`["agent"]` in Compose), and nothing else inside.
    pub http_private_hosts: Vec<String>,
    /// Whether the `http` and `agent` environments' calls go through the proxy that
    /// `HTTP_PROXY`/`HTTPS_PROXY`/`NO_PROXY` name. Off: those variables are ignored, since a
    /// proxy resolves names itself, where the private-address filter cannot see them.
    pub http_use_proxy: bool,
    /// When set, every route but `/healthz` wants `Authorization: Bearer <api_token>`.
    /// Default: `KEEL_REWARD_TOKEN` when set.
    pub api_token: Option<String>,
}

impl keel_service::ServiceConfig for Config {
    fn validate(&self) -> Result<(), FieldError> {
        keel_service::refuse_published_token(self.listen, self.api_token.as_deref(), "api_token")?;
        if self.max_in_flight == 0 {
            return Err(FieldError::new("max_in_flight", "must be at least 1"));
        }
        if self.max_samples == 0 {
            return Err(FieldError::new("max_samples", "must be at least 1"));
        }
        keel_protocol::Subjects::new(&self.subject_prefix)
            .map_err(|e| FieldError::new("subject_prefix", e.to_string()))?;
        if let Some(bad) = self.http_private_hosts.iter().find(|h| h.is_empty() || h.contains(['/', ' ', '\t'])) {
            return Err(FieldError::new(
                "http_private_hosts",
                format!("`{bad}` is not a host name or address (no scheme, port or path)"),
            ));
        }
        if self.api_token.as_deref() == Some("") {
            return Err(FieldError::new("api_token", "must not be empty (leave it unset for no auth)"));
        }
        self.sandbox.validate()
    }
}

pub fn default_config() -> Config {
    Config {
        listen: SocketAddr::from(([127, 0, 0, 1], 8082)),
        nats_url: keel_service::nats::default_url(),
        subject_prefix: keel_protocol::Subjects::default().prefix().to_string(),
        max_in_flight: 64,
        max_samples: 4096,
        bulk_bucket: "keel-bulk".into(),
        sandbox: sandbox::SandboxConfig::default(),
        http_allow_private_addresses: false,
        http_private_hosts: Vec::new(),
        http_use_proxy: false,
        api_token: std::env::var("KEEL_REWARD_TOKEN").ok().filter(|t| !t.is_empty()),
    }
}

/// The handlers' state for `config`, connected to `nats` when given.
pub fn state(config: &Config, nats: Option<async_nats::Client>) -> keel_service::Result<api::AppState> {
    let subjects = keel_protocol::Subjects::new(&config.subject_prefix)?;
    let ctx = registry::EnvContext::new(
        keel_service::outbound::PrivateAccess {
            all: config.http_allow_private_addresses,
            hosts: config.http_private_hosts.clone(),
            ..Default::default()
        },
        config.http_use_proxy,
        nats,
        subjects,
        config.bulk_bucket.clone(),
        config.sandbox.clone(),
    )
    .map_err(|e| keel_service::Error::start("build the HTTP client", e))?;
    let scorer = scoring::Scorer::new(ctx, config.max_in_flight, config.max_samples);
    Ok(api::AppState { scorer, max_in_flight: config.max_in_flight })
}

/// The HTTP routes: scoring, environment steps and metrics (behind `api_token` when set),
/// and `/healthz`.
pub fn app(state: api::AppState, api_token: Option<String>) -> axum::Router {
    keel_service::require_bearer(api::routes(state), api_token).merge(keel_service::health_routes(SERVICE))
}

/// Serves REST and, with a NATS URL, the reward queue group, until `shutdown` completes.
pub async fn run(config: Config, shutdown: impl Future<Output = ()> + Send + 'static) -> keel_service::Result<()> {
    let client = match config.nats_url.as_str() {
        "" => None,
        url => Some(keel_service::nats::connect(url).await?),
    };
    let state = state(&config, client.clone())?;
    if let Err(e) = state.scorer.sandbox().available().await {
        tracing::warn!("the code environment will refuse samples: {e}");
    }
    let mut parts = keel_service::parts::Parts::default();
    if let Some(client) = client {
        let subjects = keel_protocol::Subjects::new(&config.subject_prefix)?;
        parts.spawn("nats", nats::serve(client, subjects, state.scorer.clone(), parts.stopped()));
    }
    let app = app(state, config.api_token.clone());
    let http = keel_service::run_http(SERVICE, config.listen, app, parts.stopped());
    parts.spawn("http", http);
    parts.run_until(shutdown).await
}

// The settings reference names every field of this service's configuration.
#[cfg(test)]
keel_testkit::settings_reference_test!();
