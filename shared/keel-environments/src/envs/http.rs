//! `http`: the user's own reward service. Each sample is sent as a [`PluginRequest`] (or
//! `batch_size` of them as a [`PluginBatchRequest`]) with `POST` to the configured URL; the
//! answer is a [`PluginResponse`] (or a [`PluginBatchResponse`] with one result per sample, in
//! order). The contract is `openapi/reward-plugin.json`.
//!
//! Each attempt has a timeout covering the whole exchange; timeouts, connection errors, 429
//! and 5xx are retried up to `max_retries` times with exponential backoff and jitter; other
//! answers are final. At most `max_concurrency` requests are in flight from this replica. A
//! reply over `max_response_bytes` is cut off and refused. A failure never escapes as a
//! panic or a failed request: every sample of the failed call carries the error.

use keel_protocol::FieldError;
use std::sync::Arc;
use std::time::Duration;

use futures::future::{BoxFuture, join_all};
use keel_protocol::reward::{
    EnvSample, EnvStepResult, HttpRewardConfig, PluginBatchRequest, PluginBatchResponse, PluginRequest, PluginResponse,
    SampleError,
};
use reqwest::StatusCode;
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use serde::de::DeserializeOwned;
use tokio::sync::Semaphore;

use crate::envs::{Environment, Outcome, last_turn, prompt_of};

/// Environment variables `authorization_env` may name: a request must not be able to send
/// any other of the service's variables (a database URL, cloud credentials) to a URL it
/// chooses. Each secret `KEEL_REWARD_SECRET_X` is bound by the operator to the URLs it may
/// go to with `KEEL_REWARD_SECRET_X_URL` (a URL prefix): a request naming another URL gets
/// the same refusal as one naming a secret that does not exist, so refusals reveal nothing.
pub use keel_protocol::reward::http_limits::SECRET_PREFIX;

/// Whether `url` is under `prefix`: same scheme, host and port, and a path that starts with
/// the prefix's path (at a `/` boundary).
fn url_under(url: &reqwest::Url, prefix: &str) -> bool {
    let Ok(prefix) = reqwest::Url::parse(prefix) else { return false };
    let (path, base) = (url.path(), prefix.path().trim_end_matches('/'));
    url.scheme() == prefix.scheme()
        && url.host_str() == prefix.host_str()
        && url.port_or_known_default() == prefix.port_or_known_default()
        && (path == base || path.starts_with(&format!("{base}/")))
}

/// The value of secret `var` when the operator allows it to be sent to `url`.
fn secret_for(var: &str, url: &reqwest::Url) -> Result<String, FieldError> {
    let bound = std::env::var(format!("{var}_URL")).ok().filter(|prefix| url_under(url, prefix));
    match (bound, std::env::var(var)) {
        (Some(_), Ok(value)) => Ok(value),
        _ => Err(FieldError::new(
            "authorization_env",
            format!(
                "`{var}` may not be sent to {url} (the operator binds each secret to its URLs with \
             `{var}_URL`)"
            ),
        )),
    }
}

#[derive(Debug)]
pub struct HttpEnv {
    config: HttpRewardConfig,
    client: reqwest::Client,
    url: reqwest::Url,
    authorization: Option<HeaderValue>,
    permits: Arc<Semaphore>,
}

/// Whether another attempt may help.
enum Failure {
    Retry(SampleError),
    Final(SampleError),
}

impl HttpEnv {
    /// The environment for `config`, calling through `client`; `private` says which loopback
    /// or private addresses the URL may name (see [`keel_service::outbound`]).
    pub fn new(
        config: &HttpRewardConfig,
        client: reqwest::Client,
        private: &keel_service::outbound::PrivateAccess,
    ) -> Result<Self, FieldError> {
        if let Some(problem) = config.problems().into_iter().next() {
            return Err(problem);
        }
        let url = reqwest::Url::parse(&config.url)
            .map_err(|e| FieldError::new("url", format!("`{}` is not a URL: {e}", config.url)))?;
        private.check(&url)?;
        let token = match (&config.authorization, &config.authorization_env) {
            (Some(value), _) => Some(value.clone()),
            (None, Some(var)) => Some(secret_for(var, &url)?),
            (None, None) => None,
        };
        let authorization = token
            .map(|t| {
                HeaderValue::from_str(&t).map_err(|_| FieldError::new("authorization", "not a valid header value"))
            })
            .transpose()?
            .map(|mut v| {
                v.set_sensitive(true);
                v
            });
        Ok(Self {
            permits: Arc::new(Semaphore::new(config.max_concurrency)),
            config: config.clone(),
            client,
            url,
            authorization,
        })
    }

