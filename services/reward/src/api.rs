//! REST: `POST /v1/score`, `POST /v1/env/step`, `GET /metrics` (plus `/healthz` from
//! keel-service). Errors are `{"error": {"type", "message"}}`: 400 for a body that is not
//! JSON, 422 for one that does not fit (the message names the field path), 422 or 502 for a
//! sample that failed under `on_error: fail` (its own fault, or an upstream's), 503 with
//! `Retry-After` when too many requests are in flight.
//!
//! [`ApiDoc`] generates `openapi/reward.json`; [`plugin_document`] generates
//! `openapi/reward-plugin.json`, the contract a user's reward service implements;
//! [`agent_document`] `openapi/agent.json`, the contract of a user's agent service.

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use keel_protocol::reward::{
    EnvStepReply, EnvStepRequest, PluginBatchRequest, PluginBatchResponse, PluginRequest, PluginResponse, ScoreReply,
    ScoreRequest, error_types,
};
use keel_service::ApiError;
use keel_service::openapi::{BearerAuth, ErrorResponses};
use utoipa::OpenApi;

use keel_environments::scoring::{Error, Scorer, parse};

#[derive(Debug, Clone)]
pub struct AppState {
    pub scorer: Scorer,
    pub max_in_flight: usize,
}

pub fn routes(state: AppState) -> Router {
    Router::new()
        .route("/v1/score", post(score))
        .route("/v1/env/step", post(env_step))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// The JSON error body of this service.
struct Failure(Error);

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        answer(&self.0).into_response()
    }
}

/// The one place this service's errors become statuses and `type` codes. Its own failures
/// (the sandbox, a bug) are logged, not sent.
fn answer(error: &Error) -> ApiError {
    match error {
        Error::InvalidJson(_) => ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", error.to_string()),
        Error::InvalidRequest(_) => {
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, error_types::INVALID_REQUEST, error.to_string())
        }
        Error::Unavailable => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, error_types::UNAVAILABLE, error.to_string()).retry_after(1)
        }
        Error::SampleFailed { index, error: sample } => {
            let status = match sample.kind.as_str() {
                "invalid_sample" => StatusCode::UNPROCESSABLE_ENTITY,
                "sandbox" => StatusCode::SERVICE_UNAVAILABLE,
                "internal" => StatusCode::INTERNAL_SERVER_ERROR,
                // The user's reward service, or a trainer, failed.
                _ => StatusCode::BAD_GATEWAY,
            };
            let message = if matches!(sample.kind.as_str(), "sandbox" | "internal") {
                tracing::error!(sample = index, error = %sample, "scoring failed");
                format!("samples[{index}]: {}: this reward replica could not score it (see its log)", sample.kind)
            } else {
                error.to_string()
            };
            let answer = ApiError::new(status, error_types::SAMPLE_FAILED, message);
            if status == StatusCode::SERVICE_UNAVAILABLE { answer.retry_after(1) } else { answer }
        }
    }
}

/// Scores finished completions with an environment (one step each).
#[utoipa::path(
    post,
    path = "/v1/score",
    request_body = ScoreRequest,
    responses(
        (status = 200, description = "One result per sample, in order, and batch metrics", body = ScoreReply),
        (status = 400, description = "The body is not JSON"),
        (status = 422, description = "A field is missing or wrong (the message names it), or a sample is invalid under `on_error: fail`"),
        (status = 500, description = "This replica failed to score a sample under `on_error: fail` (details in its log)"),
        (status = 502, description = "A sample's scoring failed upstream (the user's reward service, a trainer) under `on_error: fail`"),
        (status = 503, description = "Too many requests in flight, or the code sandbox is unavailable; retry after the `Retry-After` seconds"),
    )
)]
pub async fn score(State(state): State<AppState>, body: Bytes) -> Response {
    let request: ScoreRequest = match parse(&body) {
        Ok(request) => request,
        Err(e) => return Failure(e).into_response(),
    };
    match state.scorer.score(request).await {
        Ok(reply) => axum::Json(reply).into_response(),
        Err(e) => Failure(e).into_response(),
    }
}

/// One environment step of each sample's conversation.
#[utoipa::path(
    post,
    path = "/v1/env/step",
    request_body = EnvStepRequest,
    responses(
        (status = 200, description = "Observation, reward, termination, stop strings and metadata per sample", body = EnvStepReply),
        (status = 400, description = "The body is not JSON"),
        (status = 422, description = "A field is missing or wrong (the message names it), or a sample is invalid under `on_error: fail`"),
        (status = 500, description = "This replica failed to score a sample under `on_error: fail` (details in its log)"),
        (status = 502, description = "A sample's scoring failed upstream (the user's reward service, a trainer) under `on_error: fail`"),
        (status = 503, description = "Too many requests in flight, or the code sandbox is unavailable; retry after the `Retry-After` seconds"),
    )
)]
pub async fn env_step(State(state): State<AppState>, body: Bytes) -> Response {
    let request: EnvStepRequest = match parse(&body) {
        Ok(request) => request,
        Err(e) => return Failure(e).into_response(),
    };
    match state.scorer.step(request).await {
        Ok(reply) => axum::Json(reply).into_response(),
        Err(e) => Failure(e).into_response(),
    }
}

