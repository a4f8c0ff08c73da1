//! HTTP pieces every service has: `GET /healthz`, the JSON error body
//! (`{"error": {"type", "message"}}`) with a 404 fallback, bearer-token authentication
//! ([`require_bearer`]), serving until shutdown, and
//! [`observe`]: one span per request (a child of the caller's `traceparent`) and the
//! request latency histogram.

use std::future::Future;
use std::net::SocketAddr;

use axum::extract::{MatchedPath, Request};
use axum::http::{StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;
use tokio::net::TcpListener;

/// An error answered to a client: a status and a stable `type` code with a message, in
/// `{"error": {"type", "message", ...}}`. Each service builds it in one match over its own
/// error type; `fields` carries what a service adds beside `type` and `message` (the
/// orchestrator's `problems`, OpenAI's `param` and `code`).
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub error_type: &'static str,
    pub message: String,
    pub fields: serde_json::Map<String, serde_json::Value>,
    /// Seconds a client should wait before it tries again (`Retry-After`), for refusals
    /// under load.
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(status: StatusCode, error_type: &'static str, message: impl Into<String>) -> Self {
        Self { status, error_type, message: message.into(), fields: serde_json::Map::new(), retry_after: None }
    }

    /// Adds `name: value` to the error object.
    #[must_use]
    pub fn with(mut self, name: &str, value: impl serde::Serialize) -> Self {
        let value = serde_json::to_value(value).unwrap_or(serde_json::Value::Null);
        self.fields.insert(name.to_string(), value);
        self
    }

    #[must_use]
    pub fn retry_after(mut self, seconds: u32) -> Self {
        self.retry_after = Some(seconds);
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut error = serde_json::Map::new();
        error.insert("type".into(), self.error_type.into());
        error.insert("message".into(), self.message.into());
        error.extend(self.fields);
        let mut response = (self.status, Json(json!({ "error": error }))).into_response();
        if let Some(seconds) = self.retry_after {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, seconds.into());
        }
        response
    }
}

/// Whether `request` carries `Authorization: Bearer <token>` (always, with no token). The
/// scheme's name is matched in any case (`bearer`, `BEARER`), as HTTP's authentication
/// schemes are (RFC 9110, 11.1).
pub fn bearer_matches(request: &Request, token: Option<&str>) -> bool {
    let Some(token) = token else { return true };
    let sent = request.headers().get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    sent.and_then(bearer_token).is_some_and(|sent| token_matches(sent, token))
}

/// The token of an `Authorization` value with the `Bearer` scheme, in any case (after one
/// or more spaces).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token.trim_start_matches(' '))
}

/// Whether `sent` is `token`, compared in constant time, so the answer's timing says
/// nothing about the token.
pub fn token_matches(sent: &str, token: &str) -> bool {
    sent.len() == token.len() && sent.bytes().zip(token.bytes()).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0
}

/// The value of cookie `name` in `request`, if it sent one.
pub fn cookie<'r>(request: &'r Request, name: &str) -> Option<&'r str> {
    let header = request.headers().get(axum::http::header::COOKIE)?.to_str().ok()?;
    header.split(';').filter_map(|pair| pair.trim().split_once('=')).find(|(key, _)| *key == name).map(|(_, v)| v)
}

/// Wraps every route of `router` so that, when `token` is set, a request without
/// `Authorization: Bearer <token>` gets 401 and a JSON error naming what to send.
pub fn require_bearer<S: Clone + Send + Sync + 'static>(router: Router<S>, token: Option<String>) -> Router<S> {
    require_bearer_or(router, token, |_| false)
}

/// [`require_bearer`], except that a request `admit` accepts (it may add to the request's
/// extensions) passes whatever token it sends: the generator's keys scoped to one agent
/// session.
pub fn require_bearer_or<S, F>(router: Router<S>, token: Option<String>, admit: F) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
    F: Fn(&mut Request) -> bool + Clone + Send + Sync + 'static,
{
    let token = std::sync::Arc::new(token);
    router.route_layer(axum::middleware::from_fn(move |mut request: Request, next: Next| {
        let token = token.clone();
        let admitted = admit(&mut request);
        async move {
            if admitted || bearer_matches(&request, token.as_deref()) {
                next.run(request).await
            } else {
                let sent = if request.headers().contains_key(axum::http::header::AUTHORIZATION) {
                    "a wrong token"
                } else {
                    "no token"
                };
                tracing::warn!(method = %request.method(), path = request.uri().path(), "refused a request with {sent} (401)");
                ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "send Authorization: Bearer <token>")
                    .into_response()
            }
        }
    }))
}

/// The token of the request's `Authorization: Bearer <token>`, if it sends one.
pub fn request_bearer(request: &Request) -> Option<&str> {
    request.headers().get(axum::http::header::AUTHORIZATION)?.to_str().ok().and_then(bearer_token)
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no route for {uri}"))
}

/// `GET /healthz` answering `{"status": "ok", "service": ..., "version": ...}`, plus the 404
/// fallback. Services merge their own routes into it.
pub fn health_routes<S: Clone + Send + Sync + 'static>(service: &'static str) -> Router<S> {
    let health =
        move || async move { Json(json!({"status": "ok", "service": service, "version": env!("CARGO_PKG_VERSION")})) };
    Router::new().route("/healthz", get(health)).fallback(not_found)
}