    fn request_of(sample: &EnvSample) -> Result<PluginRequest, SampleError> {
        Ok(PluginRequest {
            completion: last_turn(sample)?.to_string(),
            prompt: prompt_of(&sample.messages).to_string(),
            messages: sample.messages.clone(),
            metadata: sample.metadata.clone(),
        })
    }

    /// Scores one chunk of samples with one call.
    async fn score_chunk(&self, samples: &[EnvSample]) -> Vec<Outcome> {
        let requests: Result<Vec<PluginRequest>, SampleError> = samples.iter().map(Self::request_of).collect();
        let requests = match requests {
            Ok(requests) => requests,
            // One bad sample fails alone: score the rest one by one.
            Err(_) if samples.len() > 1 => {
                return join_all(samples.chunks(1).map(|one| self.score_chunk(one))).await.concat();
            }
            Err(e) => return vec![Err(e)],
        };
        let responses = if self.config.batch_size == 1 {
            self.call::<PluginResponse>(&requests[0]).await.map(|r| vec![r])
        } else {
            let body = PluginBatchRequest { samples: requests };
            self.call::<PluginBatchResponse>(&body).await.and_then(|b| {
                if b.results.len() == samples.len() {
                    Ok(b.results)
                } else {
                    Err(SampleError::new(
                        "malformed_reply",
                        format!("{} results for {} samples", b.results.len(), samples.len()),
                    ))
                }
            })
        };
        match responses {
            Ok(responses) => samples.iter().zip(responses).map(|(s, r)| outcome(s, r)).collect(),
            Err(e) => vec![Err(e); samples.len()],
        }
    }

    /// One call with retries.
    pub(crate) async fn call<T: DeserializeOwned>(&self, body: &impl serde::Serialize) -> Result<T, SampleError> {
        let body = serde_json::to_vec(body).map_err(|e| SampleError::new("invalid_sample", e.to_string()))?;
        let mut attempt = 0;
        let mut delays = self.delays();
        let max_delay = Duration::from_millis(self.config.max_backoff_ms);
        loop {
            let result = {
                let _permit = self.permits.acquire().await.map_err(|e| SampleError::new("internal", e.to_string()))?;
                let timeout = Duration::from_millis(self.config.timeout_ms);
                // Each attempt is a client span, the plugin's request a child of it.
                let span = self.client_span(attempt);
                let call = tracing::Instrument::instrument(self.attempt(&body), span.clone());
                let result = match tokio::time::timeout(timeout, call).await {
                    Ok(result) => result,
                    Err(_) => Err(Failure::Retry(SampleError::new(
                        "timeout",
                        format!("{} did not answer within {} ms", self.url, self.config.timeout_ms),
                    ))),
                };
                if let Err(Failure::Retry(e) | Failure::Final(e)) = &result {
                    span.record("otel.status_description", e.to_string().as_str());
                }
                result
            };
            let error = match result {
                Ok(bytes) => {
                    return serde_json::from_slice(&bytes).map_err(|e| {
                        SampleError::new(
                            "malformed_reply",
                            format!("{} answered something that is not a reward: {e}", self.url),
                        )
                    });
                }
                Err(Failure::Final(e)) => return Err(e),
                Err(Failure::Retry(e)) => e,
            };
            if attempt >= self.config.max_retries {
                let tries = attempt + 1;
                return Err(SampleError::new(&error.kind, format!("{} (after {tries} attempts)", error.message)));
            }
            tokio::time::sleep(delays.next().unwrap_or(max_delay)).await;
            attempt += 1;
        }
    }

