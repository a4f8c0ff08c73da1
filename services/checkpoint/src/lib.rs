//! keel-checkpoint: the checkpoint store.
//!
//! Layout:
//! - [`api`]: the REST routes and their OpenAPI document.
//! - [`service`]: the operations: create, verified uploads, commit, retention, deletion,
//!   garbage collection, JetStream events.
//! - [`db`]: metadata in Postgres (schema `checkpoint`, migrations in `migrations/`).
//! - [`store`]: content-addressed blobs on an `object_store` backend (local directory, or
//!   S3 with the `s3` feature).
//! - [`retention`]: which checkpoints a policy keeps (file names are checked by
//!   `keel_protocol::checkpoint::check_path`).

pub mod api;
pub mod db;
pub mod retention;
pub mod service;
pub mod store;

use keel_protocol::FieldError;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub const SERVICE: &str = "checkpoint";

/// Where blobs live.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Storage {
    /// A local directory.
    Local { root: PathBuf },
    /// An S3-compatible bucket (needs the `s3` build feature); credentials from the usual
    /// `AWS_*` environment variables.
    S3 { bucket: String, endpoint: Option<String>, region: Option<String> },
}

/// Configuration: defaults, then `--config FILE`, then `KEEL_CHECKPOINT__<FIELD>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub listen: SocketAddr,
    pub database_url: String,
    pub storage: Storage,
    /// NATS for the checkpoint events (empty: no events).
    pub nats_url: String,
    pub subject_prefix: String,
    /// A pending checkpoint not committed within this many seconds is deleted.
    pub pending_expiry_seconds: f64,
    /// Uploads at once (each holds about 24 MiB of buffers); more get 503 with `Retry-After`.
    pub max_uploads: usize,
    /// When set, every route but `/healthz` wants `Authorization: Bearer <token>` (the
    /// orchestrator's `checkpoint_token`, the CLI's `--token`).
    pub api_token: Option<String>,
}

impl keel_service::ServiceConfig for Config {
    fn validate(&self) -> Result<(), FieldError> {
        keel_service::refuse_published_token(self.listen, self.api_token.as_deref(), "api_token")?;
        keel_protocol::Subjects::new(&self.subject_prefix)
            .map_err(|e| FieldError::new("subject_prefix", e.to_string()))?;
        if self.max_uploads == 0 {
            return Err(FieldError::new("max_uploads", "must be at least 1"));
        }
        if !(1.0..=1e8).contains(&self.pending_expiry_seconds) {
            return Err(FieldError::new("pending_expiry_seconds", "must be 1 to 100000000"));
        }
        if self.api_token.as_deref() == Some("") {
            return Err(FieldError::new("api_token", "must not be empty (leave it unset for no auth)"));
        }
        Ok(())
    }
}

pub fn default_config() -> Config {
    Config {
        listen: SocketAddr::from(([127, 0, 0, 1], 8083)),
        database_url: std::env::var("KEEL_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/keel".into()),
        storage: Storage::Local { root: PathBuf::from(".keel/checkpoints") },
        nats_url: keel_service::nats::default_url(),
        subject_prefix: keel_protocol::Subjects::default().prefix().to_string(),
        pending_expiry_seconds: 24.0 * 3600.0,
        max_uploads: 16,
        api_token: std::env::var("KEEL_CHECKPOINT_TOKEN").ok().filter(|t| !t.is_empty()),
    }
}

fn blob_store(storage: &Storage) -> Result<store::BlobStore, store::StoreError> {
    match storage {
        Storage::Local { root } => store::BlobStore::local(root),
        #[cfg(feature = "s3")]
        Storage::S3 { bucket, endpoint, region } => {
            let mut builder = object_store::aws::AmazonS3Builder::from_env().with_bucket_name(bucket);
            if let Some(endpoint) = endpoint {
                builder = builder.with_endpoint(endpoint).with_allow_http(true);
            }
            if let Some(region) = region {
                builder = builder.with_region(region);
            }
            let s3 = builder.build().map_err(|e| store::StoreError::Backend(format!("storage: {e}")))?;
            Ok(store::BlobStore::new(std::sync::Arc::new(s3)))
        }
        #[cfg(not(feature = "s3"))]
        Storage::S3 { .. } => {
            Err(store::StoreError::Backend("storage: kind s3 needs keel-checkpoint built with the `s3` feature".into()))
        }
    }
}

/// Connects to Postgres, the blob store and NATS.
pub async fn open(config: &Config) -> keel_service::Result<service::Checkpoints> {
    let pool = db::connect(&config.database_url).await?;
    let blobs = blob_store(&config.storage).map_err(|e| keel_service::Error::start("open the blob store", e))?;
    let events = match config.nats_url.as_str() {
        "" => None,
        url => {
            let client = keel_service::nats::connect(url).await?;
            let subjects = keel_protocol::Subjects::new(&config.subject_prefix)?;
            let events = service::Events::open(client, subjects).await;
            Some(events.map_err(|e| keel_service::Error::start("open the event stream", e))?)
        }
    };
    let uploads = std::sync::Arc::new(tokio::sync::Semaphore::new(config.max_uploads));
    Ok(service::Checkpoints { pool, blobs, events, uploads })
}

/// Serves until `shutdown` completes, sweeping abandoned uploads at start and hourly.
pub async fn run(config: Config, shutdown: impl Future<Output = ()> + Send + 'static) -> keel_service::Result<()> {
    let checkpoints = open(&config).await?;
    let sweeper = {
        let checkpoints = checkpoints.clone();
        let expiry = config.pending_expiry_seconds;
        tokio::spawn(async move {
            let mut every = tokio::time::interval(std::time::Duration::from_secs(3600));
            loop {
                every.tick().await;
                if let Err(e) = checkpoints.sweep(expiry).await {
                    tracing::warn!("sweep failed: {e}");
                }
            }
        })
    };
    let app = keel_service::require_bearer(api::routes(checkpoints), config.api_token.clone())
        .merge(keel_service::health_routes(SERVICE));
    let served = keel_service::run_http(SERVICE, config.listen, app, shutdown).await.map_err(keel_service::Error::Http);
    sweeper.abort();
    served
}

// The settings reference names every field of this service's configuration.
#[cfg(test)]
keel_testkit::settings_reference_test!();
