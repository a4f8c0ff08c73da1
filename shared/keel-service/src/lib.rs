//! The skeleton every Keel service shares.
//!
//! Layout:
//! - [`config`]: defaults → YAML file → `KEEL_<SERVICE>__<FIELD>` environment, validated once.
//! - [`http`]: the `/healthz` route, the JSON error body and 404 fallback, serving with
//!   graceful shutdown.
//! - [`entry`]: what a service's `main.rs` calls: flags, config, logging, runtime, signals.
//! - [`json`]: decoding request bodies with errors that name the field path.
//! - [`lease`]: a claimed worker's side of its claim by a run (trainers and generators).
//! - [`metrics`]: the Prometheus text format for `GET /metrics`.
//! - [`parts`]: a service's concurrent parts, stopped together.
//! - [`postgres`]: a pool in the service's own schema, its migrations applied.
//! - [`nats`]: connecting to NATS and moving bulk payloads through the JetStream object store.

pub mod config;
pub mod entry;
pub mod error;
pub mod http;
pub mod hub;
pub mod json;
pub mod lease;
pub mod metrics;
pub mod nats;
pub mod openapi;
pub mod outbound;
pub mod parts;
pub mod paths;
pub mod postgres;
pub mod query;

pub use config::{ConfigError, HttpConfig, PUBLISHED_SECRETS, ServiceConfig, load_config, refuse_published_token};
pub use entry::service_main;
pub use error::{BulkError, Error, PathError, PostgresError, Result};
pub use http::{
    ApiError, bearer_matches, bind_http, cookie, health_routes, request_bearer, require_bearer, require_bearer_or,
    run_http, run_http_on, serve, token_matches,
};
