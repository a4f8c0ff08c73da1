//! keel-generator: the inference engine (KV cache, continuous batching) behind an OpenAI-compatible API.
//!
//! So far the service starts, loads its configuration (an HTTP address, default
//! 127.0.0.1:8081) and answers `GET /healthz`, tested with the binary in
//! `tests/services_start.rs`.

use std::future::Future;

pub const SERVICE: &str = "generator";

/// Configuration: defaults, then `--config FILE`, then `KEEL_GENERATOR__<FIELD>`.
pub type Config = keel_service::HttpConfig;

pub fn default_config() -> Config {
    Config::on_port(8081)
}

/// Serves until `shutdown` completes.
pub async fn run(config: Config, shutdown: impl Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    keel_service::run_http(SERVICE, config.listen, keel_service::health_routes(SERVICE), shutdown).await
}
