//! Runs in Postgres, in the service's own schema `orchestrator` (migrations in
//! `migrations/`, applied at start-up). Repository functions take an executor so they
//! compose inside transactions.
//!
//! Ownership: each claim of a run has an `owner` id of its own (a fresh one per claim, so
//! two claims by one instance differ too), and its driver renews `heartbeat_at`; every
//! write a driver makes checks that its claim still owns the run, so a driver that lost its
//! run (its lease ran out and another claim took over, even one by the same instance)
//! cannot record a step twice. A step's metrics, samples, dataloader position and event are written in one
//! transaction.

use std::collections::BTreeMap;

use keel_protocol::run::{Algorithm, MetricSeries, Run, RunEvent, RunEventRecord, RunSpec, RunStatus, Sample};
use sqlx::postgres::PgRow;
use sqlx::types::Json;
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

pub const SCHEMA: &str = "orchestrator";

/// Timestamps leave Postgres as RFC 3339 UTC text.
macro_rules! utc {
    ($column:literal) => {
        concat!("to_char(", $column, " AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')")
    };
}

/// The statuses of a run an orchestrator drives.
macro_rules! active {
    () => {
        "status IN ('running', 'waiting')"
    };
}

macro_rules! run_columns {
    () => {
        concat!(
            "id, name, algorithm, spec, status, reason, step, total_steps, ",
            utc!("created_at"),
            " AS created, ",
            utc!("updated_at"),
            " AS updated"
        )
    };
}

/// Connects (creating the database when it does not exist), creates the schema and applies
/// the migrations.
pub async fn connect(url: &str) -> Result<PgPool, keel_service::PostgresError> {
    keel_service::postgres::connect(url, SCHEMA, &sqlx::migrate!("./migrations")).await
}

fn run_from_row(row: &PgRow) -> sqlx::Result<Run> {
    let spec: serde_json::Value = row.try_get("spec")?;
    let spec: RunSpec = serde_json::from_value(spec).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
    let status: String = row.try_get("status")?;
    let status = RunStatus::from_name(&status)
        .ok_or_else(|| sqlx::Error::Decode(format!("unknown run status `{status}`").into()))?;
    let algorithm: String = row.try_get("algorithm")?;
    let algorithm: Algorithm =
        serde_json::from_value(serde_json::Value::String(algorithm)).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
    let run = Run {
        id: row.try_get("id")?,
        name: row.try_get("name")?,
        algorithm,
        status,
        reason: row.try_get("reason")?,
        step: row.try_get::<i64, _>("step")? as u64,
        total_steps: row.try_get::<i64, _>("total_steps")? as u64,
        created_at: row.try_get("created")?,
        updated_at: row.try_get("updated")?,
        latest_metrics: BTreeMap::new(),
        spec,
    };
    Ok(run)
}

async fn with_latest_metrics(db: &mut PgConnection, mut run: Run) -> sqlx::Result<Run> {
    let rows =
        sqlx::query("SELECT DISTINCT ON (name) name, value FROM metrics WHERE run_id = $1 ORDER BY name, step DESC")
            .bind(run.id)
            .fetch_all(&mut *db)
            .await?;
    for row in rows {
        run.latest_metrics.insert(row.try_get("name")?, row.try_get("value")?);
    }
    Ok(run)
}

/// A new queued run.
pub async fn insert_run(db: &mut PgConnection, spec: &RunSpec) -> sqlx::Result<Run> {
    let id = Uuid::new_v4();
    let spec_json = serde_json::to_value(spec).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    sqlx::query(
        "INSERT INTO runs (id, name, algorithm, spec, status, total_steps) VALUES ($1, $2, $3, $4, 'queued', $5)",
    )
    .bind(id)
    .bind(&spec.name)
    .bind(spec.algorithm.name())
    .bind(spec_json)
    .bind(if spec.algorithm == Algorithm::Eval { 1 } else { spec.max_num_steps as i64 })
    .execute(&mut *db)
    .await?;
    append_event(db, id, &RunEvent::Status { status: RunStatus::Queued, reason: None }).await?;
    get_run(db, id).await?.ok_or(sqlx::Error::RowNotFound)
}

