//! The checkpoint store's REST API (`openapi/checkpoint.json`).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use futures::StreamExt;
use keel_protocol::checkpoint::{Checkpoint, CreateCheckpoint, FileEntry, Retention, check_path};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use uuid::Uuid;

use crate::retry::Patience;
use crate::{Error, Result, checked, io, json, unreachable};

/// A checkpoint service at `url` (`http://host:8083`). Every call waits out a service that
/// cannot be reached or answers 502/503/504, for up to its [`Patience`] (none by default).
#[derive(Debug, Clone)]
pub struct CheckpointClient {
    url: String,
    http: reqwest::Client,
    patience: Patience,
    /// `Authorization: Bearer <token>` for a store that wants one.
    authorization: Option<reqwest::header::HeaderValue>,
}

/// Worth retrying: the service is not there (yet), or a proxy in front of it says so.
fn transient(e: &Error) -> bool {
    matches!(e, Error::Unreachable { .. } | Error::Api { status: 502..=504, .. })
}

/// What a new checkpoint records besides its files.
#[derive(Debug, Clone, Default)]
pub struct NewCheckpoint {
    pub run_id: String,
    pub step: u64,
    pub metrics: BTreeMap<String, f64>,
    pub info: serde_json::Value,
    pub retention: Option<Retention>,
}

impl CheckpointClient {
    pub fn new(url: &str) -> Self {
        Self {
            url: url.trim_end_matches('/').to_string(),
            http: crate::http_client(),
            patience: Patience::none(),
            authorization: None,
        }
    }

    /// The same client, sending `Authorization: Bearer <token>` on every request (the
    /// store's `api_token`).
    pub fn with_token(self, token: Option<&str>) -> Self {
        // A token that is not a valid header value is sent as nothing, and the store says 401.
        let authorization = token.and_then(|t| reqwest::header::HeaderValue::from_str(&format!("Bearer {t}")).ok());
        Self {
            authorization: authorization.map(|mut v| {
                v.set_sensitive(true);
                v
            }),
            ..self
        }
    }

    /// Every request's headers: the trace context, and the token when there is one.
    fn headers(&self) -> reqwest::header::HeaderMap {
        let mut headers = keel_telemetry::http_headers();
        if let Some(value) = &self.authorization {
            headers.insert(reqwest::header::AUTHORIZATION, value.clone());
        }
        headers
    }

    /// The same client, retrying calls for up to `patience` while the service is away.
    pub fn with_patience(self, patience: Patience) -> Self {
        Self { patience, ..self }
    }

    /// The same client, telling `watcher` of a wait that outlasts its patience instead of
    /// giving up (see [`crate::retry::Watcher`]).
    pub fn watched_by(self, watcher: std::sync::Arc<dyn crate::retry::Watcher>) -> Self {
        Self { patience: self.patience.clone().watched_by(watcher), ..self }
    }

    /// A run's complete checkpoints, oldest step first.
    pub async fn list(&self, run_id: &str) -> Result<Vec<Checkpoint>> {
        self.patience.retry("list checkpoints", transient, || self.list_once(run_id)).await
    }

    async fn list_once(&self, run_id: &str) -> Result<Vec<Checkpoint>> {
        let response = self
            .http
            .get(format!("{}/v1/checkpoints", self.url))
            .query(&[("run_id", run_id)])
            .headers(self.headers())
            .send()
            .await
            .map_err(unreachable("list checkpoints"))?;
        json(response, "list checkpoints").await
    }

    /// The run's latest complete checkpoint, if it has one.
    pub async fn latest(&self, run_id: &str) -> Result<Option<Checkpoint>> {
        self.patience.retry("latest checkpoint", transient, || self.latest_once(run_id)).await
    }

