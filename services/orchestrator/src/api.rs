//! The public REST API (`openapi/keel.yaml`): submit, list, show and cancel runs; a run's
//! metrics, samples, checkpoints and live events (SSE); dataset uploads ([`crate::datasets`]). When a token is configured every
//! `/v1` route and `/metrics` want `Authorization: Bearer <token>`.
//!
//! Errors are `{"error": {"type", "message"}}`; a refused spec (422, `invalid_spec`) also
//! lists every problem as `problems: [{field, message}]`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::Stream;
use keel_client::checkpoint::CheckpointClient;
use keel_protocol::FieldError;
use keel_protocol::checkpoint::Checkpoint;
use keel_protocol::run::{Metrics, Run, RunEventRecord, RunList, RunSpec, RunStatus, Samples};
use keel_service::ApiError;
use keel_service::openapi::{BearerAuth, ErrorResponses};
use keel_service::query::Query;
use serde::Deserialize;
use serde_json::json;
use sqlx::PgPool;
use utoipa::{IntoParams, OpenApi, ToSchema};
use uuid::Uuid;

use crate::{db, spec};

#[derive(Debug, Clone)]
pub struct AppState {
    pub pool: PgPool,
    pub checkpoints: CheckpointClient,
    pub token: Option<String>,
    /// Where a spec's model and dataset paths may point.
    pub roots: keel_service::paths::PathRoots,
    /// Where uploaded datasets are kept (inside the path roots).
    pub datasets: std::path::PathBuf,
    /// The largest dataset upload, in bytes.
    pub max_dataset_bytes: u64,
    /// The MLflow servers a spec may name on private addresses.
    pub mlflow: std::sync::Arc<crate::loggers::TrackingServers>,
}

/// What a request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    #[error("{}", keel_protocol::join_problems(.0))]
    InvalidSpec(Vec<FieldError>),
    #[error("{0}")]
    BadRequest(String),
    #[error("send Authorization: Bearer <token>")]
    Unauthorized,
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    TooLarge(String),
    #[error("{0}")]
    Upstream(String),
    #[error("{0}")]
    Internal(String),
}

impl From<sqlx::Error> for Failure {
    fn from(e: sqlx::Error) -> Self {
        Self::Internal(format!("database: {e}"))
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        answer(&self).into_response()
    }
}

/// The one place this service's errors become statuses and `type` codes; an invalid spec
/// lists every problem as `problems: [{field, message}]`.
fn answer(failure: &Failure) -> ApiError {
    let (status, error_type) = match failure {
        Failure::InvalidSpec(problems) => {
            let error = ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_spec", failure.to_string());
            return error.with("problems", problems);
        }
        Failure::BadRequest(_) => (StatusCode::BAD_REQUEST, "invalid_request"),
        Failure::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized"),
        Failure::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
        Failure::Conflict(_) => (StatusCode::CONFLICT, "conflict"),
        Failure::TooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
        Failure::Upstream(_) => (StatusCode::BAD_GATEWAY, "upstream"),
        Failure::Internal(m) => {
            tracing::error!("internal error: {m}");
            let message = "internal error (see the orchestrator's log)";
            return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message);
        }
    };
    ApiError::new(status, error_type, failure.to_string())
}

pub(crate) type Answer<T> = Result<T, Failure>;

pub fn routes(state: AppState) -> Router {
    describe_metrics();
    let api = Router::new()
        .route("/v1/runs", post(submit).get(list))
        .route("/v1/runs/validate", post(validate))
        .route("/v1/runs/{id}", get(show))
        .route("/v1/runs/{id}/metrics", get(metrics))
        .route("/v1/runs/{id}/samples", get(samples))
        .route("/v1/runs/{id}/events", get(events))
        .route("/v1/runs/{id}/cancel", post(cancel))
        .route("/v1/runs/{id}/checkpoints", get(checkpoints))
        .route("/v1/runs/{id}/checkpoints/{checkpoint_id}/archive", get(checkpoint_archive))
        // An upload is streamed to disk: no body limit but the orchestrator's own.
        .route("/v1/datasets", post(crate::datasets::upload).layer(axum::extract::DefaultBodyLimit::disable()))
        // Run counts and names are the API's data too: with a token, Prometheus sends it
        // (`authorization` / `bearer_token` in its scrape configuration).
        .route("/metrics", get(prometheus))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), authorize));
    api.with_state(state)
}

