//! REST: create a checkpoint with its file list, stream its files in (each verified against
//! its sha256), commit, list and get, download a file (HTTP ranges) or the whole directory as
//! a tar stream, latest and best of a run, leases for readers, delete. Errors are
//! `{"error": {"type", "message"}}`. [`ApiDoc`] generates `openapi/checkpoint.json`.

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use futures::{StreamExt, TryStreamExt, stream};
use keel_protocol::checkpoint::{Checkpoint, CreateCheckpoint, FileEntry, Lease, LeaseRequest, check_path};
use keel_service::ApiError;
use keel_service::openapi::{BearerAuth, ErrorResponses};
use keel_service::query::Query;
use serde::Deserialize;
use utoipa::{IntoParams, OpenApi};
use uuid::Uuid;

use crate::service::{Checkpoints, Error};
use crate::store::StoreError;
use crate::{db, retention};

pub fn routes(state: Checkpoints) -> Router {
    Router::new()
        .route("/v1/checkpoints", post(create).get(list))
        .route("/v1/checkpoints/{id}", get(show).delete(remove))
        .route("/v1/checkpoints/{id}/commit", post(commit))
        .route("/v1/checkpoints/{id}/files/{*path}", put(upload).get(download))
        .route("/v1/checkpoints/{id}/archive", get(archive))
        .route("/v1/checkpoints/{id}/leases", post(lease))
        .route("/v1/checkpoints/{id}/leases/{lease}", delete(release))
        .route("/v1/runs/{run_id}/checkpoints/latest", get(latest))
        .route("/v1/runs/{run_id}/checkpoints/best", get(best))
        .route("/metrics", get(keel_service::metrics::handler))
        .with_state(state)
}

/// An error as this service answers it.
#[derive(Debug)]
pub struct Failure(Error);

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Self(e)
    }
}

impl From<sqlx::Error> for Failure {
    fn from(e: sqlx::Error) -> Self {
        Self(Error::Database(e))
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let mut response = answer(&self.0).into_response();
        if let Error::BadRange { size, .. } = &self.0
            && let Ok(v) = format!("bytes */{size}").parse()
        {
            response.headers_mut().insert(header::CONTENT_RANGE, v);
        }
        response
    }
}

/// The one place this service's errors become statuses and `type` codes.
fn answer(error: &Error) -> ApiError {
    let (status, error_type) = match error {
        Error::Invalid(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_request"),
        Error::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
        Error::Conflict(_) => (StatusCode::CONFLICT, "conflict"),
        Error::ShaMismatch { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "sha_mismatch"),
        Error::BadRange { .. } => (StatusCode::RANGE_NOT_SATISFIABLE, "bad_range"),
        Error::Store(StoreError::TooLarge(_)) => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
        Error::Store(StoreError::Interrupted(_)) => (StatusCode::BAD_REQUEST, "interrupted"),
        Error::Store(StoreError::Full) => (StatusCode::INSUFFICIENT_STORAGE, "storage_full"),
        Error::Busy => return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "busy", error.to_string()).retry_after(1),
        Error::Store(StoreError::Backend(_)) | Error::Database(_) | Error::Events(_) | Error::Internal(_) => {
            tracing::error!(%error, "request failed");
            let message = "internal error (see the checkpoint service's log)";
            return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message);
        }
    };
    ApiError::new(status, error_type, error.to_string())
}

type Answer<T> = Result<T, Failure>;

fn parse_id(id: &str) -> Result<Uuid, Failure> {
    Uuid::parse_str(id).map_err(|_| Failure(Error::NotFound(format!("`{id}` is not a checkpoint id"))))
}

fn json_body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, Failure> {
    keel_service::json::parse(bytes).map_err(|e| Failure(Error::Invalid(e.to_string())))
}