    async fn latest_once(&self, run_id: &str) -> Result<Option<Checkpoint>> {
        let response = self
            .http
            .get(format!("{}/v1/runs/{run_id}/checkpoints/latest", self.url))
            .headers(self.headers())
            .send()
            .await
            .map_err(unreachable("latest checkpoint"))?;
        if response.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        json(response, "latest checkpoint").await.map(Some)
    }

    pub async fn get(&self, id: Uuid) -> Result<Checkpoint> {
        self.patience.retry("get checkpoint", transient, || self.get_once(id)).await
    }

    async fn get_once(&self, id: Uuid) -> Result<Checkpoint> {
        let response = self
            .http
            .get(format!("{}/v1/checkpoints/{id}", self.url))
            .headers(self.headers())
            .send()
            .await
            .map_err(unreachable("get"))?;
        json(response, &format!("checkpoint {id}")).await
    }

    /// Uploads every regular file under `dir` (hidden entries left out) as one checkpoint:
    /// create, stream the files the store does not hold yet, commit. Returns the committed
    /// checkpoint. A try cut off by an outage is started again as a whole (files the store
    /// received already are not sent twice; an uncommitted checkpoint is never visible).
    pub async fn upload_dir(&self, dir: &Path, new: NewCheckpoint) -> Result<Checkpoint> {
        self.patience.retry("upload checkpoint", transient, || self.upload_dir_once(dir, new.clone())).await
    }

    async fn upload_dir_once(&self, dir: &Path, new: NewCheckpoint) -> Result<Checkpoint> {
        let root = dir.to_path_buf();
        let files = tokio::task::spawn_blocking(move || -> Result<Vec<FileEntry>> {
            files_under(&root)?
                .into_iter()
                .map(|rel| {
                    let (sha256, size) = sha256_file(&root.join(&rel))?;
                    Ok(FileEntry { path: rel.to_string_lossy().into_owned(), sha256, size })
                })
                .collect()
        })
        .await
        .map_err(|e| Error::Io(format!("hashing {}: {e}", dir.display())))??;
        let request = CreateCheckpoint {
            run_id: new.run_id,
            step: new.step,
            metrics: new.metrics,
            info: new.info,
            files,
            retention: new.retention,
        };
        let url = &self.url;
        let response = self
            .http
            .post(format!("{url}/v1/checkpoints"))
            .json(&request)
            .headers(self.headers())
            .send()
            .await
            .map_err(unreachable("create"))?;
        let created: Checkpoint = json(response, "create").await?;
        // Only files listed here are ever read, whatever the service names as missing.
        for path in request.files.iter().map(|f| &f.path).filter(|p| created.missing.contains(p)) {
            let what = format!("upload {path}");
            let file = tokio::fs::File::open(dir.join(path)).await.map_err(io(&what))?;
            let body = reqwest::Body::wrap_stream(crate::chunks(file));
            let response = self
                .http
                .put(format!("{url}/v1/checkpoints/{}/files/{path}", created.id))
                .body(body)
                .headers(self.headers())
                .send()
                .await
                .map_err(unreachable(&what))?;
            checked(response, &what).await?;
        }
        let response = self
            .http
            .post(format!("{url}/v1/checkpoints/{}/commit", created.id))
            .headers(self.headers())
            .send()
            .await
            .map_err(unreachable("commit"))?;
        json(response, "commit").await
    }

    /// Downloads checkpoint `id` to `out`, which must not exist; files are verified and the
    /// directory appears only when complete.
    pub async fn download_dir(&self, id: Uuid, out: &Path) -> Result<()> {
        if out.exists() {
            return Err(Error::Invalid(format!("{} exists already", out.display())));
        }
        self.patience.retry("download checkpoint", transient, || self.download_dir_once(id, out)).await
    }

