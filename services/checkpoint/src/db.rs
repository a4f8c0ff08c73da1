//! Checkpoint metadata in Postgres, in the service's own schema `checkpoint` (its migrations
//! in `migrations/`, applied at start-up). Repository functions take an executor so they
//! compose inside transactions.
//!
//! Blob references are kept consistent with garbage collection by one rule: whatever adds a
//! reference to a blob (a new checkpoint's file rows, an upload) writes `files` first, and
//! the collector holds `files` in SHARE mode while it deletes blobs, so the two never
//! interleave.

use std::collections::BTreeMap;

use keel_protocol::checkpoint::{Checkpoint, CreateCheckpoint, FileEntry, Lease, Retention};
use sqlx::{PgConnection, PgPool, Postgres, Row};
use uuid::Uuid;

/// The service's schema (also written literally in the queries below).
pub const SCHEMA: &str = "checkpoint";

/// Connects (creating the database when it does not exist), creates the schema and applies
/// the migrations.
pub async fn connect(url: &str) -> Result<PgPool, keel_service::PostgresError> {
    keel_service::postgres::connect(url, SCHEMA, &sqlx::migrate!("./migrations")).await
}

pub type Tx<'a> = sqlx::Transaction<'a, Postgres>;

/// A new pending checkpoint; files whose blob is already stored count as uploaded.
pub async fn create(tx: &mut PgConnection, request: &CreateCheckpoint) -> sqlx::Result<Uuid> {
    let id = Uuid::new_v4();
    let metrics = serde_json::to_value(&request.metrics).unwrap_or_default();
    sqlx::query(
        "INSERT INTO checkpoints (id, run_id, step, status, metrics, info) VALUES ($1, $2, $3, 'pending', $4, $5)",
    )
    .bind(id)
    .bind(&request.run_id)
    .bind(request.step as i64)
    .bind(metrics)
    .bind(&request.info)
    .execute(&mut *tx)
    .await?;
    for file in &request.files {
        sqlx::query(
            "INSERT INTO files (checkpoint_id, path, sha256, size, uploaded) \
             VALUES ($1, $2, $3, $4, EXISTS (SELECT 1 FROM blobs WHERE sha256 = $3 AND size = $4))",
        )
        .bind(id)
        .bind(&file.path)
        .bind(&file.sha256)
        .bind(file.size as i64)
        .execute(&mut *tx)
        .await?;
    }
    if let Some(r) = &request.retention {
        sqlx::query(
            "INSERT INTO runs (run_id, keep_top_k, metric, higher_is_better) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (run_id) DO UPDATE SET keep_top_k = $2, metric = $3, higher_is_better = $4",
        )
        .bind(&request.run_id)
        .bind(r.keep_top_k as i32)
        .bind(&r.metric)
        .bind(r.higher_is_better)
        .execute(&mut *tx)
        .await?;
    }
    Ok(id)
}

/// The declared file at `path` of a pending checkpoint: (sha256, size, uploaded).
pub async fn pending_file(
    conn: &mut PgConnection,
    id: Uuid,
    path: &str,
) -> sqlx::Result<Option<(String, i64, bool, String)>> {
    let row = sqlx::query(
        "SELECT f.sha256, f.size, f.uploaded, c.status FROM files f JOIN checkpoints c ON c.id = f.checkpoint_id \
         WHERE f.checkpoint_id = $1 AND f.path = $2",
    )
    .bind(id)
    .bind(path)
    .fetch_optional(conn)
    .await?;
    row.map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?, r.try_get(3)?))).transpose()
}

/// Marks the file of a still pending checkpoint uploaded (first, so that the collector
/// waits) and records its blob; false when the checkpoint is gone or committed meanwhile.
pub async fn record_upload(tx: &mut PgConnection, id: Uuid, path: &str, sha256: &str, size: u64) -> sqlx::Result<bool> {
    let updated = sqlx::query(
        "UPDATE files f SET uploaded = true FROM checkpoints c \
         WHERE f.checkpoint_id = $1 AND f.path = $2 AND c.id = f.checkpoint_id AND c.status = 'pending'",
    )
    .bind(id)
    .bind(path)
    .execute(&mut *tx)
    .await?;
    if updated.rows_affected() != 1 {
        return Ok(false);
    }
    sqlx::query("INSERT INTO blobs (sha256, size) VALUES ($1, $2) ON CONFLICT (sha256) DO NOTHING")
        .bind(sha256)
        .bind(size as i64)
        .execute(&mut *tx)
        .await?;
    Ok(true)
}