/// Prometheus metrics: runs by status, the phases of recorded steps, and the requests this
/// orchestrator served.
#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "Prometheus text format", body = String)))]
pub async fn prometheus(State(state): State<AppState>) -> Answer<Response> {
    use keel_service::metrics;
    let counts = db::count_by_status(&mut *state.pool.acquire().await?).await?;
    describe_metrics();
    for status in RunStatus::ALL {
        let count = counts.iter().find(|(s, _)| s == status.name()).map_or(0, |(_, n)| *n);
        metrics::set_gauge("keel_runs", &[("status", status.name())], count as f64);
    }
    Ok(metrics::response())
}

/// The HELP lines of the orchestrator's own metrics.
fn describe_metrics() {
    static DESCRIBED: std::sync::Once = std::sync::Once::new();
    DESCRIBED.call_once(|| {
        keel_service::metrics::install();
        ::metrics::describe_gauge!("keel_runs", "Runs in the database, by status.");
        ::metrics::describe_histogram!(
            crate::driver::store::STEP_PHASES,
            "Time of each phase of a recorded training step (NeMo-RL's timing/train/* names)."
        );
    });
}

async fn authorize(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if !authorized(&request, state.token.as_deref()) {
        tracing::warn!(method = %request.method(), path = request.uri().path(), "refused a request without the API token (401)");
        return Failure::Unauthorized.into_response();
    }
    next.run(request).await
}

/// The cookie the dashboard's page gets when it is opened with `?token=`: the browser then
/// sends it with the page's assets and API calls.
pub const TOKEN_COOKIE: &str = "keel_token";

/// Whether `request` carries the API token (as a bearer token, or the dashboard's cookie);
/// always, with no token.
pub fn authorized(request: &Request, token: Option<&str>) -> bool {
    let Some(token) = token else { return true };
    keel_service::bearer_matches(request, Some(token))
        || keel_service::cookie(request, TOKEN_COOKIE).is_some_and(|sent| keel_service::token_matches(sent, token))
}

fn parse_id(id: &str) -> Answer<Uuid> {
    Uuid::parse_str(id).map_err(|_| Failure::NotFound(format!("no run `{id}` (run ids are UUIDs)")))
}

async fn find(pool: &PgPool, id: Uuid) -> Answer<Run> {
    db::get_run(&mut *pool.acquire().await?, id).await?.ok_or_else(|| Failure::NotFound(format!("no run {id}")))
}

/// Submits a run (YAML or JSON, by `Content-Type`). It waits in `queued` until a trainer is
/// free.
#[utoipa::path(post, path = "/v1/runs", request_body(content((RunSpec = "application/yaml"), (RunSpec = "application/json"))),
    responses((status = 201, body = Run), (status = 422, description = "The spec is refused: every problem, each with its field path", body = InvalidSpecError)))]
pub async fn submit(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Answer<(StatusCode, Json<Run>)> {
    let spec = checked_spec(&state, &headers, body).await?;
    let run = db::insert_run(&mut *state.pool.acquire().await?, &spec).await?;
    tracing::info!(run_id = %run.id, algorithm = run.algorithm.name(), "run submitted");
    Ok((StatusCode::CREATED, Json(run)))
}

/// Checks a run spec exactly as `POST /v1/runs` does (shape, every semantic problem, the
/// model and datasets it names) and creates nothing: the dry run. Answers the spec as it
/// would run, with every default filled in.
#[utoipa::path(post, path = "/v1/runs/validate", request_body(content((RunSpec = "application/yaml"), (RunSpec = "application/json"))),
    responses((status = 200, body = RunSpec, description = "The spec is valid; this is how it would run, defaults included"),
        (status = 422, description = "The spec is refused: every problem, each with its field path", body = InvalidSpecError)))]
