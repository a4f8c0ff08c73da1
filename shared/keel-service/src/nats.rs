//! NATS helpers: connecting (with a clear error); [`request`], whose timeout is the
//! caller's and travels with it, and [`caller_timeout`] on the receiving side; [`served`]
//! and [`server_span`], which put
//! the handling of a request in a span that continues the sender's trace (W3C headers),
//! record its latency and tell the sender the work is still going on (so a request whose
//! receiver died is given up in [`SILENCE_LIMIT`], not at its full timeout); and [`Bulk`], which carries message bodies too large for one NATS
//! message (over [`MAX_INLINE_BYTES`]) through a JetStream object store bucket. Objects
//! expire after a day, so an abandoned batch does not stay forever.

use std::time::Duration;

use async_nats::jetstream::{self, object_store};
use keel_protocol::{MAX_INLINE_BYTES, ObjectRef, Payload};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::io::AsyncReadExt;

use crate::error::{BulkError, Error};

/// The default NATS URL, or `KEEL_NATS_URL` when set.
pub fn default_url() -> String {
    std::env::var("KEEL_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// Connects to `url`; a user and password in it (`nats://user:password@host:4222`) are the
/// credentials the server's authorization wants. Errors show the URL without the password.
///
/// A client with a user gets its replies under an inbox prefix of its own ([`inbox_prefix`]:
/// `_INBOX_trainer.…`), so that the server's permissions can let each user read only its own
/// replies and answer only the users that ask it (`docker/nats.conf`).
pub async fn connect(url: &str) -> Result<async_nats::Client, Error> {
    let failed = |reason: String| Error::NatsConnect { url: redacted(url), reason };
    let address: async_nats::ServerAddr = url.parse().map_err(|e| failed(format!("not a NATS URL: {e}")))?;
    let mut options = async_nats::ConnectOptions::new().connection_timeout(Duration::from_secs(5));
    if let Some(user) = address.username() {
        let password = address.password().unwrap_or_default();
        let user = decoded(user);
        options = async_nats::ConnectOptions::with_user_and_password(user.clone(), decoded(password))
            .connection_timeout(Duration::from_secs(5));
        if let Some(prefix) = inbox_prefix(&user) {
            options = options.custom_inbox_prefix(prefix);
        }
    }
    options.connect(address).await.map_err(|e| failed(e.to_string()))
}

/// The inbox prefix of NATS user `user`: `_INBOX_<user>`, when the name is a subject token's
/// letters, digits, `-` and `_` (else the default `_INBOX`).
pub fn inbox_prefix(user: &str) -> Option<String> {
    let token = !user.is_empty() && user.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    token.then(|| format!("_INBOX_{user}"))
}

/// `url` with its password replaced by `***`.
pub fn redacted(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((credentials, host)) => {
                let user = credentials.split(':').next().unwrap_or_default();
                if credentials.contains(':') {
                    format!("{scheme}://{user}:***@{host}")
                } else {
                    format!("{scheme}://{user}@{host}")
                }
            }
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

/// A URL's user or password with its percent-escapes (`%40` for `@`) decoded.
fn decoded(part: &str) -> String {
    let bytes = part.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1).copied().and_then(hex), bytes.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(high), Some(low)) => {
                out.push((high * 16 + low) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The header in which a request says how long its sender waits for the reply, in
/// milliseconds: past that the sender has given up, and a receiver stops the work.
pub const TIMEOUT_HEADER: &str = "Keel-Timeout-Ms";

/// The header in which a request asks its receiver to say, every so many milliseconds,
/// that the work is still going on ([`served`] does).
pub const PROGRESS_HEADER: &str = "Keel-Progress-Ms";

/// The header that marks a message on a request's reply subject as a sign of progress
/// rather than the reply.
pub const WORKING_HEADER: &str = "Keel-Working";

/// How often a receiver says it is still working on a request (more often when the
/// sender's silence limit is shorter than three of these).
pub const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// A receiver that said it was working and then stayed silent this long is taken for gone
/// (killed, partitioned away): the request fails as timed out, long before its own timeout.
pub const SILENCE_LIMIT: Duration = Duration::from_secs(30);

/// Sends a request and waits up to `timeout` for its reply — this timeout, not the client's
/// default (async-nats gives up after 10 s unless told otherwise) — and tells the receiver
/// in [`TIMEOUT_HEADER`]. The receiver is asked for progress ([`PROGRESS_HEADER`]), which
/// [`served`] gives at once and then every few seconds: silence for [`SILENCE_LIMIT`] —
/// since the request was sent or since the last sign of life — ends the wait early (as
/// `TimedOut`), so a request delivered to a receiver that died before it could answer is
/// given up in seconds. Every receiver of Keel's requests answers through [`served`].
pub async fn request(
    client: &async_nats::Client,
    subject: String,
    headers: async_nats::HeaderMap,
    body: Vec<u8>,
    timeout: Duration,
) -> Result<async_nats::Message, async_nats::RequestError> {
    request_within(client, subject, headers, body, timeout, SILENCE_LIMIT).await
}

/// [`request`] with a silence limit of the caller's.
pub async fn request_within(
    client: &async_nats::Client,
    subject: String,
    mut headers: async_nats::HeaderMap,
    body: Vec<u8>,
    timeout: Duration,
    silence: Duration,
) -> Result<async_nats::Message, async_nats::RequestError> {
    use async_nats::{RequestError, RequestErrorKind};
    use futures::StreamExt;
    headers.insert(TIMEOUT_HEADER, timeout.as_millis().to_string());
    // At least three signs of life fit in the silence limit.
    headers.insert(PROGRESS_HEADER, PROGRESS_EVERY.min(silence / 3).as_millis().to_string());
    let other = |e: &dyn std::fmt::Display| RequestError::with_source(RequestErrorKind::Other, e.to_string());
    let inbox = client.new_inbox();
    let mut replies = client.subscribe(inbox.clone()).await.map_err(|e| other(&e))?;
    client.publish_with_reply_and_headers(subject, inbox, headers, body.into()).await.map_err(|e| other(&e))?;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut heard = false;
    loop {
        let wait = deadline.min(tokio::time::Instant::now() + silence);
        match tokio::time::timeout_at(wait, replies.next()).await {
            Ok(Some(message)) if message.status == Some(async_nats::StatusCode::NO_RESPONDERS) => {
                return Err(RequestError::new(RequestErrorKind::NoResponders));
            }
            Ok(Some(message)) if message.headers.as_ref().is_some_and(|h| h.get(WORKING_HEADER).is_some()) => {
                heard = true;
            }
            Ok(Some(message)) => return Ok(message),
            Ok(None) => return Err(other(&"the connection closed before the reply")),
            Err(_) if wait < deadline => {
                let seconds = silence.as_secs_f64();
                let silent = if heard {
                    format!("the receiver was working on it, then silent for {seconds:.0} s")
                } else {
                    format!("no receiver said it was working on it within {seconds:.0} s")
                };
                return Err(RequestError::with_source(RequestErrorKind::TimedOut, silent));
            }
            Err(_) => return Err(RequestError::new(RequestErrorKind::TimedOut)),
        }
    }
}

/// How long the sender of `message` waits for its reply, when it said ([`request`]).
pub fn caller_timeout(message: &async_nats::Message) -> Option<Duration> {
    let value = message.headers.as_ref()?.get(TIMEOUT_HEADER)?;
    value.as_str().parse::<u64>().ok().map(Duration::from_millis)
}

/// How often the sender of `message` wants to hear the work is going on, when it asked.
fn progress_every(message: &async_nats::Message) -> Option<Duration> {
    let value = message.headers.as_ref()?.get(PROGRESS_HEADER)?;
    value.as_str().parse::<u64>().ok().map(|ms| Duration::from_millis(ms.max(100)))
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
        error.type = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        otel.status_description = tracing::field::Empty,
    );
    keel_telemetry::set_nats_parent(&span, message.headers.as_ref());
    span
}

/// Runs `handle` (which makes the reply body) inside [`server_span`] and records its
/// latency in `keel_nats_request_duration_seconds{operation, outcome}`; `outcome` is
/// `error` when the reply is a Keel error envelope, and the span then has error status with
/// the envelope's type and message. While it runs, a sender that asked
/// ([`PROGRESS_HEADER`]) is told the work is going on, at once and then every interval it
/// asked for (at least 100 ms).
pub async fn served<F>(
    client: &async_nats::Client,
    operation: &str,
    message: &async_nats::Message,
    handle: F,
) -> Vec<u8>
where
    F: std::future::Future<Output = Vec<u8>>,
{
    use tracing::Instrument;
    let span = server_span(operation, message);
    let started = std::time::Instant::now();
    let progress = progress_every(message).zip(message.reply.clone()).map(|(every, reply)| {
        let client = client.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(WORKING_HEADER, "1");
                if client.publish_with_headers(reply.clone(), headers, Default::default()).await.is_err() {
                    return;
                }
            }
        })
    });
    let body = handle.instrument(span.clone()).await;
    if let Some(progress) = progress {
        progress.abort();
    }
    let failed = body.starts_with(b"{\"error\"");
    if failed {
        // The span says why: the envelope's type and message.
        span.record("error", true);
        span.record("otel.status_code", "ERROR");
        if let Ok(keel_protocol::reply::Reply::<serde_json::Value>::Error(why)) = serde_json::from_slice(&body) {
            span.record("error.type", why.kind.as_str());
            span.record("otel.status_description", why.to_string().as_str());
        }
    }
    crate::metrics::observe(
        crate::metrics::NATS_REQUESTS,
        &[("operation", operation), ("outcome", if failed { "error" } else { "ok" })],
        started.elapsed().as_secs_f64(),
    );
    body
}

