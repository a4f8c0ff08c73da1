//! The checkpoint operations behind the REST routes: validation, uploads verified against
//! their sha256, commits, retention, deletion and garbage collection, and events.

use std::sync::Arc;

use async_nats::jetstream;
use bytes::Bytes;
use futures::Stream;
use keel_protocol::Subjects;
use keel_protocol::checkpoint::{Checkpoint, CheckpointEvent, CreateCheckpoint, check_path, is_sha256};
use sqlx::PgPool;
use uuid::Uuid;

use crate::store::{BlobStore, StoreError};
use crate::{db, retention};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    NotFound(String),
    /// The request conflicts with the checkpoint's state (committed, missing files, leased).
    #[error("{0}")]
    Conflict(String),
    #[error("the content's sha256 is {actual}, not the declared {declared}")]
    ShaMismatch { declared: String, actual: String },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("events: {0}")]
    Events(String),
    #[error("internal: {0}")]
    Internal(String),
    /// Every upload slot is taken.
    #[error("too many uploads in progress; retry shortly")]
    Busy,
    /// A download's `Range` header names no part of the file.
    #[error("range `{range}` is not within the file's {size} bytes")]
    BadRange { range: String, size: u64 },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The largest file one upload may carry.
pub const MAX_FILE_BYTES: u64 = 1 << 40;

#[derive(Clone)]
pub struct Checkpoints {
    pub pool: PgPool,
    pub blobs: BlobStore,
    pub events: Option<Events>,
    /// Upload slots (each upload holds part buffers and a database connection).
    pub uploads: Arc<tokio::sync::Semaphore>,
}

impl std::fmt::Debug for Checkpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoints").field("blobs", &self.blobs).finish()
    }
}

/// Checkpoint events on JetStream, acknowledged by the server before a call returns.
#[derive(Clone)]
pub struct Events {
    js: jetstream::Context,
    subjects: Arc<Subjects>,
}

impl Events {
    /// Creates the stream for this prefix when it does not exist.
    pub async fn open(client: async_nats::Client, subjects: Subjects) -> Result<Self> {
        let js = jetstream::new(client);
        let config = jetstream::stream::Config {
            name: subjects.checkpoint_stream(),
            subjects: vec![subjects.checkpoint_created(), subjects.checkpoint_deleted()],
            max_age: std::time::Duration::from_secs(7 * 24 * 3600),
            ..Default::default()
        };
        js.get_or_create_stream(config)
            .await
            .map_err(|e| Error::Events(format!("cannot create the checkpoint event stream: {e}")))?;
        Ok(Self { js, subjects: Arc::new(subjects) })
    }

    async fn publish(&self, subject: String, event: &CheckpointEvent) -> Result<()> {
        let body = serde_json::to_vec(event).map_err(|e| Error::Events(e.to_string()))?;
        let ack = self.js.publish(subject, body.into()).await.map_err(|e| Error::Events(e.to_string()))?;
        ack.await.map_err(|e| Error::Events(e.to_string()))?;
        Ok(())
    }
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events").field("stream", &self.subjects.checkpoint_stream()).finish()
    }
}

fn event(c: &Checkpoint) -> CheckpointEvent {
    CheckpointEvent { id: c.id, run_id: c.run_id.clone(), step: c.step, metrics: c.metrics.clone() }
}

/// Whether `value` holds a NUL character anywhere (a string or a key), which Postgres can
/// store neither in text nor in jsonb.
fn json_has_nul(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::String(s) => s.contains('\0'),
        serde_json::Value::Array(items) => items.iter().any(json_has_nul),
        serde_json::Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || json_has_nul(v)),
        _ => false,
    }
}

/// A lease holder: a name that says who reads the checkpoint.
pub fn check_holder(holder: &str) -> Result<()> {
    if holder.is_empty() || holder.chars().count() > 200 || holder.chars().any(char::is_control) {
        return Err(Error::Invalid("holder: must be 1 to 200 characters, none of them control characters".into()));
    }
    Ok(())
}