/// Binds `listen`, announces the bound address on stdout (`keel-<service> listening on
/// http://ADDR`, the line launchers and tests wait for), and serves until `shutdown`.
pub async fn run_http(
    service: &str,
    listen: SocketAddr,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    run_http_on(service, bind_http(listen).await?, app, shutdown).await
}

/// [`run_http`] on a listener already bound ([`bind_http`]).
pub async fn run_http_on(
    service: &str,
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    tracing::info!(%addr, "keel-{service} listening");
    println!("keel-{service} listening on http://{addr}");
    serve(listener, app.layer(axum::middleware::from_fn(observe)), shutdown).await?;
    tracing::info!("keel-{service} stopped");
    Ok(())
}

/// Binds `listen` (port 0: any free port), so that a service knows its address before it
/// serves.
pub async fn bind_http(listen: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(listen)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {listen}: {e}")))
}

/// Serves one request inside a server span named after its route (a child of the trace
/// context the request carries) and records its latency in
/// `keel_http_request_duration_seconds{method, route, status}`.
pub async fn observe(request: Request, next: Next) -> Response {
    // A fixed set of labels: any other method a client sends is `other`, so clients cannot
    // grow the metrics without bound.
    let method = match request.method().as_str() {
        m @ ("GET" | "POST" | "PUT" | "DELETE" | "PATCH" | "HEAD" | "OPTIONS") => m,
        _ => "other",
    }
    .to_string();
    let route = request.extensions().get::<MatchedPath>().map_or("unmatched", |p| p.as_str()).to_string();
    if UNTRACED_ROUTES.contains(&route.as_str()) {
        let started = std::time::Instant::now();
        let response = next.run(request).await;
        record_latency(&method, &route, response.status().as_u16(), started);
        return response;
    }
    let span = tracing::info_span!(
        "http.server",
        otel.name = format!("{method} {route}"),
        otel.kind = "server",
        http.request.method = %method,
        http.route = %route,
        http.response.status_code = tracing::field::Empty,
    );
    keel_telemetry::set_http_parent(&span, request.headers());
    let started = std::time::Instant::now();
    let response = tracing::Instrument::instrument(next.run(request), span.clone()).await;
    let status = response.status().as_u16();
    span.record("http.response.status_code", status);
    record_latency(&method, &route, status, started);
    response
}

/// Routes polled by health checks and metric scrapers every few seconds: served without a
/// span, so they do not bury the traces of real work (a compose stack's health checks alone
/// would make most of the traces in Jaeger). Their latency is still measured.
const UNTRACED_ROUTES: &[&str] = &["/healthz", "/health", "/metrics"];

fn record_latency(method: &str, route: &str, status: u16, started: std::time::Instant) {
    crate::metrics::observe(
        crate::metrics::HTTP_REQUESTS,
        &[("method", method), ("route", route), ("status", &status.to_string())],
        started.elapsed().as_secs_f64(),
    );
}

/// Serves `app` on `listener` until `shutdown` completes, then drains open requests.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (stopping, mut stopped) = tokio::sync::watch::channel(false);
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        let _ = stopped.wait_for(|s| *s).await;
    });
    let deadline = async move {
        shutdown.await;
        let _ = stopping.send(true);
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        result = server => result,
        () = deadline => {
            tracing::warn!("requests still open {} s after the stop was asked for (event streams?): closed", SHUTDOWN_GRACE.as_secs());
            Ok(())
        }
    }
}

/// How long a stopping service lets open requests finish before it closes them: an event
/// stream, which never finishes by itself, or a slow client.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    async fn get_json(app: Router, path: &str) -> (StatusCode, serde_json::Value) {
        let response = app.oneshot(Request::get(path).body(Body::empty()).unwrap()).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    #[tokio::test]
    async fn health_and_not_found() {
        let (status, body) = get_json(health_routes::<()>("demo"), "/healthz").await;
        assert_eq!(
            (status, body["status"].as_str(), body["service"].as_str()),
            (StatusCode::OK, Some("ok"), Some("demo"))
        );
        let (status, body) = get_json(health_routes::<()>("demo"), "/nope").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(body["error"]["type"], "not_found");
        assert!(body["error"]["message"].as_str().unwrap().contains("/nope"));
    }

    /// The scheme's name in any case; the token itself exactly.
    #[test]
    fn the_bearer_scheme_is_matched_in_any_case() {
        let request = |authorization: &str| {
            Request::get("/").header(axum::http::header::AUTHORIZATION, authorization).body(Body::empty()).unwrap()
        };
        for sent in ["Bearer s3cret", "bearer s3cret", "BEARER s3cret", "bEaReR s3cret", "Bearer  s3cret"] {
            assert!(bearer_matches(&request(sent), Some("s3cret")), "{sent}");
        }
        for sent in ["Bearer S3CRET", "Basic s3cret", "Bearers3cret", "s3cret", "Bearer", "Bearer s3cret "] {
            assert!(!bearer_matches(&request(sent), Some("s3cret")), "{sent}");
        }
        assert!(bearer_matches(&request("anything"), None));
    }
}