/// Room left in a message for the fields around an inline body.
const ENVELOPE_MARGIN: usize = 64 * 1024;

/// The largest chunk of a stored object (NATS's default 1 MiB message limit, less room for
/// headers); a server with a smaller limit gets smaller chunks.
const OBJECT_CHUNK_BYTES: usize = 960 << 10;

/// How long bulk objects are kept.
const OBJECT_MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// Bulk payloads in one object-store bucket.
#[derive(Clone)]
pub struct Bulk {
    store: object_store::ObjectStore,
    bucket: String,
    /// Chunk size of stored objects: what fits in one of the server's messages.
    chunk_bytes: usize,
}

impl std::fmt::Debug for Bulk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bulk").field("bucket", &self.bucket).finish()
    }
}

impl Bulk {
    /// Opens `bucket`, creating it when it does not exist.
    pub async fn open(client: async_nats::Client, bucket: &str) -> Result<Self, BulkError> {
        let chunk_bytes = client.server_info().max_payload.saturating_sub(64 << 10).clamp(64 << 10, OBJECT_CHUNK_BYTES);
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
                .map_err(|e| BulkError::Open { bucket: bucket.to_string(), reason: e.to_string() })?,
        };
        Ok(Self { store, bucket: bucket.to_string(), chunk_bytes })
    }

    /// `value` inline when it is small, else stored as a new object.
    pub async fn wrap<T: Serialize>(&self, value: T) -> Result<Payload<T>, BulkError> {
        let bytes = serde_json::to_vec(&value).map_err(BulkError::Encode)?;
        if bytes.len() + ENVELOPE_MARGIN <= MAX_INLINE_BYTES {
            return Ok(Payload::Inline(value));
        }
        Ok(Payload::Object(self.put(&bytes).await?))
    }

    /// Stores `bytes` under a fresh name, in chunks just under the server's message limit
    /// (1 MiB by default): each chunk is one acknowledged publish, so fewer, larger chunks store
    /// a large body in fewer round trips (16 MiB: 18 chunks instead of 128 of the default
    /// 128 KiB).
    pub async fn put(&self, bytes: &[u8]) -> Result<ObjectRef, BulkError> {
        let name = format!("bulk-{}", uuid_like());
        let mut reader = bytes;
        let meta = object_store::ObjectMetadata {
            name: name.clone(),
            chunk_size: Some(self.chunk_bytes),
            ..Default::default()
        };
        self.store.put(meta, &mut reader).await.map_err(|e| BulkError::Put {
            bucket: self.bucket.clone(),
            name: name.clone(),
            reason: e.to_string(),
        })?;
        Ok(ObjectRef { bucket: self.bucket.clone(), name })
    }

    /// The body of `payload`, fetched when it is a reference (from this bucket only).
    pub async fn fetch<T: DeserializeOwned>(&self, payload: Payload<T>) -> Result<T, BulkError> {
        let object = match payload {
            Payload::Inline(value) => return Ok(value),
            Payload::Object(object) => object,
        };
        let bytes = self.get(&object).await?;
        serde_json::from_slice(&bytes).map_err(|source| BulkError::Invalid { name: object.name, source })
    }

    /// The bytes of `object` (from this bucket only).
    pub async fn get(&self, object: &ObjectRef) -> Result<Vec<u8>, BulkError> {
        self.ours(object)?;
        let failed = |reason: String| BulkError::Get { name: object.name.clone(), reason };
        let mut reader = self.store.get(&object.name).await.map_err(|e| failed(e.to_string()))?;
        let mut bytes = Vec::new();
        reader.read_to_end(&mut bytes).await.map_err(|e| failed(e.to_string()))?;
        Ok(bytes)
    }

    /// Deletes `object` (from this bucket only); one that is already gone is no error.
    pub async fn delete(&self, object: &ObjectRef) -> Result<(), BulkError> {
        self.ours(object)?;
        match self.store.delete(&object.name).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == object_store::DeleteErrorKind::NotFound => Ok(()),
            Err(e) => Err(BulkError::Delete { name: object.name.clone(), reason: e.to_string() }),
        }
    }

    /// Refuses an object of another bucket (a service reads and writes its own only).
    fn ours(&self, object: &ObjectRef) -> Result<(), BulkError> {
        if object.bucket == self.bucket {
            Ok(())
        } else {
            Err(BulkError::ForeignBucket { found: object.bucket.clone(), ours: self.bucket.clone() })
        }
    }

    /// The bucket's name.
    pub fn bucket(&self) -> &str {
        &self.bucket
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

    /// A receiver that says it is working is waited for past the silence limit, for as long
    /// as the request's timeout; one that said so and then went quiet (killed mid-request), or
    /// never said anything (killed as the request arrived), is given up after the silence
    /// limit; a subject nobody serves fails at once.
    #[tokio::test]
    async fn a_working_receiver_is_waited_for_and_a_silent_one_is_given_up_early() {
        let client = connect(&default_url()).await.unwrap();
        let subject = format!("keeltest.progress.{}", uuid_like());
        let mut requests = client.subscribe(subject.clone()).await.unwrap();
        client.flush().await.unwrap();
        let responder = {
            let client = client.clone();
            tokio::spawn(async move {
                while let Some(message) = requests.next().await {
                    let client = client.clone();
                    tokio::spawn(async move {
                        if &message.payload[..] == b"slow" {
                            let body = served(&client, "test.slow", &message, async {
                                tokio::time::sleep(Duration::from_millis(2500)).await;
                                b"done".to_vec()
                            })
                            .await;
                            client.publish(message.reply.unwrap(), body.into()).await.unwrap();
                        } else if &message.payload[..] == b"mute" {
                            // Dies as the request arrives, before it can say anything.
                        } else {
                            // Says it is working, then dies without a word.
                            let mut headers = async_nats::HeaderMap::new();
                            headers.insert(WORKING_HEADER, "1");
                            client
                                .publish_with_headers(message.reply.unwrap(), headers, Default::default())
                                .await
                                .unwrap();
                        }
                    });
                }
            })
        };
        let headers = async_nats::HeaderMap::new;
        let (timeout, silence) = (Duration::from_secs(20), Duration::from_secs(1));
        let reply =
            request_within(&client, subject.clone(), headers(), b"slow".to_vec(), timeout, silence).await.unwrap();
        assert_eq!(&reply.payload[..], b"done", "progress kept a 2.5 s request alive past a 1 s silence limit");
        // With a ten-minute timeout, only the silence limit can end this one.
        let long = Duration::from_secs(600);
        let error =
            request_within(&client, subject.clone(), headers(), b"dies".to_vec(), long, silence).await.unwrap_err();
        assert_eq!(error.kind(), async_nats::RequestErrorKind::TimedOut);
        assert!(error.to_string().contains("silent for 1 s"), "{error}");
        let error =
            request_within(&client, subject.clone(), headers(), b"mute".to_vec(), long, silence).await.unwrap_err();
        assert_eq!(error.kind(), async_nats::RequestErrorKind::TimedOut);
        assert!(error.to_string().contains("no receiver said it was working on it within 1 s"), "{error}");
        let nobody = format!("keeltest.nobody.{}", uuid_like());
        let error = request(&client, nobody, headers(), b"x".to_vec(), timeout).await.unwrap_err();
        assert_eq!(error.kind(), async_nats::RequestErrorKind::NoResponders);
        responder.abort();
    }

    #[test]
    fn urls_are_shown_without_their_password_and_credentials_are_decoded() {
        assert_eq!(redacted("nats://trainer:s3cret@nats:4222"), "nats://trainer:***@nats:4222");
        assert_eq!(redacted("nats://token@nats:4222"), "nats://token@nats:4222");
        assert_eq!(redacted("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(decoded("p%40ss%3Aword"), "p@ss:word");
        assert_eq!(decoded("plain%zz"), "plain%zz");
    }
}
