//! NATS helpers: connecting (with a clear error); [`request`], whose timeout is the
//! caller's and travels with it, and [`caller_timeout`] on the receiving side; [`served`]
//! and [`server_span`], which put
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

/// The header in which a request says how long its sender waits for the reply, in
/// milliseconds: past that the sender has given up, and a receiver stops the work.
pub const TIMEOUT_HEADER: &str = "Keel-Timeout-Ms";

/// Sends a request and waits up to `timeout` for its reply — this timeout, not the client's
/// default (async-nats gives up after 10 s unless told otherwise) — and tells the receiver
/// in [`TIMEOUT_HEADER`].
pub async fn request(
    client: &async_nats::Client,
    subject: String,
    mut headers: async_nats::HeaderMap,
    body: Vec<u8>,
    timeout: Duration,
) -> Result<async_nats::Message, async_nats::RequestError> {
    headers.insert(TIMEOUT_HEADER, timeout.as_millis().to_string());
    let request = async_nats::Request::new().headers(headers).payload(body.into()).timeout(Some(timeout));
    client.send_request(subject, request).await
}

/// How long the sender of `message` waits for its reply, when it said ([`request`]).
pub fn caller_timeout(message: &async_nats::Message) -> Option<Duration> {
    let value = message.headers.as_ref()?.get(TIMEOUT_HEADER)?;
    value.as_str().parse::<u64>().ok().map(Duration::from_millis)
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use futures::StreamExt;

    use super::*;

    /// Against the real NATS: a client whose default request timeout (1 s) is shorter than
    /// the reply takes (1.5 s) still gets it when the request's own timeout is longer, and
    /// the receiver reads that timeout; a shorter own timeout gives up.
    #[tokio::test]
    async fn a_request_waits_for_its_own_timeout_and_tells_the_receiver() {
        let client = async_nats::ConnectOptions::new()
            .request_timeout(Some(Duration::from_secs(1)))
            .connect(default_url())
            .await
            .unwrap();
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let subject = format!("keeltest.timeout.{}.{nanos}", std::process::id());
        let mut requests = client.subscribe(subject.clone()).await.unwrap();
        client.flush().await.unwrap();
        let responder = {
            let client = client.clone();
            tokio::spawn(async move {
                while let Some(message) = requests.next().await {
                    let said = caller_timeout(&message).map_or(0, |t| t.as_millis());
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    if let Some(reply) = message.reply {
                        client.publish(reply, said.to_string().into()).await.unwrap();
                    }
                }
            })
        };
        let headers = async_nats::HeaderMap::new;
        let reply = request(&client, subject.clone(), headers(), b"x".to_vec(), Duration::from_secs(4)).await.unwrap();
        assert_eq!(&reply.payload[..], b"4000", "the receiver reads the caller's timeout");
        let error = request(&client, subject, headers(), b"x".to_vec(), Duration::from_millis(300)).await.unwrap_err();
        assert_eq!(error.kind(), async_nats::RequestErrorKind::TimedOut);
        responder.abort();
    }
}