    /// The waits before the retries: from `backoff_ms` doubling up to `max_backoff_ms`, each
    /// between half and all of that (jitter, so that replicas do not come back together).
    fn delays(&self) -> impl Iterator<Item = Duration> {
        use backon::BackoffBuilder;
        let half = |ms: u64| Duration::from_millis(ms) / 2;
        backon::ExponentialBuilder::new()
            .with_min_delay(half(self.config.backoff_ms))
            .with_max_delay(half(self.config.max_backoff_ms))
            .with_jitter()
            .without_max_times()
            .build()
    }

    /// The span of one request to the plugin (OpenTelemetry's HTTP client conventions; the
    /// URL without its query, which may hold a credential).
    fn client_span(&self, attempt: u32) -> tracing::Span {
        let mut url = self.url.clone();
        url.set_query(None);
        tracing::info_span!(
            "http.client",
            otel.name = "reward.plugin POST",
            otel.kind = "client",
            http.request.method = "POST",
            url.full = %url,
            server.address = self.url.host_str().unwrap_or_default(),
            http.request.resend_count = attempt,
            http.response.status_code = tracing::field::Empty,
            otel.status_description = tracing::field::Empty,
        )
    }

    async fn attempt(&self, body: &[u8]) -> Result<Vec<u8>, Failure> {
        let mut request = self
            .client
            .post(self.url.clone())
            .headers(keel_telemetry::http_headers())
            .header(CONTENT_TYPE, "application/json")
            .body(body.to_vec());
        if let Some(auth) = &self.authorization {
            request = request.header(AUTHORIZATION, auth.clone());
        }
        let mut response = request.send().await.map_err(|e| {
            // A redirect the client would not follow (another host or port, or too many)
            // answers the same every time.
            if e.is_redirect() {
                Failure::Final(SampleError::new("redirect", format!("{}: {}", self.url, error_chain(&e))))
            } else {
                Failure::Retry(SampleError::new(
                    "unreachable",
                    format!("cannot reach {}: {}", self.url, error_chain(&e)),
                ))
            }
        })?;
        let status = response.status();
        tracing::Span::current().record("http.response.status_code", status.as_u16());
        if !status.is_success() {
            let error = SampleError::new("http_status", format!("{} answered {status}", self.url));
            let retry = status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS;
            return Err(if retry { Failure::Retry(error) } else { Failure::Final(error) });
        }
        let limit = self.config.max_response_bytes;
        let too_large = || {
            Failure::Final(SampleError::new("too_large", format!("{}'s reply is larger than {limit} bytes", self.url)))
        };
        if response.content_length().is_some_and(|n| n > limit as u64) {
            return Err(too_large());
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| {
            Failure::Retry(SampleError::new(
                "unreachable",
                format!("reading {}'s reply failed: {}", self.url, error_chain(&e)),
            ))
        })? {
            if bytes.len() + chunk.len() > limit {
                return Err(too_large());
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(bytes)
    }
}

/// reqwest's error with its causes (the cause says "connection refused").
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// A plugin's answer as a step result; the reward must be there (JSON numbers are finite).
pub(crate) fn outcome(sample: &EnvSample, response: PluginResponse) -> Outcome {
    let rewards = response.rewards.unwrap_or_default();
    let reward = match response.reward {
        Some(r) => r,
        None if !rewards.is_empty() => rewards.values().sum(),
        None => return Err(SampleError::new("malformed_reply", "the reply has neither `reward` nor `rewards`")),
    };
    let mut result = EnvStepResult::done(reward, sample.metadata.clone());
    result.rewards = rewards;
    result.info = response.info;
    Ok(result)
}

impl Environment for HttpEnv {
    fn step<'a>(&'a self, samples: &'a [EnvSample]) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            join_all(samples.chunks(self.config.batch_size).map(|chunk| self.score_chunk(chunk))).await.concat()
        })
    }
}