/// Makes a pending checkpoint complete when every file is uploaded; else the missing paths.
pub async fn commit(tx: &mut PgConnection, id: Uuid) -> sqlx::Result<Result<(), Vec<String>>> {
    let missing: Vec<String> =
        sqlx::query_scalar("SELECT path FROM files WHERE checkpoint_id = $1 AND NOT uploaded ORDER BY path")
            .bind(id)
            .fetch_all(&mut *tx)
            .await?;
    if !missing.is_empty() {
        return Ok(Err(missing));
    }
    sqlx::query("UPDATE checkpoints SET status = 'complete' WHERE id = $1").bind(id).execute(&mut *tx).await?;
    Ok(Ok(()))
}

fn checkpoint_of(row: &sqlx::postgres::PgRow, files: Vec<(FileEntry, bool)>) -> sqlx::Result<Checkpoint> {
    let metrics: String = row.try_get("metrics")?;
    let metrics: BTreeMap<String, f64> = serde_json::from_str(&metrics).unwrap_or_default();
    let step: i64 = row.try_get("step")?;
    Ok(Checkpoint {
        id: row.try_get("id")?,
        run_id: row.try_get("run_id")?,
        step: step as u64,
        status: row.try_get("status")?,
        metrics,
        info: row.try_get("info")?,
        missing: files.iter().filter(|(_, up)| !up).map(|(f, _)| f.path.clone()).collect(),
        files: files.into_iter().map(|(f, _)| f).collect(),
        created_at: row.try_get("created_at")?,
    })
}

/// The columns [`checkpoint_of`] reads. The metrics come back as JSON text with each value
/// written as a float8 (`-1.7976931348623157e+308`): jsonb keeps numbers as exact decimals and
/// writes them out in full, and a 309-digit integer near f64's range is more than serde_json
/// parses back.
macro_rules! columns {
    () => {
        "id, run_id, step, status, \
         (SELECT coalesce(json_object_agg(key, (value #>> '{}')::float8), '{}'::json)::text \
          FROM jsonb_each(metrics)) AS metrics, \
         info, extract(epoch FROM created_at)::float8 AS created_at"
    };
}

async fn files_of(conn: &mut PgConnection, id: Uuid) -> sqlx::Result<Vec<(FileEntry, bool)>> {
    let rows = sqlx::query("SELECT path, sha256, size, uploaded FROM files WHERE checkpoint_id = $1 ORDER BY path")
        .bind(id)
        .fetch_all(conn)
        .await?;
    rows.iter()
        .map(|r| {
            let size: i64 = r.try_get(2)?;
            Ok((FileEntry { path: r.try_get(0)?, sha256: r.try_get(1)?, size: size as u64 }, r.try_get(3)?))
        })
        .collect()
}

pub async fn get(conn: &mut PgConnection, id: Uuid) -> sqlx::Result<Option<Checkpoint>> {
    let Some(row) = sqlx::query(concat!("SELECT ", columns!(), " FROM checkpoints WHERE id = $1"))
        .bind(id)
        .fetch_optional(&mut *conn)
        .await?
    else {
        return Ok(None);
    };
    let files = files_of(conn, id).await?;
    checkpoint_of(&row, files).map(Some)
}

/// Complete checkpoints of `run_id`, by step then age.
pub async fn list(conn: &mut PgConnection, run_id: &str) -> sqlx::Result<Vec<Checkpoint>> {
    let rows = sqlx::query(concat!(
        "SELECT ",
        columns!(),
        " FROM checkpoints WHERE run_id = $1 AND status = 'complete' ORDER BY step, created_at"
    ))
    .bind(run_id)
    .fetch_all(&mut *conn)
    .await?;
    let mut out = Vec::with_capacity(rows.len());
    for row in &rows {
        let files = files_of(conn, row.try_get("id")?).await?;
        out.push(checkpoint_of(row, files)?);
    }
    Ok(out)
}

