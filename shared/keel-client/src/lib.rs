//! Typed clients for Keel's REST APIs, shared by the services that call each other and by
//! the `keel` command.
//!
//! Layout:
//! - [`checkpoint`]: the checkpoint store: upload a directory as a verified checkpoint,
//!   download one as a directory (every file checked against its sha256, appearing only when
//!   complete), export a tar, list and find the latest.
//! - [`runs`]: the orchestrator's run API (submit, list, show, metrics, samples, cancel).
//! - [`retry`]: waiting out a service that is briefly gone (backoff with jitter, a patience
//!   window), which the checkpoint client applies to every call.

pub mod checkpoint;
pub mod retry;
pub mod runs;

/// The HTTP client both clients use: a call that cannot connect within 10 s, or whose server
/// sends nothing for 5 minutes (a checkpoint download streams: the limit is on the silence
/// between reads, not the whole transfer), fails instead of hanging.
pub(crate) fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(std::time::Duration::from_secs(10))
        .read_timeout(std::time::Duration::from_secs(300))
        .build()
        .unwrap_or_default()
}

/// What went wrong talking to a Keel service.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}: cannot reach the service: {source}")]
    Unreachable { what: String, source: reqwest::Error },
    /// The service answered with an error body.
    #[error("{what}: {status}: {message}")]
    Api { what: String, status: u16, message: String },
    #[error("{0}")]
    Io(String),
    /// The service sent something that fails a check (a sha256 mismatch, a bad file name).
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A file as a stream of 1 MiB chunks.
pub(crate) fn chunks(file: tokio::fs::File) -> impl futures::Stream<Item = std::io::Result<bytes::Bytes>> {
    futures::stream::unfold(file, |mut file| async move {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; 1 << 20];
        match file.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(bytes::Bytes::from(buf)), file))
            }
            Err(e) => Some((Err(e), file)),
        }
    })
}

pub(crate) fn unreachable(what: &str) -> impl FnOnce(reqwest::Error) -> Error + '_ {
    move |source| Error::Unreachable { what: what.to_string(), source }
}

pub(crate) fn io(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::Io(format!("{what}: {e}"))
}

/// The response, or its `{"error": {"message"}}` as the error.
pub(crate) async fn checked(response: reqwest::Response, what: &str) -> Result<reqwest::Response> {
    if response.status().is_success() {
        return Ok(response);
    }
    let status = response.status().as_u16();
    let body: serde_json::Value = response.json().await.unwrap_or_default();
    let message = match &body["error"] {
        serde_json::Value::Object(error) => {
            let mut message = error.get("message").and_then(|m| m.as_str()).unwrap_or("no details").to_string();
            if let Some(problems) = error.get("problems").and_then(|p| p.as_array()) {
                for problem in problems {
                    message.push_str(&format!(
                        "\n  {}: {}",
                        problem["field"].as_str().unwrap_or("?"),
                        problem["message"].as_str().unwrap_or("?")
                    ));
                }
            }
            message
        }
        _ => "no details".to_string(),
    };
    Err(Error::Api { what: what.to_string(), status, message })
}

/// Decodes a successful JSON response.
pub(crate) async fn json<T: serde::de::DeserializeOwned>(response: reqwest::Response, what: &str) -> Result<T> {
    checked(response, what).await?.json().await.map_err(|e| Error::Invalid(format!("{what}: unexpected reply: {e}")))
}
