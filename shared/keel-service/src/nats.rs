//! NATS helpers: connecting (with a clear error); [`served`] and [`server_span`], which put
//! the handling of a request in a span that continues the sender's trace (W3C headers) and
//! record its latency; and [`Bulk`], which carries message bodies too large for one NATS
//! message (over [`MAX_INLINE_BYTES`]) through a JetStream object store bucket. Objects
//! expire after a day, so an abandoned batch does not stay forever.

use std::time::Duration;

use async_nats::jetstream::{self, object_store};
use keel_protocol::{MAX_INLINE_BYTES, ObjectRef, Payload};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::io::AsyncReadExt;

/// The default NATS URL, or `KEEL_NATS_URL` when set.
pub fn default_url() -> String {
    std::env::var("KEEL_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// Connects to `url`.
pub async fn connect(url: &str) -> Result<async_nats::Client, String> {
    async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .map_err(|e| format!("cannot connect to NATS at {url}: {e}"))
}

/// A server span for handling `message` as `operation` (e.g. `trainer.train`), a child of
/// the trace context its headers carry. Handlers may record its `run_id`.
pub fn server_span(operation: &str, message: &async_nats::Message) -> tracing::Span {
    let span = tracing::info_span!(
        "nats.server",
        otel.name = operation,
        otel.kind = "server",
        messaging.system = "nats",
        messaging.destination.name = %message.subject,
        messaging.message.body.size = message.payload.len(),
        run_id = tracing::field::Empty,
        error = tracing::field::Empty,
    );
    keel_telemetry::set_nats_parent(&span, message.headers.as_ref());
    span
}

/// Runs `handle` (which makes the reply body) inside [`server_span`] and records its
/// latency in `keel_nats_request_duration_seconds{operation, outcome}`; `outcome` is
/// `error` when the reply is a Keel error envelope.
pub async fn served<F>(operation: &str, message: &async_nats::Message, handle: F) -> Vec<u8>
where
    F: std::future::Future<Output = Vec<u8>>,
{
    use tracing::Instrument;
    let span = server_span(operation, message);
    let started = std::time::Instant::now();
    let body = handle.instrument(span.clone()).await;
    let failed = body.starts_with(b"{\"error\"");
    if failed {
        span.record("error", true);
    }
    crate::metrics::observe(
        "keel_nats_request_duration_seconds",
        "NATS requests served, by operation and outcome, and their latency.",
        &[("operation", operation), ("outcome", if failed { "error" } else { "ok" })],
        started.elapsed().as_secs_f64(),
    );
    body
}

/// Room left in a message for the fields around an inline body.
const ENVELOPE_MARGIN: usize = 64 * 1024;

/// How long bulk objects are kept.
const OBJECT_MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// Bulk payloads in one object-store bucket.
#[derive(Clone)]
pub struct Bulk {
    store: object_store::ObjectStore,
    bucket: String,
}

impl std::fmt::Debug for Bulk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bulk").field("bucket", &self.bucket).finish()
    }
}

impl Bulk {
    /// Opens `bucket`, creating it when it does not exist.
    pub async fn open(client: async_nats::Client, bucket: &str) -> Result<Self, String> {
        let js = jetstream::new(client);
        let store = match js.get_object_store(bucket).await {
            Ok(store) => store,
            Err(_) => js
                .create_object_store(object_store::Config {
                    bucket: bucket.to_string(),
                    max_age: OBJECT_MAX_AGE,
                    ..Default::default()
                })
                .await
                .map_err(|e| format!("cannot create the object store bucket `{bucket}`: {e}"))?,
        };
        Ok(Self { store, bucket: bucket.to_string() })
    }

    /// `value` inline when it is small, else stored as a new object.
    pub async fn wrap<T: Serialize>(&self, value: T) -> Result<Payload<T>, String> {
        let bytes = serde_json::to_vec(&value).map_err(|e| format!("cannot encode payload: {e}"))?;
        if bytes.len() + ENVELOPE_MARGIN <= MAX_INLINE_BYTES {
            return Ok(Payload::Inline(value));
        }
        Ok(Payload::Object(self.put(&bytes).await?))
    }

    /// Stores `bytes` under a fresh name.
    pub async fn put(&self, bytes: &[u8]) -> Result<ObjectRef, String> {
        let name = format!("bulk-{}", uuid_like());
        let mut reader = bytes;
        self.store
            .put(name.as_str(), &mut reader)
            .await
            .map_err(|e| format!("cannot store payload `{name}` in bucket `{}`: {e}", self.bucket))?;
        Ok(ObjectRef { bucket: self.bucket.clone(), name })
    }

    /// The body of `payload`, fetched when it is a reference (from this bucket only).
    pub async fn fetch<T: DeserializeOwned>(&self, payload: Payload<T>) -> Result<T, String> {
        let object = match payload {
            Payload::Inline(value) => return Ok(value),
            Payload::Object(object) => object,
        };
        if object.bucket != self.bucket {
            return Err(format!("payload is in bucket `{}`, this service reads `{}`", object.bucket, self.bucket));
        }
        let mut reader =
            self.store.get(&object.name).await.map_err(|e| format!("cannot fetch payload `{}`: {e}", object.name))?;
        let mut bytes = Vec::new();
        reader.read_to_end(&mut bytes).await.map_err(|e| format!("cannot read payload `{}`: {e}", object.name))?;
        serde_json::from_slice(&bytes).map_err(|e| format!("payload `{}` is not valid: {e}", object.name))
    }
}

/// A unique object name part: time and a process-wide counter.
fn uuid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{nanos:x}-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed))
}