/// Creates a pending checkpoint; `missing` lists the files to upload (content the store
/// already holds is not sent again).
#[utoipa::path(post, path = "/v1/checkpoints", request_body = CreateCheckpoint,
    responses((status = 201, body = Checkpoint), (status = 422, description = "A bad field, named")))]
pub async fn create(
    State(s): State<Checkpoints>,
    body: axum::body::Bytes,
) -> Answer<(StatusCode, axum::Json<Checkpoint>)> {
    let request: CreateCheckpoint = json_body(&body)?;
    Ok((StatusCode::CREATED, axum::Json(s.create(request).await?)))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RunQuery {
    pub run_id: String,
}

/// Complete checkpoints of a run, by step.
#[utoipa::path(get, path = "/v1/checkpoints", params(RunQuery), responses((status = 200, body = Vec<Checkpoint>)))]
pub async fn list(State(s): State<Checkpoints>, Query(q): Query<RunQuery>) -> Answer<axum::Json<Vec<Checkpoint>>> {
    Ok(axum::Json(s.list(&q.run_id).await?))
}

#[utoipa::path(get, path = "/v1/checkpoints/{id}", params(("id" = Uuid, Path, description = "The checkpoint's id")), responses((status = 200, body = Checkpoint), (status = 404)))]
pub async fn show(State(s): State<Checkpoints>, Path(id): Path<String>) -> Answer<axum::Json<Checkpoint>> {
    Ok(axum::Json(s.get(parse_id(&id)?).await?))
}

/// Deletes a checkpoint (409 while a lease holds it).
#[utoipa::path(delete, path = "/v1/checkpoints/{id}", params(("id" = Uuid, Path, description = "The checkpoint's id")), responses((status = 204), (status = 404), (status = 409)))]
pub async fn remove(State(s): State<Checkpoints>, Path(id): Path<String>) -> Answer<StatusCode> {
    s.delete(parse_id(&id)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Makes the checkpoint visible once every file is present (409 listing the missing ones).
#[utoipa::path(post, path = "/v1/checkpoints/{id}/commit", params(("id" = Uuid, Path, description = "The checkpoint's id")), responses((status = 200, body = Checkpoint), (status = 409)))]
pub async fn commit(State(s): State<Checkpoints>, Path(id): Path<String>) -> Answer<axum::Json<Checkpoint>> {
    Ok(axum::Json(s.commit(parse_id(&id)?).await?))
}

/// Streams one declared file in; it must hash to its declared sha256 and size.
#[utoipa::path(put, path = "/v1/checkpoints/{id}/files/{path}", params(("id" = Uuid, Path, description = "The checkpoint's id"), ("path" = String, Path, description = "A file's path inside the checkpoint")), request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 204), (status = 404), (status = 409), (status = 413), (status = 422, description = "sha256 mismatch"), (status = 503, description = "Every upload slot is taken; retry after `Retry-After`"), (status = 507)))]
pub async fn upload(
    State(s): State<Checkpoints>,
    Path((id, path)): Path<(String, String)>,
    body: Body,
) -> Answer<StatusCode> {
    s.upload(parse_id(&id)?, &path, body.into_data_stream()).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `bytes=a-b`, `bytes=a-` or `bytes=-n` of a file of `size` bytes, as a half-open range.
fn parse_range(value: &str, size: u64) -> Option<std::ops::Range<u64>> {
    let spec = value.strip_prefix("bytes=")?.trim();
    let (start, end) = spec.split_once('-')?;
    let range = match (start.trim(), end.trim()) {
        ("", n) => size.saturating_sub(n.parse().ok()?)..size,
        (a, "") => a.parse().ok()?..size,
        (a, b) => a.parse().ok()?..b.parse::<u64>().ok()?.saturating_add(1).min(size),
    };
    (range.start < range.end).then_some(range)
}

fn file_of(c: &Checkpoint, path: &str) -> Result<FileEntry, Failure> {
    c.files
        .iter()
        .find(|f| f.path == path)
        .cloned()
        .ok_or_else(|| Failure(Error::NotFound(format!("checkpoint {} has no file `{path}`", c.id))))
}

/// Downloads a file of a complete checkpoint; honours a single `Range`.
#[utoipa::path(get, path = "/v1/checkpoints/{id}/files/{path}",
    params(("id" = Uuid, Path, description = "The checkpoint's id"), ("path" = String, Path, description = "A file's path inside the checkpoint")),
    responses((status = 200, content_type = "application/octet-stream"), (status = 206), (status = 404), (status = 416)))]
pub async fn download(
    State(s): State<Checkpoints>,
    Path((id, path)): Path<(String, String)>,
    headers: HeaderMap,
) -> Answer<Response> {
    check_path(&path).map_err(|e| Failure(Error::NotFound(e.to_string())))?;
    let checkpoint = s.complete(parse_id(&id)?).await?;
    let file = file_of(&checkpoint, &path)?;
    let mut builder = Response::builder()
        .header(header::ACCEPT_RANGES, "bytes")
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::ETAG, format!("\"{}\"", file.sha256));
    let range = match headers.get(header::RANGE).and_then(|v| v.to_str().ok()) {
        None => None,
        Some(value) => match parse_range(value, file.size) {
            Some(range) => Some(range),
            None => return Err(Failure(Error::BadRange { range: value.to_string(), size: file.size })),
        },
    };
    let (status, length) = match &range {
        Some(r) => {
            builder = builder.header(header::CONTENT_RANGE, format!("bytes {}-{}/{}", r.start, r.end - 1, file.size));
            (StatusCode::PARTIAL_CONTENT, r.end - r.start)
        }
        None => (StatusCode::OK, file.size),
    };
    let stream = if file.size == 0 {
        stream::empty().boxed()
    } else {
        s.blobs.get(&file.sha256, range).await.map_err(Error::from)?
    };
    builder
        .status(status)
        .header(header::CONTENT_LENGTH, length)
        .body(Body::from_stream(stream))
        .map_err(|e| Failure(Error::Internal(e.to_string())))
}

/// One tar member's header (ustar; long paths are split into prefix and name).
fn tar_header(file: &FileEntry, mtime: u64) -> Result<Vec<u8>, Failure> {
    let mut header = tar::Header::new_ustar();
    header.set_path(&file.path).map_err(|e| Failure(Error::Invalid(format!("{}: {e}", file.path))))?;
    header.set_size(file.size);
    header.set_mode(0o644);
    header.set_mtime(mtime);
    header.set_entry_type(tar::EntryType::Regular);
    header.set_cksum();
    Ok(header.as_bytes().to_vec())
}

/// The whole checkpoint as a tar stream of its HF directory (`tar -x` gives the directory).
#[utoipa::path(get, path = "/v1/checkpoints/{id}/archive", params(("id" = Uuid, Path, description = "The checkpoint's id")), responses((status = 200, content_type = "application/x-tar"), (status = 404)))]
pub async fn archive(State(s): State<Checkpoints>, Path(id): Path<String>) -> Answer<Response> {
    let checkpoint = s.complete(parse_id(&id)?).await?;
    let mtime = checkpoint.created_at as u64;
    let mut parts = Vec::with_capacity(checkpoint.files.len());
    for file in &checkpoint.files {
        parts.push((tar_header(file, mtime)?, file.clone()));
    }
    let blobs = s.blobs.clone();
    let members = stream::iter(parts).flat_map(move |(header, file)| {
        let blobs = blobs.clone();
        let padding = vec![0u8; ((512 - file.size % 512) % 512) as usize];
        let content = stream::once(async move {
            if file.size == 0 { Ok(stream::empty().boxed()) } else { blobs.get(&file.sha256, None).await }
        })
        .try_flatten();
        stream::once(async move { Ok(bytes::Bytes::from(header)) })
            .chain(content)
            .chain(stream::once(async move { Ok(bytes::Bytes::from(padding)) }))
    });
    let body = members.chain(stream::once(async { Ok::<_, StoreError>(bytes::Bytes::from(vec![0u8; 1024])) }));
    let name = format!("attachment; filename=\"{}-step{}.tar\"", checkpoint.run_id.replace('"', ""), checkpoint.step);
    Response::builder()
        .header(header::CONTENT_TYPE, "application/x-tar")
        .header(header::CONTENT_DISPOSITION, name)
        .body(Body::from_stream(body))
        .map_err(|e| Failure(Error::Internal(e.to_string())))
}

/// Promises to read the checkpoint: neither retention nor `DELETE` removes it meanwhile.
#[utoipa::path(post, path = "/v1/checkpoints/{id}/leases", params(("id" = Uuid, Path, description = "The checkpoint's id")), request_body = LeaseRequest, responses((status = 201, body = Lease)))]
pub async fn lease(
    State(s): State<Checkpoints>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Answer<(StatusCode, axum::Json<Lease>)> {
    let request: LeaseRequest = json_body(&body)?;
    if !(request.seconds > 0.0 && request.seconds <= 7.0 * 86400.0) {
        return Err(Failure(Error::Invalid("seconds: must be more than 0 and at most a week".into())));
    }
    crate::service::check_holder(&request.holder).map_err(Failure)?;
    let checkpoint = s.complete(parse_id(&id)?).await?;
    let mut conn = s.pool.acquire().await?;
    Ok((
        StatusCode::CREATED,
        axum::Json(db::add_lease(&mut conn, checkpoint.id, &request.holder, request.seconds).await?),
    ))
}

#[utoipa::path(delete, path = "/v1/checkpoints/{id}/leases/{lease}", params(("id" = Uuid, Path, description = "The checkpoint's id"), ("lease" = Uuid, Path, description = "The lease's id")), responses((status = 204), (status = 404)))]
pub async fn release(State(s): State<Checkpoints>, Path((id, lease)): Path<(String, String)>) -> Answer<StatusCode> {
    let (id, lease) = (parse_id(&id)?, parse_id(&lease)?);
    let mut conn = s.pool.acquire().await?;
    if !db::remove_lease(&mut conn, id, lease).await? {
        return Err(Failure(Error::NotFound(format!("no lease {lease} on checkpoint {id}"))));
    }
    drop(conn);
    let run_id = s.get(id).await?.run_id;
    s.apply_retention(&run_id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The run's latest complete checkpoint (highest step, then newest).
#[utoipa::path(get, path = "/v1/runs/{run_id}/checkpoints/latest", params(("run_id" = String, Path, description = "The run's id")), responses((status = 200, body = Checkpoint), (status = 404)))]
pub async fn latest(State(s): State<Checkpoints>, Path(run_id): Path<String>) -> Answer<axum::Json<Checkpoint>> {
    let all = s.list(&run_id).await?;
    let newest = retention::latest(&all).cloned();
    newest.map(axum::Json).ok_or_else(|| Failure(Error::NotFound(format!("run {run_id} has no complete checkpoint"))))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct BestQuery {
    pub metric: String,
    /// Default true.
    pub higher_is_better: Option<bool>,
}

/// The run's best complete checkpoint by a metric (ties go to the newer).
#[utoipa::path(get, path = "/v1/runs/{run_id}/checkpoints/best", params(("run_id" = String, Path, description = "The run's id"), BestQuery), responses((status = 200, body = Checkpoint), (status = 404)))]
pub async fn best(
    State(s): State<Checkpoints>,
    Path(run_id): Path<String>,
    Query(q): Query<BestQuery>,
) -> Answer<axum::Json<Checkpoint>> {
    let higher = q.higher_is_better.unwrap_or(true);
    let all = s.list(&run_id).await?;
    let best = retention::ranked(&all, &q.metric, higher).first().copied().cloned();
    best.map(axum::Json).ok_or_else(|| {
        Failure(Error::NotFound(format!("run {run_id} has no complete checkpoint with metric `{}`", q.metric)))
    })
}

#[derive(Debug, OpenApi)]
#[openapi(
    info(
        title = "Keel checkpoint",
        description = "Checkpoint storage: verified streaming uploads, atomic commits, content-addressed blobs, retention, HF directory export. Events: `<prefix>.checkpoint.created` and `<prefix>.checkpoint.deleted` on JetStream."
    ),
    paths(create, list, show, remove, commit, upload, download, archive, lease, release, latest, best),
    modifiers(&ErrorResponses, &BearerAuth)
)]
pub struct ApiDoc;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(parse_range("bytes=0-99", 1000), Some(0..100));
        assert_eq!(parse_range("bytes=900-", 1000), Some(900..1000));
        assert_eq!(parse_range("bytes=-100", 1000), Some(900..1000));
        assert_eq!(parse_range("bytes=990-2000", 1000), Some(990..1000));
        for bad in ["bytes=1000-", "bytes=5-1", "items=0-1", "bytes=a-b", "bytes=0-1,5-6"] {
            assert_eq!(parse_range(bad, 1000), None, "{bad}");
        }
    }

    /// Every error kind: its status, its `type`, a message that says what happened (and
    /// hides the service's own failures), and the headers a client acts on.
    #[tokio::test]
    async fn every_error_has_its_status_type_and_body() {
        let cases: Vec<(Error, StatusCode, &str)> = vec![
            (Error::Invalid("bad name".into()), StatusCode::UNPROCESSABLE_ENTITY, "invalid_request"),
            (Error::NotFound("no checkpoint x".into()), StatusCode::NOT_FOUND, "not_found"),
            (Error::Conflict("committed".into()), StatusCode::CONFLICT, "conflict"),
            (
                Error::ShaMismatch { declared: "aa".into(), actual: "bb".into() },
                StatusCode::UNPROCESSABLE_ENTITY,
                "sha_mismatch",
            ),
            (Error::BadRange { range: "bytes=9-".into(), size: 5 }, StatusCode::RANGE_NOT_SATISFIABLE, "bad_range"),
            (Error::Store(StoreError::TooLarge(3)), StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
            (Error::Store(StoreError::Interrupted("reset".into())), StatusCode::BAD_REQUEST, "interrupted"),
            (Error::Store(StoreError::Full), StatusCode::INSUFFICIENT_STORAGE, "storage_full"),
            (Error::Busy, StatusCode::SERVICE_UNAVAILABLE, "busy"),
            (Error::Store(StoreError::Backend("disk".into())), StatusCode::INTERNAL_SERVER_ERROR, "internal"),
            (Error::Database(sqlx::Error::PoolTimedOut), StatusCode::INTERNAL_SERVER_ERROR, "internal"),
            (Error::Events("down".into()), StatusCode::INTERNAL_SERVER_ERROR, "internal"),
            (Error::Internal("bug".into()), StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        ];
        for (error, status, error_type) in cases {
            let shown = error.to_string();
            let is_bad_range = matches!(error, Error::BadRange { .. });
            let response = Failure(error).into_response();
            assert_eq!(response.status(), status, "{shown}");
            let headers = response.headers().clone();
            let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
            let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(body["error"]["type"], error_type, "{shown}");
            let message = body["error"]["message"].as_str().unwrap();
            if status == StatusCode::INTERNAL_SERVER_ERROR {
                assert_eq!(message, "internal error (see the checkpoint service's log)");
            } else {
                assert_eq!(message, shown);
            }
            assert_eq!(headers.contains_key(header::RETRY_AFTER), status == StatusCode::SERVICE_UNAVAILABLE, "{shown}");
            if is_bad_range {
                assert_eq!(headers[header::CONTENT_RANGE], "bytes */5");
            }
        }
    }
}