pub async fn get_run(db: &mut PgConnection, id: Uuid) -> sqlx::Result<Option<Run>> {
    let row = sqlx::query(concat!("SELECT ", run_columns!(), " FROM runs WHERE id = $1"))
        .bind(id)
        .fetch_optional(&mut *db)
        .await?;
    match row {
        Some(row) => Ok(Some(with_latest_metrics(db, run_from_row(&row)?).await?)),
        None => Ok(None),
    }
}

/// Newest first; `after` is the last run of the previous page.
pub async fn list_runs(
    db: &mut PgConnection,
    status: Option<RunStatus>,
    limit: i64,
    after: Option<Uuid>,
) -> sqlx::Result<Vec<Run>> {
    let rows = sqlx::query(concat!(
        "SELECT ",
        run_columns!(),
        " FROM runs WHERE ($1::text IS NULL OR status = $1) AND ($2::uuid IS NULL OR (created_at, id) < ",
        "(SELECT created_at, id FROM runs WHERE id = $2)) ORDER BY created_at DESC, id DESC LIMIT $3"
    ))
    .bind(status.map(RunStatus::name))
    .bind(after)
    .bind(limit)
    .fetch_all(&mut *db)
    .await?;
    let mut runs = rows.iter().map(run_from_row).collect::<sqlx::Result<Vec<Run>>>()?;
    let ids: Vec<Uuid> = runs.iter().map(|r| r.id).collect();
    let latest = sqlx::query(
        "SELECT DISTINCT ON (run_id, name) run_id, name, value FROM metrics WHERE run_id = ANY($1) \
         ORDER BY run_id, name, step DESC",
    )
    .bind(&ids)
    .fetch_all(&mut *db)
    .await?;
    for row in latest {
        let run_id: Uuid = row.try_get("run_id")?;
        if let Some(run) = runs.iter_mut().find(|r| r.id == run_id) {
            run.latest_metrics.insert(row.try_get("name")?, row.try_get("value")?);
        }
    }
    Ok(runs)
}

pub async fn append_event(db: &mut PgConnection, run_id: Uuid, event: &RunEvent) -> sqlx::Result<()> {
    let body = serde_json::to_value(event).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    sqlx::query("INSERT INTO run_events (run_id, event) VALUES ($1, $2)").bind(run_id).bind(body).execute(db).await?;
    Ok(())
}

/// The step and id of the last checkpoint run `run_id` recorded saving, if it saved any.
pub async fn last_saved_checkpoint(db: &mut PgConnection, run_id: Uuid) -> sqlx::Result<Option<(i64, String)>> {
    sqlx::query_as(
        "SELECT (event->>'step')::bigint, event->>'checkpoint_id' FROM run_events \
         WHERE run_id = $1 AND event->>'kind' = 'checkpoint' ORDER BY seq DESC LIMIT 1",
    )
    .bind(run_id)
    .fetch_optional(db)
    .await
}

pub async fn events_after(db: &mut PgConnection, run_id: Uuid, after: i64) -> sqlx::Result<Vec<RunEventRecord>> {
    let rows = sqlx::query(concat!(
        "SELECT seq, ",
        utc!("at"),
        " AS at, event FROM run_events WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT 1000"
    ))
    .bind(run_id)
    .bind(after)
    .fetch_all(db)
    .await?;
    rows.iter()
        .map(|row| {
            let event: serde_json::Value = row.try_get("event")?;
            Ok(RunEventRecord {
                seq: row.try_get("seq")?,
                at: row.try_get("at")?,
                event: serde_json::from_value(event).map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
            })
        })
        .collect()
}

/// Asks a run to stop. A queued run is cancelled at once; a running one is stopped by its
/// driver, which checks between phases. Returns false when the run is already final.
pub async fn request_cancel(db: &mut PgConnection, run_id: Uuid) -> sqlx::Result<bool> {
    let queued = sqlx::query(
        "UPDATE runs SET status = 'cancelled', reason = 'cancelled by request', cancel_requested = true, \
         updated_at = now() WHERE id = $1 AND status = 'queued'",
    )
    .bind(run_id)
    .execute(&mut *db)
    .await?;
    if queued.rows_affected() == 1 {
        let event = RunEvent::Status { status: RunStatus::Cancelled, reason: Some("cancelled by request".into()) };
        append_event(db, run_id, &event).await?;
        return Ok(true);
    }
    let running = sqlx::query(concat!(
        "UPDATE runs SET cancel_requested = true, updated_at = now() WHERE id = $1 AND ",
        active!()
    ))
    .bind(run_id)
    .execute(db)
    .await?;
    Ok(running.rows_affected() == 1)
}