pub async fn retention(conn: &mut PgConnection, run_id: &str) -> sqlx::Result<Option<Retention>> {
    let row = sqlx::query("SELECT keep_top_k, metric, higher_is_better FROM runs WHERE run_id = $1")
        .bind(run_id)
        .fetch_optional(conn)
        .await?;
    row.map(|r| {
        let k: i32 = r.try_get(0)?;
        Ok(Retention { keep_top_k: k.max(0) as usize, metric: r.try_get(1)?, higher_is_better: r.try_get(2)? })
    })
    .transpose()
}

/// Whether a live lease holds the checkpoint.
pub async fn leased(conn: &mut PgConnection, id: Uuid) -> sqlx::Result<bool> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM leases WHERE checkpoint_id = $1 AND expires_at > now())")
        .bind(id)
        .fetch_one(conn)
        .await
}

pub async fn add_lease(conn: &mut PgConnection, id: Uuid, holder: &str, seconds: f64) -> sqlx::Result<Lease> {
    let lease = Uuid::new_v4();
    let expires: f64 = sqlx::query_scalar(
        "INSERT INTO leases (id, checkpoint_id, holder, expires_at) \
         VALUES ($1, $2, $3, now() + make_interval(secs => $4)) RETURNING extract(epoch FROM expires_at)::float8",
    )
    .bind(lease)
    .bind(id)
    .bind(holder)
    .bind(seconds)
    .fetch_one(conn)
    .await?;
    Ok(Lease { id: lease, checkpoint_id: id, holder: holder.to_string(), expires_at: expires })
}

pub async fn remove_lease(conn: &mut PgConnection, id: Uuid, lease: Uuid) -> sqlx::Result<bool> {
    let done = sqlx::query("DELETE FROM leases WHERE id = $1 AND checkpoint_id = $2")
        .bind(lease)
        .bind(id)
        .execute(conn)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// Locks a checkpoint's row for the rest of the transaction; its status, if it exists.
pub async fn lock(conn: &mut PgConnection, id: Uuid) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar("SELECT status FROM checkpoints WHERE id = $1 FOR UPDATE").bind(id).fetch_optional(conn).await
}

/// Deletes a checkpoint's rows (files and leases go with it).
pub async fn delete(conn: &mut PgConnection, id: Uuid) -> sqlx::Result<bool> {
    let done = sqlx::query("DELETE FROM checkpoints WHERE id = $1").bind(id).execute(conn).await?;
    Ok(done.rows_affected() == 1)
}

/// Pending checkpoints older than `seconds` (abandoned uploads).
pub async fn stale_pending(conn: &mut PgConnection, seconds: f64) -> sqlx::Result<Vec<Uuid>> {
    sqlx::query_scalar(
        "SELECT id FROM checkpoints WHERE status = 'pending' AND created_at < now() - make_interval(secs => $1)",
    )
    .bind(seconds)
    .fetch_all(conn)
    .await
}

/// Blobs no uploaded file references (candidates for [`unreference`]).
pub async fn unreferenced(conn: &mut PgConnection) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        "SELECT sha256 FROM blobs b WHERE NOT EXISTS (SELECT 1 FROM files f WHERE f.sha256 = b.sha256 AND f.uploaded)",
    )
    .fetch_all(conn)
    .await
}

/// Deletes one blob's row if still nothing references it, holding `files` so that no new
/// reference appears until `tx` ends; the caller removes the stored object before committing.
pub async fn unreference(tx: &mut PgConnection, sha256: &str) -> sqlx::Result<bool> {
    sqlx::query("LOCK TABLE files IN SHARE MODE").execute(&mut *tx).await?;
    let gone = sqlx::query(
        "DELETE FROM blobs b WHERE b.sha256 = $1 \
         AND NOT EXISTS (SELECT 1 FROM files f WHERE f.sha256 = b.sha256 AND f.uploaded)",
    )
    .bind(sha256)
    .execute(&mut *tx)
    .await?;
    Ok(gone.rows_affected() == 1)
}