fn validate(request: &CreateCheckpoint) -> Result<()> {
    let mut problems = Vec::new();
    let run_chars = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':');
    if request.run_id.is_empty() || request.run_id.len() > 200 || !request.run_id.chars().all(run_chars) {
        problems.push("run_id: must be 1 to 200 letters, digits, `-`, `_`, `.` or `:`".to_string());
    }
    if request.step > i64::MAX as u64 {
        problems.push(format!("step: at most {}", i64::MAX));
    }
    if request.files.is_empty() {
        problems.push("files: a checkpoint holds at least one file".into());
    }
    let mut seen = std::collections::BTreeSet::new();
    for (i, f) in request.files.iter().enumerate() {
        if let Err(e) = check_path(&f.path) {
            problems.push(format!("files[{i}].path: {e}"));
        }
        if !is_sha256(&f.sha256) {
            problems.push(format!("files[{i}].sha256: must be 64 lower-case hex digits"));
        }
        if f.size > MAX_FILE_BYTES {
            problems.push(format!("files[{i}].size: at most {MAX_FILE_BYTES} bytes"));
        }
        if !seen.insert(f.path.as_str()) {
            problems.push(format!("files[{i}].path: `{}` is listed twice", f.path));
        }
    }
    if request.metrics.values().any(|v| !v.is_finite()) {
        problems.push("metrics: values must be finite".into());
    }
    if request.metrics.keys().any(|k| k.is_empty() || k.len() > 200 || k.chars().any(char::is_control)) {
        problems.push("metrics: names must be 1 to 200 characters, none of them control characters".into());
    }
    if json_has_nul(&request.info) {
        problems.push("info: must not contain a NUL character".into());
    }
    // `info` is stored as `jsonb`, which would take these numbers but not give them back:
    // the checkpoint would exist and every read of it fail. (Metrics are stored as floats.)
    if let Some(path) = keel_service::json::unstorable_number(&request.info, "info") {
        problems.push(format!(
            "{path}: a number that would not read back once stored (Postgres writes it out in full, past what a JSON reader takes)"
        ));
    }
    if let Some(r) = &request.retention
        && (r.metric.is_empty() || r.keep_top_k > 10_000 || r.metric.chars().any(char::is_control))
    {
        problems.push("retention: needs a metric (no control characters) and keep_top_k of at most 10000".into());
    }
    if problems.is_empty() { Ok(()) } else { Err(Error::Invalid(problems.join("; "))) }
}

impl Checkpoints {
    pub async fn create(&self, request: CreateCheckpoint) -> Result<Checkpoint> {
        validate(&request)?;
        let mut tx = self.pool.begin().await?;
        let id = db::create(&mut tx, &request).await?;
        tx.commit().await?;
        self.get(id).await
    }

    pub async fn get(&self, id: Uuid) -> Result<Checkpoint> {
        let mut conn = self.pool.acquire().await?;
        db::get(&mut conn, id).await?.ok_or_else(|| Error::NotFound(format!("no checkpoint {id}")))
    }

    /// A complete checkpoint (downloads read only those).
    pub async fn complete(&self, id: Uuid) -> Result<Checkpoint> {
        let c = self.get(id).await?;
        if c.status != "complete" {
            return Err(Error::NotFound(format!("checkpoint {id} is not committed")));
        }
        Ok(c)
    }

    pub async fn list(&self, run_id: &str) -> Result<Vec<Checkpoint>> {
        // No run id holds a NUL (create refuses them), and Postgres cannot compare one.
        if run_id.contains('\0') {
            return Ok(Vec::new());
        }
        let mut conn = self.pool.acquire().await?;
        Ok(db::list(&mut conn, run_id).await?)
    }

    /// Streams one declared file in, verified against its sha256 and size.
    pub async fn upload<E: std::fmt::Display>(
        &self,
        id: Uuid,
        path: &str,
        body: impl Stream<Item = Result<Bytes, E>>,
    ) -> Result<()> {
        check_path(path).map_err(|e| Error::Invalid(e.to_string()))?;
        let _slot = self.uploads.clone().try_acquire_owned().map_err(|_| Error::Busy)?;
        let mut conn = self.pool.acquire().await?;
        let Some((sha256, size, _, status)) = db::pending_file(&mut conn, id, path).await? else {
            return Err(Error::NotFound(format!("checkpoint {id} declares no file `{path}`")));
        };
        drop(conn);
        if status != "pending" {
            return Err(Error::Conflict(format!("checkpoint {id} is committed; its files cannot change")));
        }
        let staged = self.blobs.stage(body, size as u64).await?;
        if staged.sha256 != sha256 || staged.size != size as u64 {
            let actual = format!("{} ({} bytes, {size} declared)", staged.sha256, staged.size);
            self.blobs.discard(staged).await;
            return Err(Error::ShaMismatch { declared: sha256, actual });
        }
        let result = async {
            let mut tx = self.pool.begin().await?;
            if !db::record_upload(&mut tx, id, path, &staged.sha256, staged.size).await? {
                return Err(Error::Conflict(format!("checkpoint {id} was committed or deleted during the upload")));
            }
            self.blobs.promote(&staged).await?;
            tx.commit().await?;
            Ok::<_, Error>(())
        }
        .await;
        if result.is_err() {
            self.blobs.discard(staged).await;
        }
        result
    }