pub async fn validate(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Answer<Json<RunSpec>> {
    Ok(Json(checked_spec(&state, &headers, body).await?))
}

/// The body as a spec that passed every check, or every problem found.
async fn checked_spec(state: &AppState, headers: &HeaderMap, body: Bytes) -> Answer<RunSpec> {
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(str::to_string);
    let spec = spec::parse_async(body, content_type).await.map_err(|p| Failure::InvalidSpec(vec![p]))?;
    let problems = spec::problems(&spec, &state.checkpoints, &state.roots, &state.mlflow).await;
    if !problems.is_empty() {
        return Err(Failure::InvalidSpec(problems));
    }
    Ok(spec)
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only the runs with this status.
    #[param(value_type = Option<RunStatus>)]
    pub status: Option<String>,
    /// Runs per page (1 to 200, default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<i64>,
    /// The last run id of the previous page.
    pub after: Option<Uuid>,
}

/// Runs, newest first.
#[utoipa::path(get, path = "/v1/runs", params(ListQuery), responses((status = 200, body = RunList)))]
pub async fn list(State(state): State<AppState>, Query(q): Query<ListQuery>) -> Answer<Json<RunList>> {
    let status = match q.status.as_deref() {
        None => None,
        Some(s) => Some(RunStatus::from_name(s).ok_or_else(|| {
            Failure::BadRequest(format!(
                "status: `{s}` is not one of queued, running, waiting, succeeded, failed, cancelled"
            ))
        })?),
    };
    let limit = q.limit.unwrap_or(50);
    if !(1..=200).contains(&limit) {
        return Err(Failure::BadRequest(format!("limit: must be 1 to 200, got {limit}")));
    }
    let runs = db::list_runs(&mut *state.pool.acquire().await?, status, limit, q.after).await?;
    let next = (runs.len() as i64 == limit).then(|| runs.last().map(|r| r.id.to_string())).flatten();
    Ok(Json(RunList { runs, next }))
}

/// A run with its latest metrics.
#[utoipa::path(get, path = "/v1/runs/{id}", params(("id" = Uuid, Path, description = "The run's id")), responses((status = 200, body = Run), (status = 404)))]
pub async fn show(State(state): State<AppState>, Path(id): Path<String>) -> Answer<Json<Run>> {
    Ok(Json(find(&state.pool, parse_id(&id)?).await?))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct MetricsQuery {
    /// Comma-separated metric names (default: all).
    pub names: Option<String>,
    pub from_step: Option<u64>,
    pub to_step: Option<u64>,
}

/// A run's metrics by step.
#[utoipa::path(get, path = "/v1/runs/{id}/metrics", params(("id" = Uuid, Path, description = "The run's id"), MetricsQuery), responses((status = 200, body = Metrics), (status = 404)))]
pub async fn metrics(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<MetricsQuery>,
) -> Answer<Json<Metrics>> {
    let run = find(&state.pool, parse_id(&id)?).await?;
    let names: Option<Vec<String>> = q.names.map(|n| n.split(',').map(|s| s.trim().to_string()).collect());
    let (from, to) = (q.from_step.unwrap_or(0), q.to_step.unwrap_or(u64::MAX));
    let metrics = db::metrics(&mut *state.pool.acquire().await?, run.id, names.as_deref(), from, to).await?;
    Ok(Json(Metrics { metrics }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct SamplesQuery {
    pub step: Option<u64>,
    /// `train` or `validation`.
    pub split: Option<String>,
    /// Default 50, at most 1000.
    pub limit: Option<i64>,
}

/// Recorded prompts, completions and rewards, latest step first.
#[utoipa::path(get, path = "/v1/runs/{id}/samples", params(("id" = Uuid, Path, description = "The run's id"), SamplesQuery), responses((status = 200, body = Samples), (status = 404)))]
pub async fn samples(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<SamplesQuery>,
) -> Answer<Json<Samples>> {
    let run = find(&state.pool, parse_id(&id)?).await?;
    let limit = q.limit.unwrap_or(50).clamp(1, 1000);
    let samples = db::samples(&mut *state.pool.acquire().await?, run.id, q.step, q.split.as_deref(), limit).await?;
    Ok(Json(Samples { samples }))
}

/// Status changes, step metrics and checkpoints as server-sent events (`id` = sequence
/// number; send `Last-Event-ID` to continue). The stream ends after the run's final status.
#[utoipa::path(get, path = "/v1/runs/{id}/events",
    params(("id" = Uuid, Path, description = "The run's id"),
        ("Last-Event-ID" = Option<i64>, Header, description = "The `id` of the last event received: the stream continues after it")),
    responses((status = 200, description = "Server-sent events, one per `RunEventRecord`: `id` its `seq`, `event` its event's `kind` (`status`, `step` or `checkpoint`), `data` the record as JSON. Comments (`:`) keep the connection alive.",
        content_type = "text/event-stream", body = String),
        (status = 404)))]
pub async fn events(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Answer<Sse<impl Stream<Item = Result<Event, Infallible>>>> {
    let run = find(&state.pool, parse_id(&id)?).await?;
    let after: i64 =
        headers.get("last-event-id").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok()).unwrap_or(0);
    let state = (state.pool.clone(), run.id, after, VecDeque::new(), false);
    let stream = futures::stream::unfold(state, |(pool, run_id, mut after, mut pending, mut finished)| async move {
        loop {
            if let Some(record) = pending.pop_front() {
                let record: RunEventRecord = record;
                after = record.seq;
                finished |= record.event.is_final();
                let event = Event::default()
                    .id(record.seq.to_string())
                    .event(record.event.kind())
                    .data(serde_json::to_string(&record).unwrap_or_default());
                return Some((Ok(event), (pool, run_id, after, pending, finished)));
            }
            if finished {
                return None;
            }
            let found = match pool.acquire().await {
                Ok(mut db) => db::events_after(&mut db, run_id, after).await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match found {
                Ok(records) if !records.is_empty() => pending.extend(records),
                Ok(_) => tokio::time::sleep(Duration::from_millis(500)).await,
                Err(e) => {
                    tracing::warn!(%run_id, "event stream: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

/// Cancels a run: a queued run at once, a running one at its next phase boundary (its
/// trainer is then released).
#[utoipa::path(post, path = "/v1/runs/{id}/cancel", params(("id" = Uuid, Path, description = "The run's id")), responses((status = 200, body = Run), (status = 404), (status = 409, description = "the run has already ended")))]
pub async fn cancel(State(state): State<AppState>, Path(id): Path<String>) -> Answer<Json<Run>> {
    let run = find(&state.pool, parse_id(&id)?).await?;
    if !db::request_cancel(&mut *state.pool.acquire().await?, run.id).await? {
        return Err(Failure::Conflict(format!("run {} has already ended ({})", run.id, run.status.name())));
    }
    Ok(Json(find(&state.pool, run.id).await?))
}

/// The run's checkpoints in the checkpoint store (those retention kept).
#[utoipa::path(get, path = "/v1/runs/{id}/checkpoints", params(("id" = Uuid, Path, description = "The run's id")), responses((status = 200, body = Vec<Checkpoint>), (status = 404), (status = 502, description = "The checkpoint store failed")))]
pub async fn checkpoints(State(state): State<AppState>, Path(id): Path<String>) -> Answer<Json<Vec<Checkpoint>>> {
    let run = find(&state.pool, parse_id(&id)?).await?;
    let list = state.checkpoints.list(&run.id.to_string()).await.map_err(|e| Failure::Upstream(e.to_string()))?;
    Ok(Json(list))
}

/// One of the run's checkpoints as a tar archive (the files of a Hugging Face model
/// directory, with the trainer's state), streamed from the checkpoint store: the dashboard's
/// download link.
#[utoipa::path(
    get,
    path = "/v1/runs/{id}/checkpoints/{checkpoint_id}/archive",
    params(("id" = Uuid, Path, description = "The run's id"), ("checkpoint_id" = Uuid, Path, description = "The checkpoint's id")),
    responses((status = 200, content_type = "application/x-tar", description = "the checkpoint's files as a tar archive"), (status = 404), (status = 502, description = "The checkpoint store failed"))
)]
pub async fn checkpoint_archive(
    State(state): State<AppState>,
    Path((id, checkpoint_id)): Path<(String, String)>,
) -> Answer<Response> {
    let run = find(&state.pool, parse_id(&id)?).await?;
    let checkpoint_id = Uuid::parse_str(&checkpoint_id)
        .map_err(|_| Failure::NotFound(format!("no checkpoint `{checkpoint_id}` (checkpoint ids are UUIDs)")))?;
    let list = state.checkpoints.list(&run.id.to_string()).await.map_err(|e| Failure::Upstream(e.to_string()))?;
    let Some(checkpoint) = list.into_iter().find(|c| c.id == checkpoint_id) else {
        return Err(Failure::NotFound(format!("run {} has no checkpoint {checkpoint_id}", run.id)));
    };
    let archive = state.checkpoints.archive(checkpoint_id).await.map_err(|e| Failure::Upstream(e.to_string()))?;
    let name = format!("{}-step{}.tar", run.name.as_deref().unwrap_or("run"), checkpoint.step);
    let name: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    let disposition = format!("attachment; filename=\"{name}\"");
    let body = axum::body::Body::from_stream(archive.bytes_stream());
    Ok(([(header::CONTENT_TYPE, "application/x-tar".to_string()), (header::CONTENT_DISPOSITION, disposition)], body)
        .into_response())
}

#[derive(Debug, OpenApi)]
#[openapi(
    info(
        title = "Keel",
        description = "Keel's run API: submit post-training runs (GRPO, SFT, DPO, reward model, eval), follow their metrics, samples and checkpoints. Bearer-token auth when the orchestrator has a token."
    ),
    paths(
        submit,
        validate,
        list,
        show,
        metrics,
        samples,
        events,
        cancel,
        checkpoints,
        checkpoint_archive,
        crate::datasets::upload,
        prometheus
    ),
    components(schemas(keel_protocol::run::RunEventRecord)),
    modifiers(&ErrorResponses, &BearerAuth)
)]
pub struct ApiDoc;

/// A refused spec (422): the Keel error body with every problem of the spec.
#[derive(Debug, ToSchema)]
#[allow(dead_code)] // the shape `answer` writes, for the document
pub struct InvalidSpecError {
    error: InvalidSpecDetail,
}

#[derive(Debug, ToSchema)]
#[allow(dead_code)]
pub struct InvalidSpecDetail {
    /// `invalid_spec`.
    #[schema(rename = "type")]
    kind: String,
    /// Every problem on one line.
    message: String,
    /// Every problem, each with its field path (`grpo.num_prompts_per_step`).
    problems: Vec<keel_protocol::FieldError>,
}

/// The OpenAPI document as YAML (`openapi/keel.yaml`).
pub fn openapi_yaml() -> String {
    serde_yaml_ng::to_string(&keel_service::openapi::document(&ApiDoc::openapi())).unwrap_or_default()
}

/// The run spec's JSON Schema (`openapi/run-spec.schema.json`): the OpenAPI components
/// with references rewritten to `$defs`.
pub fn run_spec_schema() -> serde_json::Value {
    let document = keel_service::openapi::document(&ApiDoc::openapi());
    let defs = serde_json::to_string(&document["components"]["schemas"])
        .unwrap_or_default()
        .replace("#/components/schemas/", "#/$defs/");
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "Keel run spec",
        "$ref": "#/$defs/RunSpec",
        "$defs": serde_json::from_str::<serde_json::Value>(&defs).unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every error kind: its status, its `type`, the message, the problems of an invalid
    /// spec, and the orchestrator's own failures hidden.
    #[tokio::test]
    async fn every_error_has_its_status_type_and_body() {
        let problems =
            vec![FieldError::new("spec.steps", "must be at least 1"), FieldError::new("spec.lr", "must be > 0")];
        let cases = vec![
            (Failure::InvalidSpec(problems), StatusCode::UNPROCESSABLE_ENTITY, "invalid_spec"),
            (Failure::BadRequest("limit: not a number".into()), StatusCode::BAD_REQUEST, "invalid_request"),
            (Failure::Unauthorized, StatusCode::UNAUTHORIZED, "unauthorized"),
            (Failure::NotFound("no run x".into()), StatusCode::NOT_FOUND, "not_found"),
            (Failure::Conflict("the run has ended".into()), StatusCode::CONFLICT, "conflict"),
            (Failure::Upstream("checkpoint store: refused".into()), StatusCode::BAD_GATEWAY, "upstream"),
            (Failure::Internal("database: gone".into()), StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        ];
        for (failure, status, error_type) in cases {
            let text = failure.to_string();
            let invalid_spec = matches!(failure, Failure::InvalidSpec(_));
            let response = failure.into_response();
            assert_eq!(response.status(), status, "{text}");
            let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
            let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(body["error"]["type"], error_type, "{text}");
            let message = body["error"]["message"].as_str().unwrap();
            if status == StatusCode::INTERNAL_SERVER_ERROR {
                assert_eq!(message, "internal error (see the orchestrator's log)");
            } else {
                assert_eq!(message, text);
            }
            if invalid_spec {
                assert_eq!(message, "spec.steps: must be at least 1; spec.lr: must be > 0");
                let fields: Vec<&str> = body["error"]["problems"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| p["field"].as_str().unwrap())
                    .collect();
                assert_eq!(fields, ["spec.steps", "spec.lr"]);
            } else {
                assert!(body["error"].get("problems").is_none(), "{body}");
            }
        }
    }
}