/// The oldest run waiting to start, or a running (or waiting) one whose owner stopped
/// renewing its lease, locked for this transaction (other instances skip it); with the
/// times it was started. Runs in `skip` (those that cannot start now) are passed over.
pub async fn next_claimable(
    db: &mut PgConnection,
    lease_seconds: f64,
    skip: &[Uuid],
) -> sqlx::Result<Option<(Run, i32)>> {
    let row = sqlx::query(concat!(
        "SELECT ",
        run_columns!(),
        ", attempts FROM runs WHERE (status = 'queued' OR (",
        active!(),
        " AND ",
        "heartbeat_at < now() - make_interval(secs => $1))) AND NOT (id = ANY($2)) ",
        "ORDER BY created_at FOR UPDATE SKIP LOCKED LIMIT 1"
    ))
    .bind(lease_seconds)
    .bind(skip)
    .fetch_optional(&mut *db)
    .await?;
    match row {
        Some(row) => Ok(Some((run_from_row(&row)?, row.try_get("attempts")?))),
        None => Ok(None),
    }
}

/// Marks a claimed run running under `owner`.
pub async fn start_run(db: &mut PgConnection, run_id: Uuid, owner: Uuid, resumed: bool) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE runs SET status = 'running', reason = NULL, owner = $2, heartbeat_at = now(), \
         attempts = attempts + 1, updated_at = now() WHERE id = $1",
    )
    .bind(run_id)
    .bind(owner)
    .execute(&mut *db)
    .await?;
    let reason = resumed.then(|| "resumed after its orchestrator stopped".to_string());
    append_event(db, run_id, &RunEvent::Status { status: RunStatus::Running, reason }).await
}

/// What a heartbeat learns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lease {
    Held { cancel_requested: bool },
    Lost,
}

/// Renews the run's lease if `owner` still holds it.
pub async fn heartbeat(db: &mut PgConnection, run_id: Uuid, owner: Uuid) -> sqlx::Result<Lease> {
    let row = sqlx::query(concat!(
        "UPDATE runs SET heartbeat_at = now() WHERE id = $1 AND owner = $2 AND ",
        active!(),
        " RETURNING cancel_requested"
    ))
    .bind(run_id)
    .bind(owner)
    .fetch_optional(db)
    .await?;
    Ok(match row {
        Some(row) => Lease::Held { cancel_requested: row.try_get("cancel_requested")? },
        None => Lease::Lost,
    })
}

/// Ends a run (when `owner` still holds it). Returns false when it did not.
pub async fn finish_run(
    db: &mut PgConnection,
    run_id: Uuid,
    owner: Uuid,
    status: RunStatus,
    reason: Option<&str>,
) -> sqlx::Result<bool> {
    let done = sqlx::query(concat!(
        "UPDATE runs SET status = $3, reason = $4, owner = NULL, updated_at = now() WHERE id = $1 AND owner = $2 AND ",
        active!()
    ))
    .bind(run_id)
    .bind(owner)
    .bind(status.name())
    .bind(reason)
    .execute(&mut *db)
    .await?;
    if done.rows_affected() == 0 {
        return Ok(false);
    }
    append_event(db, run_id, &RunEvent::Status { status, reason: reason.map(str::to_string) }).await?;
    Ok(true)
}

/// Shows the run `waiting` for `reason`, or `running` again (`None`), if `owner` still holds
/// it and it is not that already. Returns false when the owner lost the run.
pub async fn set_waiting(db: &mut PgConnection, run_id: Uuid, owner: Uuid, reason: Option<&str>) -> sqlx::Result<bool> {
    let status = if reason.is_some() { RunStatus::Waiting } else { RunStatus::Running };
    let changed = sqlx::query(concat!(
        "UPDATE runs SET status = $3, reason = $4, updated_at = now() WHERE id = $1 AND owner = $2 AND status <> $3 AND ",
        active!()
    ))
    .bind(run_id)
    .bind(owner)
    .bind(status.name())
    .bind(reason)
    .execute(&mut *db)
    .await?;
    if changed.rows_affected() == 1 {
        let reason = reason.map(str::to_string).or_else(|| Some("what it waited for is back".into()));
        append_event(db, run_id, &RunEvent::Status { status, reason }).await?;
        return Ok(true);
    }
    let owned = sqlx::query(concat!("SELECT 1 FROM runs WHERE id = $1 AND owner = $2 AND ", active!()))
        .bind(run_id)
        .bind(owner)
        .fetch_optional(db)
        .await?;
    Ok(owned.is_some())
}

