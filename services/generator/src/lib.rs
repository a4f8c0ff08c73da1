//! keel-generator: the inference engine (KV cache, continuous batching) behind an OpenAI-compatible API.
//!
//! So far the service starts, loads its [`Config`] and answers `GET /healthz` (tested with
//! the binary in `tests/services_start.rs`); [`app`] is its router and [`run`] serves it
//! until shutdown.

use std::future::Future;
use std::net::SocketAddr;

use axum::Router;
use serde::{Deserialize, Serialize};

pub const SERVICE: &str = "generator";

/// Configuration: defaults, then `--config FILE`, then `KEEL_GENERATOR__<FIELD>`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// HTTP address (default 127.0.0.1:8081).
    pub listen: SocketAddr,
}

impl Default for Config {
    fn default() -> Self {
        Self { listen: SocketAddr::from(([127, 0, 0, 1], 8081)) }
    }
}

impl keel_service::ServiceConfig for Config {
    const SERVICE: &'static str = SERVICE;

    fn listen(&self) -> SocketAddr {
        self.listen
    }
}

pub fn app(_config: &Config) -> Router {
    keel_service::health_routes(SERVICE)
}

pub async fn run(config: Config, shutdown: impl Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    keel_service::run_http(SERVICE, config.listen, app(&config), shutdown).await
}