/// Prometheus metrics: requests, samples, sample errors, reward and time per environment,
/// and requests in flight.
#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "Prometheus text format", body = String)))]
pub async fn metrics(State(state): State<AppState>) -> Response {
    use keel_service::metrics::{set_counter, set_gauge};
    describe_metrics();
    set_gauge("keel_reward_requests_in_flight", &[], state.scorer.in_flight(state.max_in_flight) as f64);
    for (env, s) in &state.scorer.stats() {
        let env = [("env", *env)];
        set_counter("keel_reward_requests_total", &env, s.requests);
        set_counter("keel_reward_samples_total", &env, s.samples);
        set_counter("keel_reward_sample_errors_total", &env, s.errors);
        set_gauge("keel_reward_reward_sum", &env, s.reward_sum);
        set_gauge("keel_reward_seconds_total", &env, s.seconds);
    }
    keel_service::metrics::response()
}

/// The HELP lines of the reward service's metrics. Sums of fractions (rewards, seconds) are
/// gauges that only grow: the exporter's counters count whole numbers.
fn describe_metrics() {
    static DESCRIBED: std::sync::Once = std::sync::Once::new();
    DESCRIBED.call_once(|| {
        keel_service::metrics::install();
        ::metrics::describe_gauge!("keel_reward_requests_in_flight", "Requests being scored now.");
        ::metrics::describe_counter!("keel_reward_requests_total", "Requests per environment.");
        ::metrics::describe_counter!("keel_reward_samples_total", "Samples scored per environment.");
        ::metrics::describe_counter!("keel_reward_sample_errors_total", "Samples whose scoring failed.");
        ::metrics::describe_gauge!("keel_reward_reward_sum", "Sum of the rewards given (only grows).");
        ::metrics::describe_gauge!("keel_reward_seconds_total", "Time spent scoring (only grows).");
    });
}

#[derive(Debug, OpenApi)]
#[openapi(
    info(
        title = "Keel reward",
        description = "Environments and scorers: math, code (sandboxed), sliding_puzzle, exact_match, regex, multiple_choice, http (your own reward service) and reward_model. The same request and reply bodies travel over NATS on `<prefix>.reward.score` and `<prefix>.reward.env.step` (queue group `reward`), wrapped in `{\"ok\": ...}` or `{\"error\": {\"type\", \"message\"}}`."
    ),
    paths(score, env_step, metrics),
    modifiers(&ErrorResponses, &BearerAuth)
)]
pub struct ApiDoc;

/// The contract of a user's reward service: `POST` to the configured URL.
pub fn plugin_document() -> utoipa::openapi::OpenApi {
    use utoipa::openapi::path::OperationBuilder;
    use utoipa::openapi::request_body::RequestBodyBuilder;
    use utoipa::openapi::{ContentBuilder, OneOfBuilder, Ref, ResponseBuilder};

    let either = |one: &str, many: &str| {
        let schema = OneOfBuilder::new().item(Ref::from_schema_name(one)).item(Ref::from_schema_name(many)).build();
        ContentBuilder::new().schema(Some(utoipa::openapi::Schema::OneOf(schema))).build()
    };
    let operation = OperationBuilder::new()
        .summary(Some("Score samples"))
        .description(Some(
            "Keel sends one PluginRequest (batch_size 1) or a PluginBatchRequest and expects a PluginResponse or a PluginBatchResponse with one result per sample, in order. Timeouts, connection errors, 429 and 5xx are retried with backoff; other statuses, malformed JSON, a missing or non-finite reward, or a reply over the configured size fail the sample. The `Authorization` header is sent when configured.",
        ))
        .request_body(Some(
            RequestBodyBuilder::new()
                .content("application/json", either("PluginRequest", "PluginBatchRequest"))
                .required(Some(utoipa::openapi::Required::True))
                .build(),
        ))
        .response(
            "200",
            ResponseBuilder::new()
                .description("The reward(s)")
                .content("application/json", either("PluginResponse", "PluginBatchResponse")),
        )
        .build();
    #[derive(OpenApi)]
    #[openapi(components(schemas(PluginRequest, PluginBatchRequest, PluginResponse, PluginBatchResponse)))]
    struct Schemas;
    let about = "What a user's own reward service implements for Keel's `http` environment.";
    user_service_document("Keel reward plugin", about, operation, Schemas::openapi())
}