/// The steps the run will take, once its data is known (the spec's `max_num_steps` may be
/// more than its epochs hold).
pub async fn set_total_steps(db: &mut PgConnection, run_id: Uuid, total: u64) -> sqlx::Result<()> {
    sqlx::query("UPDATE runs SET total_steps = $2 WHERE id = $1").bind(run_id).bind(total as i64).execute(db).await?;
    Ok(())
}

/// Ends a run nobody holds (its driver vanished too often) as `failed`.
pub async fn abandon(db: &mut PgConnection, run_id: Uuid, reason: &str) -> sqlx::Result<()> {
    sqlx::query("UPDATE runs SET status = 'failed', reason = $2, owner = NULL, updated_at = now() WHERE id = $1")
        .bind(run_id)
        .bind(reason)
        .execute(&mut *db)
        .await?;
    append_event(db, run_id, &RunEvent::Status { status: RunStatus::Failed, reason: Some(reason.to_string()) }).await
}

/// Puts a claimed run back in the queue (no trainer was free).
pub async fn requeue(db: &mut PgConnection, run_id: Uuid) -> sqlx::Result<()> {
    sqlx::query("UPDATE runs SET status = 'queued', owner = NULL, updated_at = now() WHERE id = $1")
        .bind(run_id)
        .execute(db)
        .await?;
    Ok(())
}

/// Forgets everything recorded after `step` (the step a resumed run restarts from), so the
/// steps it does again are recorded once.
pub async fn rewind(db: &mut PgConnection, run_id: Uuid, owner: Uuid, step: u64) -> sqlx::Result<bool> {
    let owned = sqlx::query("UPDATE runs SET step = $3, updated_at = now() WHERE id = $1 AND owner = $2")
        .bind(run_id)
        .bind(owner)
        .bind(step as i64)
        .execute(&mut *db)
        .await?;
    if owned.rows_affected() == 0 {
        return Ok(false);
    }
    sqlx::query("DELETE FROM metrics WHERE run_id = $1 AND step > $2")
        .bind(run_id)
        .bind(step as i64)
        .execute(&mut *db)
        .await?;
    sqlx::query("DELETE FROM samples WHERE run_id = $1 AND step > $2")
        .bind(run_id)
        .bind(step as i64)
        .execute(&mut *db)
        .await?;
    Ok(true)
}

/// A finished step, recorded at once.
#[derive(Debug, Clone, Default)]
pub struct StepRecord {
    pub step: u64,
    pub metrics: BTreeMap<String, f64>,
    pub samples: Vec<Sample>,
    pub dataloader: serde_json::Value,
}

/// Records a step if `owner` still holds the run and the step follows the last one.
pub async fn record_step(db: &mut PgConnection, run_id: Uuid, owner: Uuid, record: &StepRecord) -> sqlx::Result<bool> {
    let advanced = sqlx::query(concat!(
        "UPDATE runs SET step = $3, heartbeat_at = now(), updated_at = now() WHERE id = $1 AND owner = $2 AND step = $3 - 1 AND ",
        active!()
    ))
    .bind(run_id)
    .bind(owner)
    .bind(record.step as i64)
    .execute(&mut *db)
    .await?;
    if advanced.rows_affected() == 0 {
        return Ok(false);
    }
    insert_metrics(db, run_id, record.step, &record.metrics).await?;
    insert_samples(db, run_id, &record.samples).await?;
    sqlx::query(
        "INSERT INTO dataloader_state (run_id, step, state) VALUES ($1, $2, $3) \
         ON CONFLICT (run_id) DO UPDATE SET step = EXCLUDED.step, state = EXCLUDED.state",
    )
    .bind(run_id)
    .bind(record.step as i64)
    .bind(&record.dataloader)
    .execute(&mut *db)
    .await?;
    append_event(db, run_id, &RunEvent::Step { step: record.step, metrics: record.metrics.clone() }).await?;
    Ok(true)
}