    /// Makes a checkpoint visible (every file present), announces it, applies retention.
    /// Once the commit is in the database it stands: a failed announcement or retention pass
    /// is logged, not answered as a failure.
    pub async fn commit(&self, id: Uuid) -> Result<Checkpoint> {
        let mut tx = self.pool.begin().await?;
        match db::lock(&mut tx, id).await?.as_deref() {
            None => return Err(Error::NotFound(format!("no checkpoint {id}"))),
            Some("complete") => return Err(Error::Conflict(format!("checkpoint {id} is already committed"))),
            Some(_) => {}
        }
        if let Err(missing) = db::commit(&mut tx, id).await? {
            return Err(Error::Conflict(format!("checkpoint {id} is missing files: {}", missing.join(", "))));
        }
        tx.commit().await?;
        let checkpoint = self.get(id).await?;
        if let Some(events) = &self.events
            && let Err(e) = events.publish(events.subjects.checkpoint_created(), &event(&checkpoint)).await
        {
            tracing::error!(%id, "checkpoint committed but its created event was not sent: {e}");
        }
        if let Err(e) = self.apply_retention(&checkpoint.run_id).await {
            tracing::error!(run_id = %checkpoint.run_id, "retention failed: {e}");
        }
        Ok(checkpoint)
    }

    /// Deletes what the run's retention policy does not keep (leased checkpoints wait).
    pub async fn apply_retention(&self, run_id: &str) -> Result<Vec<Uuid>> {
        let mut conn = self.pool.acquire().await?;
        let Some(policy) = db::retention(&mut conn, run_id).await? else { return Ok(Vec::new()) };
        let all = db::list(&mut conn, run_id).await?;
        drop(conn);
        let mut deleted = Vec::new();
        for id in retention::to_delete(&all, &policy) {
            match self.delete_if(id, false).await {
                Ok(()) => deleted.push(id),
                Err(Error::Conflict(reason)) => tracing::info!(%id, "retention keeps it for now: {reason}"),
                Err(e) => return Err(e),
            }
        }
        Ok(deleted)
    }

    /// Deletes a checkpoint nobody is reading, then the blobs nothing references any more.
    pub async fn delete(&self, id: Uuid) -> Result<()> {
        self.delete_if(id, false).await
    }

    /// Deletes a checkpoint (only while still pending, with `only_pending`) unless a lease
    /// holds it; its status is read under the row lock, so a commit cannot slip in between.
    async fn delete_if(&self, id: Uuid, only_pending: bool) -> Result<()> {
        let checkpoint = self.get(id).await?;
        let mut tx = self.pool.begin().await?;
        let status = db::lock(&mut tx, id).await?.ok_or_else(|| Error::NotFound(format!("no checkpoint {id}")))?;
        if only_pending && status != "pending" {
            return Err(Error::Conflict(format!("checkpoint {id} was committed")));
        }
        if db::leased(&mut tx, id).await? {
            return Err(Error::Conflict(format!("checkpoint {id} is being read (a lease holds it)")));
        }
        db::delete(&mut tx, id).await?;
        tx.commit().await?;
        if status == "complete"
            && let Some(events) = &self.events
            && let Err(e) = events.publish(events.subjects.checkpoint_deleted(), &event(&checkpoint)).await
        {
            tracing::error!(%id, "checkpoint deleted but its deleted event was not sent: {e}");
        }
        self.collect_garbage().await?;
        Ok(())
    }

    /// Removes blobs no file references, one short transaction each (see [`db`] for why this
    /// cannot race an upload). It runs as a task of its own, so a client that goes away
    /// cannot cut it off between removing an object and committing.
    pub async fn collect_garbage(&self) -> Result<usize> {
        let this = self.clone();
        let task = tokio::spawn(async move {
            let mut conn = this.pool.acquire().await?;
            let candidates = db::unreferenced(&mut conn).await?;
            drop(conn);
            let mut removed = 0;
            for sha in candidates {
                let mut tx = this.pool.begin().await?;
                if db::unreference(&mut tx, &sha).await? {
                    this.blobs.delete(&sha).await?;
                    removed += 1;
                }
                tx.commit().await?;
            }
            Ok::<_, Error>(removed)
        });
        task.await.map_err(|e| Error::Internal(e.to_string()))?
    }

    /// Start-up and periodic sweep: abandoned pending checkpoints and staging leftovers.
    pub async fn sweep(&self, pending_seconds: f64) -> Result<()> {
        let mut conn = self.pool.acquire().await?;
        let stale = db::stale_pending(&mut conn, pending_seconds).await?;
        drop(conn);
        for id in stale {
            if let Err(e) = self.delete_if(id, true).await {
                tracing::info!(%id, "sweep left it: {e}");
            }
        }
        self.blobs.sweep_staging(std::time::Duration::from_secs_f64(pending_seconds)).await?;
        self.collect_garbage().await?;
        Ok(())
    }
}