/// A document of one `POST /` operation that a user's service implements, with `schemas`'
/// components.
fn user_service_document(
    title: &str,
    about: &str,
    operation: utoipa::openapi::path::Operation,
    schemas: utoipa::openapi::OpenApi,
) -> utoipa::openapi::OpenApi {
    use utoipa::openapi::path::{HttpMethod, PathItem};
    use utoipa::openapi::{InfoBuilder, OpenApiBuilder, PathsBuilder};
    let info = InfoBuilder::new().title(title).version(env!("CARGO_PKG_VERSION")).description(Some(about)).build();
    let mut doc = OpenApiBuilder::new()
        .info(info)
        .paths(PathsBuilder::new().path("/", PathItem::new(HttpMethod::Post, operation)))
        .build();
    doc.components = schemas.components;
    doc
}

/// The contract of a user's agent service: `POST` to the `agent` environment's URL.
pub fn agent_document() -> utoipa::openapi::OpenApi {
    use keel_protocol::agent::{AgentEndpoint, AgentLimits, AgentRequest};
    use keel_protocol::reward::Message;
    use utoipa::openapi::path::OperationBuilder;
    use utoipa::openapi::request_body::RequestBodyBuilder;
    use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};

    let content = |name: &str| ContentBuilder::new().schema(Some(Ref::from_schema_name(name))).build();
    let operation = OperationBuilder::new()
        .summary(Some("Run one sample's episode"))
        .description(Some(
            "Keel sends one AgentRequest per sample: the task (messages, metadata), the OpenAI-compatible endpoint of the policy for this sample only (`openai.base_url`, `openai.api_key` as the bearer token, `openai.model`) and its limits. The agent calls `POST {base_url}/chat/completions` (not streamed, n 1) as often as it likes within the limits; the generator samples with the run's settings, whatever the agent asks, and records every call's token ids. The agent answers a PluginResponse: `reward`, or named `rewards` whose sum is the reward, and `info`. There is one attempt: a status other than 200, malformed JSON, no answer within the limit's time, a call past a limit, or calls that are not one conversation (each call's messages the previous call's, then the model's turn, then anything) drop the sample from training, with the reason recorded in the run's samples. A `traceparent` header is sent; passing it on with the calls puts them in the step's trace.",
        ))
        .request_body(Some(
            RequestBodyBuilder::new()
                .content("application/json", content("AgentRequest"))
                .required(Some(utoipa::openapi::Required::True))
                .build(),
        ))
        .response(
            "200",
            ResponseBuilder::new().description("The sample's reward").content("application/json", content("PluginResponse")),
        )
        .build();
    #[derive(OpenApi)]
    #[openapi(components(schemas(AgentRequest, AgentEndpoint, AgentLimits, Message, PluginResponse)))]
    struct Schemas;
    let about = "What a user's own agent service implements for Keel's `agent` environment.";
    user_service_document("Keel agent", about, operation, Schemas::openapi())
}

#[cfg(test)]
mod tests {
    use keel_protocol::reward::SampleError;

    use super::*;
    use axum::http::header;

    /// Every error kind: its status, its `type`, a message that names what went wrong (the
    /// replica's own failures hidden), and `Retry-After` where trying again helps.
    #[tokio::test]
    async fn every_error_has_its_status_type_and_body() {
        let sample = |kind: &str| Error::SampleFailed { index: 3, error: SampleError::new(kind, "details") };
        let cases = vec![
            (Error::InvalidJson("eof".into()), StatusCode::BAD_REQUEST, "invalid_json", true),
            (Error::InvalidRequest("samples: empty".into()), StatusCode::UNPROCESSABLE_ENTITY, "invalid_request", true),
            (Error::Unavailable, StatusCode::SERVICE_UNAVAILABLE, "unavailable", true),
            (sample("invalid_sample"), StatusCode::UNPROCESSABLE_ENTITY, "sample_failed", true),
            (sample("timeout"), StatusCode::BAD_GATEWAY, "sample_failed", true),
            (sample("http_status"), StatusCode::BAD_GATEWAY, "sample_failed", true),
            (sample("trainer"), StatusCode::BAD_GATEWAY, "sample_failed", true),
            (sample("sandbox"), StatusCode::SERVICE_UNAVAILABLE, "sample_failed", false),
            (sample("internal"), StatusCode::INTERNAL_SERVER_ERROR, "sample_failed", false),
        ];
        for (error, status, error_type, shown) in cases {
            let text = error.to_string();
            let response = Failure(error).into_response();
            assert_eq!(response.status(), status, "{text}");
            let retry = response.headers().contains_key(header::RETRY_AFTER);
            assert_eq!(retry, status == StatusCode::SERVICE_UNAVAILABLE, "{text}");
            let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
            let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(body["error"]["type"], error_type, "{text}");
            let message = body["error"]["message"].as_str().unwrap();
            if shown {
                assert_eq!(message, text);
            } else {
                assert!(!message.contains("details") && message.starts_with("samples[3]: "), "{message}");
            }
        }
    }
}