/// Metrics of a step already recorded (validation at the end of a run).
pub async fn insert_metrics(
    db: &mut PgConnection,
    run_id: Uuid,
    step: u64,
    metrics: &BTreeMap<String, f64>,
) -> sqlx::Result<()> {
    for (name, value) in metrics.iter().filter(|(_, v)| v.is_finite()) {
        sqlx::query(
            "INSERT INTO metrics (run_id, name, step, value) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (run_id, name, step) DO UPDATE SET value = EXCLUDED.value",
        )
        .bind(run_id)
        .bind(name)
        .bind(step as i64)
        .bind(value)
        .execute(&mut *db)
        .await?;
    }
    Ok(())
}

/// Text as Postgres stores it: a model may well generate a NUL byte, which `text` refuses.
fn storable(text: &str) -> String {
    text.replace('\0', "\u{FFFD}")
}

/// The most of a sample's `info` kept, serialised; a larger one is replaced by a note of its size.
const MAX_INFO_BYTES: usize = 64 * 1024;

/// JSON as Postgres's `jsonb` stores it: NUL characters in strings replaced, and an `info`
/// larger than [`MAX_INFO_BYTES`] replaced by `{"omitted_bytes": n}`.
fn storable_json(value: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    fn clean(value: &Value) -> Value {
        match value {
            Value::String(s) => Value::String(storable(s)),
            Value::Array(items) => Value::Array(items.iter().map(clean).collect()),
            Value::Object(fields) => Value::Object(fields.iter().map(|(k, v)| (storable(k), clean(v))).collect()),
            other => other.clone(),
        }
    }
    let size = serde_json::to_vec(value).map_or(0, |bytes| bytes.len());
    if size > MAX_INFO_BYTES { serde_json::json!({ "omitted_bytes": size }) } else { clean(value) }
}

pub async fn insert_samples(db: &mut PgConnection, run_id: Uuid, samples: &[Sample]) -> sqlx::Result<()> {
    for (i, s) in samples.iter().enumerate() {
        let turns: Vec<_> = s
            .turns
            .iter()
            .map(|m| keel_protocol::reward::Message::new(&storable(&m.role), storable(&m.content)))
            .collect();
        let count = |n: Option<u64>| n.map(|n| n.min(i64::MAX as u64) as i64);
        sqlx::query(
            "INSERT INTO samples (run_id, step, split, idx, prompt, completion, reward, ground_truth, finish_reason, \
             rewards, info, turns, num_prompt_tokens, num_generated_tokens, num_tokens, truncated, error, dropped) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18) \
             ON CONFLICT DO NOTHING",
        )
        .bind(run_id)
        .bind(s.step as i64)
        .bind(&s.split)
        .bind(i as i32)
        .bind(storable(&s.prompt))
        .bind(storable(&s.completion))
        .bind(s.reward)
        .bind(s.ground_truth.as_deref().map(storable))
        .bind(&s.finish_reason)
        .bind(Json(&s.rewards))
        .bind((!s.info.is_null()).then(|| Json(storable_json(&s.info))))
        .bind(Json(&turns))
        .bind(count(s.num_prompt_tokens))
        .bind(count(s.num_generated_tokens))
        .bind(count(s.num_tokens))
        .bind(s.truncated)
        .bind(s.error.as_deref().map(storable))
        .bind(s.dropped)
        .execute(&mut *db)
        .await?;
    }
    Ok(())
}

/// Metric series, filtered by name and step range.
pub async fn metrics(
    db: &mut PgConnection,
    run_id: Uuid,
    names: Option<&[String]>,
    from_step: u64,
    to_step: u64,
) -> sqlx::Result<Vec<MetricSeries>> {
    let rows = sqlx::query(
        "SELECT name, step, value FROM metrics WHERE run_id = $1 AND ($2::text[] IS NULL OR name = ANY($2)) \
         AND step BETWEEN $3 AND $4 ORDER BY name, step",
    )
    .bind(run_id)
    .bind(names)
    .bind(from_step as i64)
    .bind(to_step.min(i64::MAX as u64) as i64)
    .fetch_all(db)
    .await?;
    let mut series: Vec<MetricSeries> = Vec::new();
    for row in rows {
        let name: String = row.try_get("name")?;
        let point = (row.try_get::<i64, _>("step")? as u64, row.try_get("value")?);
        match series.last_mut() {
            Some(last) if last.name == name => last.points.push(point),
            _ => series.push(MetricSeries { name, points: vec![point] }),
        }
    }
    Ok(series)
}

