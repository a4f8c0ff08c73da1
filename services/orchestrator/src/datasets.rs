//! Datasets uploaded through the API, so that a user's data reaches the orchestrator from
//! wherever `keel run submit` runs: `POST /v1/datasets?name=FILE` streams the file's bytes
//! into `<work_dir>/datasets/<sha256>.<ext>` (the same bytes, the same path: an upload is
//! kept once) and answers that path, which a spec's `data.*.path` then names. What the file
//! holds is checked when a spec names it, as for any dataset path.

use std::path::PathBuf;

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use futures::StreamExt;
use keel_protocol::run::DatasetUploaded;
use keel_service::query::Query;
use serde::Deserialize;
use sha2::Digest;
use tokio::io::AsyncWriteExt;
use utoipa::IntoParams;

use crate::api::{Answer, AppState, Failure};

/// The extensions a dataset file may have: the reader its spec names must match it.
const EXTENSIONS: [&str; 2] = ["jsonl", "parquet"];

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct UploadQuery {
    /// The file's name: it must end in `.jsonl` or `.parquet`.
    pub name: String,
}

/// The directory uploads are kept in.
pub fn dir(work_dir: &std::path::Path) -> PathBuf {
    work_dir.join("datasets")
}

/// Uploads a dataset file (JSONL or Parquet, by its name's extension) as the request's raw
/// body, up to the orchestrator's `max_dataset_bytes`. Answers the path a run spec's
/// `data.*.path` names it by.
#[utoipa::path(post, path = "/v1/datasets", params(UploadQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "The file's bytes"),
    responses((status = 201, body = DatasetUploaded), (status = 400, description = "The name is not a .jsonl or .parquet file's"),
        (status = 413, description = "The file is larger than the orchestrator's max_dataset_bytes")))]
pub async fn upload(
    State(state): State<AppState>,
    Query(query): Query<UploadQuery>,
    body: Body,
) -> Answer<(StatusCode, Json<DatasetUploaded>)> {
    let extension = std::path::Path::new(&query.name)
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .filter(|e| EXTENSIONS.contains(&e.as_str()))
        .ok_or_else(|| {
            Failure::BadRequest(format!(
                "name: `{}` must end in .jsonl or .parquet (the reader follows it)",
                query.name
            ))
        })?;
    let failed = |what: &str, e: &dyn std::fmt::Display| Failure::Internal(format!("{what}: {e}"));
    let dir = &state.datasets;
    tokio::fs::create_dir_all(dir).await.map_err(|e| failed("cannot make the datasets directory", &e))?;
    // Removed however the upload ends (refused, broken off, or the client gone), unless kept.
    let partial = Partial(dir.join(format!(".upload-{}", uuid::Uuid::new_v4().simple())));
    let (sha256, bytes) = receive(body, &partial.0, state.max_dataset_bytes).await?;
    let path = dir.join(format!("{sha256}.{extension}"));
    tokio::fs::rename(&partial.0, &path).await.map_err(|e| failed("cannot keep the upload", &e))?;
    tracing::info!(path = %path.display(), bytes, name = %query.name, "dataset uploaded");
    let path = path.to_string_lossy().into_owned();
    Ok((StatusCode::CREATED, Json(DatasetUploaded { path, sha256, bytes })))
}

/// A file being uploaded, removed when dropped (after a rename it is gone already).
struct Partial(PathBuf);

impl Drop for Partial {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Writes `body` to `to` as it arrives, hashing it; refused past `limit` bytes.
async fn receive(body: Body, to: &std::path::Path, limit: u64) -> Answer<(String, u64)> {
    let failed = |e: std::io::Error| Failure::Internal(format!("cannot write the upload: {e}"));
    let mut file = tokio::fs::File::create(to).await.map_err(failed)?;
    let mut hash = sha2::Sha256::new();
    let mut bytes = 0u64;
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| Failure::BadRequest(format!("the upload broke off: {e}")))?;
        bytes += chunk.len() as u64;
        if bytes > limit {
            return Err(Failure::TooLarge(format!(
                "the file is larger than this orchestrator takes ({limit} bytes: max_dataset_bytes)"
            )));
        }
        hash.update(&chunk);
        file.write_all(&chunk).await.map_err(failed)?;
    }
    file.flush().await.map_err(failed)?;
    file.sync_all().await.map_err(failed)?;
    Ok((hex::encode(hash.finalize()), bytes))
}