    async fn download_dir_once(&self, id: Uuid, out: &Path) -> Result<()> {
        let checkpoint = self.get_once(id).await?;
        if checkpoint.status != "complete" {
            return Err(Error::Invalid(format!("checkpoint {id} is not committed")));
        }
        let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        tokio::fs::create_dir_all(parent).await.map_err(io(parent.display()))?;
        let staging = tempfile::Builder::new()
            .prefix(".keel-download-")
            .tempdir_in(parent)
            .map_err(io(format!("a staging directory in {}", parent.display())))?;
        for file in &checkpoint.files {
            check_path(&file.path).map_err(|e| Error::Invalid(format!("the service sent a bad file name: {e}")))?;
            let target = staging.path().join(&file.path);
            if let Some(dir) = target.parent() {
                tokio::fs::create_dir_all(dir).await.map_err(io(dir.display()))?;
            }
            let what = format!("download {}", file.path);
            let response = self
                .http
                .get(format!("{}/v1/checkpoints/{id}/files/{}", self.url, file.path))
                .headers(self.headers())
                .send()
                .await
                .map_err(unreachable(&what))?;
            let mut body = checked(response, &what).await?.bytes_stream();
            let created = tokio::fs::File::create(&target).await.map_err(io(target.display()))?;
            let mut writer = tokio::io::BufWriter::with_capacity(1 << 20, created);
            let mut hasher = Sha256::new();
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(unreachable(&what))?;
                hasher.update(&chunk);
                writer.write_all(&chunk).await.map_err(io(target.display()))?;
            }
            writer.flush().await.map_err(io(target.display()))?;
            writer.get_ref().sync_all().await.map_err(io(target.display()))?;
            let sha = hex::encode(hasher.finalize());
            if sha != file.sha256 {
                return Err(Error::Invalid(format!(
                    "{} arrived with sha256 {sha}, expected {}",
                    file.path, file.sha256
                )));
            }
        }
        let staged = staging.keep();
        std::fs::rename(&staged, out).map_err(io(format!("moving the download to {}", out.display())))?;
        Ok(())
    }

    /// Checkpoint `id` as one tar stream (the store's `archive`), its status checked.
    pub async fn archive(&self, id: Uuid) -> Result<reqwest::Response> {
        let response = self
            .http
            .get(format!("{}/v1/checkpoints/{id}/archive", self.url))
            .headers(self.headers())
            .send()
            .await
            .map_err(unreachable("export"))?;
        checked(response, "export").await
    }

    /// Writes checkpoint `id` as one tar file at `out` (written beside it, then renamed).
    pub async fn export_tar(&self, id: Uuid, out: &Path) -> Result<()> {
        let mut body = self.archive(id).await?.bytes_stream();
        let partial = out.with_extension("tar.partial");
        let created = tokio::fs::File::create(&partial).await.map_err(io(partial.display()))?;
        let mut writer = tokio::io::BufWriter::with_capacity(1 << 20, created);
        while let Some(chunk) = body.next().await {
            writer.write_all(&chunk.map_err(unreachable("export"))?).await.map_err(io(partial.display()))?;
        }
        writer.flush().await.map_err(io(partial.display()))?;
        writer.get_ref().sync_all().await.map_err(io(partial.display()))?;
        std::fs::rename(&partial, out).map_err(io(out.display()))?;
        Ok(())
    }
}

/// Every regular file under `dir`, relative, sorted; hidden entries (`.gitattributes`,
/// `.cache/`) are left out and symbolic links are not followed.
pub fn files_under(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next).map_err(io(next.display()))? {
            let entry = entry.map_err(io(next.display()))?;
            if entry.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            let kind = entry.file_type().map_err(io(entry.path().display()))?;
            if kind.is_dir() {
                pending.push(entry.path());
            } else if kind.is_file() {
                let path = entry.path();
                let rel = path.strip_prefix(dir).map_err(|e| Error::Io(e.to_string()))?;
                out.push(rel.to_path_buf());
            }
        }
    }
    out.sort();
    Ok(out)
}

fn sha256_file(path: &Path) -> Result<(String, u64)> {
    let mut file = std::fs::File::open(path).map_err(io(path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io(path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((hex::encode(hasher.finalize()), size))
}