pub async fn samples(
    db: &mut PgConnection,
    run_id: Uuid,
    step: Option<u64>,
    split: Option<&str>,
    limit: i64,
) -> sqlx::Result<Vec<Sample>> {
    let rows = sqlx::query(
        "SELECT step, split, prompt, completion, reward, ground_truth, finish_reason, rewards, info, turns, \
         num_prompt_tokens, num_generated_tokens, num_tokens, truncated, error, dropped FROM samples \
         WHERE run_id = $1 AND ($2::bigint IS NULL OR step = $2) AND ($3::text IS NULL OR split = $3) \
         ORDER BY step DESC, split, idx LIMIT $4",
    )
    .bind(run_id)
    .bind(step.map(|s| s as i64))
    .bind(split)
    .bind(limit)
    .fetch_all(db)
    .await?;
    let count = |n: Option<i64>| n.map(|n| n.max(0) as u64);
    rows.iter()
        .map(|row| {
            Ok(Sample {
                step: row.try_get::<i64, _>("step")? as u64,
                split: row.try_get("split")?,
                prompt: row.try_get("prompt")?,
                completion: row.try_get("completion")?,
                reward: row.try_get("reward")?,
                ground_truth: row.try_get("ground_truth")?,
                finish_reason: row.try_get("finish_reason")?,
                rewards: row.try_get::<Json<BTreeMap<String, f64>>, _>("rewards")?.0,
                info: row.try_get::<Option<serde_json::Value>, _>("info")?.unwrap_or_default(),
                turns: row.try_get::<Json<Vec<keel_protocol::reward::Message>>, _>("turns")?.0,
                num_prompt_tokens: count(row.try_get("num_prompt_tokens")?),
                num_generated_tokens: count(row.try_get("num_generated_tokens")?),
                num_tokens: count(row.try_get("num_tokens")?),
                truncated: row.try_get("truncated")?,
                error: row.try_get("error")?,
                dropped: row.try_get("dropped")?,
            })
        })
        .collect()
}

/// How many runs are in each status.
pub async fn count_by_status(db: &mut PgConnection) -> sqlx::Result<Vec<(String, i64)>> {
    sqlx::query_as("SELECT status, count(*) FROM runs GROUP BY status ORDER BY status").fetch_all(db).await
}

/// The trainer worker the run held last, if any.
pub async fn trainer_worker(conn: &mut PgConnection, run_id: Uuid) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar("SELECT trainer_worker FROM runs WHERE id = $1").bind(run_id).fetch_one(conn).await
}

/// Remembers the trainer worker the run holds now (none for runs without training).
pub async fn set_trainer_worker(conn: &mut PgConnection, run_id: Uuid, worker: Option<&str>) -> sqlx::Result<()> {
    sqlx::query("UPDATE runs SET trainer_worker = $2 WHERE id = $1").bind(run_id).bind(worker).execute(conn).await?;
    Ok(())
}

/// The generators the run held when it was last started.
pub async fn generators(conn: &mut PgConnection, run_id: Uuid) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar("SELECT generators FROM runs WHERE id = $1").bind(run_id).fetch_one(conn).await
}

/// Remembers the generators the run holds now.
pub async fn set_generators(conn: &mut PgConnection, run_id: Uuid, generators: &[String]) -> sqlx::Result<()> {
    sqlx::query("UPDATE runs SET generators = $2 WHERE id = $1").bind(run_id).bind(generators).execute(conn).await?;
    Ok(())
}

/// How many times the run has been started, while `owner` holds it.
pub async fn attempts(conn: &mut PgConnection, run_id: Uuid, owner: Uuid) -> sqlx::Result<Option<i32>> {
    sqlx::query_scalar("SELECT attempts FROM runs WHERE id = $1 AND owner = $2")
        .bind(run_id)
        .bind(owner)
        .fetch_optional(conn)
        .await
}

/// Hands the live runs of `owners` over to whichever orchestrator claims them next, at once
/// (their heartbeat made stale) and without counting this start against them: the
/// orchestrator is stopping, the runs did not fail.
pub async fn hand_over(conn: &mut PgConnection, owners: &[Uuid]) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE runs SET heartbeat_at = now() - interval '1 day', attempts = greatest(attempts - 1, 0) \
         WHERE owner = ANY($1) AND status IN ('running', 'waiting')",
    )
    .bind(owners)
    .execute(conn)
    .await?;
    Ok(())
}
