//! The skeleton every Keel service shares.
//!
//! Layout:
//! - [`config`]: defaults → YAML file → `KEEL_<SERVICE>__<FIELD>` environment, validated once.
//! - [`http`]: the `/healthz` route, the JSON error body and 404 fallback, serving with
//!   graceful shutdown.
//! - [`entry`]: what a service's `main.rs` calls: flags, config, logging, runtime, signals.

pub mod config;
pub mod http;
pub mod entry;

pub use config::{ConfigError, ServiceConfig, load_config};
pub use http::{ApiError, health_routes, run_http, serve};
pub use entry::service_main;
