//! `keel run`: submit a run spec to the orchestrator, list and show runs, watch one with a
//! progress bar and its key metrics, cancel it, print its samples. Talks to the
//! orchestrator's REST API (`--url`, default `KEEL_API_URL` or http://127.0.0.1:8080; a
//! bearer token from `--token` or `KEEL_API_TOKEN`).
//!
//! Output goes through [`crate::out`]: a reader that closes the pipe (`| head`) ends the
//! command quietly. `watch` redraws one line on a terminal and prints a line per change
//! otherwise.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use anyhow::bail;
use clap::{Args, Subcommand};
use keel_client::runs::RunsClient;
use keel_protocol::checkpoint::Checkpoint;
use keel_protocol::run::{Run, RunStatus};
use uuid::Uuid;

#[derive(Debug, Args)]
pub struct Api {
    /// The orchestrator (default: the local stack's, from `.keel/stack.env`, else
    /// http://127.0.0.1:8080).
    #[arg(long, env = "KEEL_API_URL", global = true)]
    url: Option<String>,
    /// The orchestrator's API token, when it has one (default: the local stack's).
    #[arg(long, env = "KEEL_API_TOKEN", global = true, hide_env_values = true)]
    token: Option<String>,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    api: Api,
    #[command(subcommand)]
    command: RunCommand,
}

/// A spec file and the overrides applied to it ([`crate::spec`]).
#[derive(Debug, Args)]
pub struct SpecFile {
    /// The spec: JSON when the file ends in `.json`, else YAML.
    file: PathBuf,
    /// Sets one field, after `${VAR}`s are filled in: a dot-separated path (a number indexes
    /// a list) and a YAML value, e.g. `--set training.optimizer.lr=1e-5`. Repeatable.
    #[arg(long = "set", value_name = "PATH=VALUE")]
    sets: Vec<String>,
    /// Send `data.*.path` as written instead of uploading the local files it names (for
    /// paths on the orchestrator's own disk).
    #[arg(long)]
    no_upload: bool,
}

impl SpecFile {
    /// The spec as JSON text for the API: expanded, overridden, and each dataset file it
    /// names here uploaded to the orchestrator and named by the path it answered
    /// ([`crate::spec::local_datasets`]).
    async fn for_api(&self, client: &RunsClient) -> anyhow::Result<String> {
        let mut spec = crate::spec::load_value(&self.file, &self.sets)?;
        if !self.no_upload {
            let base = self.file.parent().unwrap_or(std::path::Path::new("."));
            for (pointer, local, kind) in crate::spec::local_datasets(&spec, base) {
                let uploaded = client.upload_dataset(&local, &kind).await?;
                eprintln!("uploaded {} ({} bytes) as {}", local.display(), uploaded.bytes, uploaded.path);
                if let Some(path) = spec.pointer_mut(&pointer) {
                    *path = serde_json::Value::String(uploaded.path);
                }
            }
        }
        Ok(serde_json::to_string(&spec)?)
    }
}

#[derive(Debug, Subcommand)]
pub enum RunCommand {
    /// Submits a run spec (YAML or JSON) and prints the run's id. `${VAR}` in the spec's
    /// values is filled in from the environment (`${VAR:-default}` when unset; an unset
    /// variable without a default is an error).
    Submit {
        #[command(flatten)]
        spec: SpecFile,
        /// Watch the run until it ends.
        #[arg(long)]
        watch: bool,
    },
    /// Checks a run spec as `submit` would (the API's dry run: every problem listed, nothing
    /// created) and prints it as it would run, every default filled in.
    Validate {
        #[command(flatten)]
        spec: SpecFile,
    },
    /// Runs, newest first, one line each under a header.
    List {
        /// Only runs in this status (queued, running, waiting, succeeded, failed, cancelled).
        #[arg(long)]
        status: Option<String>,
        /// How many runs at most.
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
    /// A run's summary: status, progress, timing, latest metrics and checkpoints.
    Show {
        /// The run's id.
        id: Uuid,
        /// The run's whole document as JSON instead (spec and every latest metric).
        #[arg(long)]
        json: bool,
    },
    /// Follows a run until it ends: progress, elapsed time, steps/s, ETA and the key
    /// metrics. Exits non-zero when the run fails or is cancelled.
    Watch {
        /// The run's id.
        id: Uuid,
    },
    /// Asks the orchestrator to cancel a run; prints its status.
    Cancel {
        /// The run's id.
        id: Uuid,
    },
    /// Recorded prompts, completions and rewards.
    Samples {
        /// The run's id.
        id: Uuid,
        /// Only the samples of this step.
        #[arg(long)]
        step: Option<u64>,
        /// How many samples at most.
        #[arg(long, default_value_t = 10)]
        limit: usize,
    },
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let (url, token) = crate::stack::endpoint(args.api.url, args.api.token, "KEEL_API", "http://127.0.0.1:8080");
    let client = RunsClient::new(&url, token);
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let mut out = std::io::stdout().lock();
        match args.command {
            RunCommand::Submit { spec, watch: follow } => {
                let run = client.submit(spec.for_api(&client).await?).await?;
                writeln!(out, "{}", run.id)?;
                if follow {
                    watch(&client, run.id, &mut out).await?;
                }
            }
            RunCommand::Validate { spec } => {
                let resolved = client.validate(spec.for_api(&client).await?).await?;
                eprintln!("{}: valid", spec.file.display());
                write!(out, "{}", serde_yaml_ng::to_string(&resolved)?)?;
            }
            RunCommand::List { status, limit } => {
                writeln!(
                    out,
                    "{:<36}  {:<9}  {:<5}  {:>11}  {:<24}  NAME",
                    "ID", "STATUS", "ALGO", "STEP", "CREATED (UTC)"
                )?;
                for run in client.list(status.as_deref(), limit, None).await?.runs {
                    writeln!(
                        out,
                        "{}  {:<9}  {:<5}  {:>11}  {:<24}  {}",
                        run.id,
                        run.status.name(),
                        run.algorithm.name(),
                        format!("{}/{}", run.step, run.total_steps),
                        run.created_at,
                        run.name.as_deref().unwrap_or("")
                    )?;
                }
            }
            RunCommand::Show { id, json: true } => {
                writeln!(out, "{}", serde_json::to_string_pretty(&client.get(id).await?)?)?
            }
            RunCommand::Show { id, json: false } => {
                let run = client.get(id).await?;
                let checkpoints = client.checkpoints(id).await?;
                write!(out, "{}", summary(&run, &checkpoints, SystemTime::now()))?;
            }
            RunCommand::Watch { id } => watch(&client, id, &mut out).await?,
            RunCommand::Cancel { id } => writeln!(out, "{}", client.cancel(id).await?.status.name())?,
            RunCommand::Samples { id, step, limit } => {
                for s in client.samples(id, step, limit).await?.samples {
                    writeln!(out, "--- step {} ({}), reward {:.3}", s.step, s.split, s.reward)?;
                    writeln!(out, "prompt: {}", s.prompt.trim())?;
                    writeln!(out, "completion: {}", s.completion.trim())?;
                    if let Some(truth) = s.ground_truth {
                        writeln!(out, "ground truth: {truth}")?;
                    }
                }
            }
        }
        Ok(())
    })
}

/// `keel run show`: what a person wants to see of a run, one fact a line.
fn summary(run: &Run, checkpoints: &[Checkpoint], now: SystemTime) -> String {
    use std::fmt::Write as _;
    let mut text = String::new();
    let name = run.name.as_deref().map(|n| format!(" ({n})")).unwrap_or_default();
    let _ = writeln!(text, "run        {}{name}", run.id);
    let _ = writeln!(text, "algorithm  {}", run.algorithm.name());
    let reason = run.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default();
    let _ = writeln!(text, "status     {}{reason}", run.status.name());
    let _ = writeln!(text, "progress   {}", progress(run));
    let _ = writeln!(text, "created    {}", run.created_at);
    if let Some(seconds) = elapsed(run, now) {
        let _ = writeln!(text, "elapsed    {}", clock(seconds));
        if let Some((rate, left)) = pace(run, run.step, seconds) {
            let _ = writeln!(text, "eta        {} ({rate:.3} steps/s)", clock(left));
        }
    }
    if !run.latest_metrics.is_empty() {
        let _ = writeln!(text, "latest metrics");
        let width = run.latest_metrics.keys().map(String::len).max().unwrap_or(0);
        for (name, value) in &run.latest_metrics {
            let _ = writeln!(text, "  {name:<width$}  {value:.6}");
        }
    }
    let _ = writeln!(text, "checkpoints {}", checkpoints.len());
    for c in checkpoints {
        let _ = writeln!(text, "  {}", crate::checkpoint::line(c, &[]));
    }
    text
}

/// `step/total` with a bar.
fn progress(run: &Run) -> String {
    let width = 30;
    let done = (run.step * width).checked_div(run.total_steps).unwrap_or(0).min(width) as usize;
    format!("[{}{}] {}/{}", "#".repeat(done), ".".repeat(width as usize - done), run.step, run.total_steps)
}

/// Seconds from the run's creation to its last update (a run that ended) or to `now`.
fn elapsed(run: &Run, now: SystemTime) -> Option<f64> {
    let created = humantime::parse_rfc3339_weak(&run.created_at).ok()?;
    let end = if run.status.is_final() { humantime::parse_rfc3339_weak(&run.updated_at).ok()? } else { now };
    Some(end.duration_since(created).unwrap_or_default().as_secs_f64())
}

/// Steps per second (`steps` done in `seconds`) and the seconds the rest of a running run
/// takes at that rate; None before a step is done or once the run has ended.
fn pace(run: &Run, steps: u64, seconds: f64) -> Option<(f64, f64)> {
    if steps == 0 || seconds <= 0.0 || run.status.is_final() {
        return None;
    }
    let rate = steps as f64 / seconds;
    Some((rate, run.total_steps.saturating_sub(run.step) as f64 / rate))
}

/// `1h02m03s`, `4m05s`, `6s`.
fn clock(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, s) => format!("{h}h{m:02}m{s:02}s"),
    }
}

/// The metrics the progress line shows, with their labels.
const KEY_METRICS: [(&str, &str); 5] = [
    ("train/reward", "reward"),
    ("train/loss", "loss"),
    ("validation/accuracy", "val acc"),
    ("validation/reward_mean", "val reward"),
    ("train/accuracy", "acc"),
];

/// What `watch` shows of a run: progress, elapsed time, the rate seen since watching
/// began (`seen`: when and at which step), the ETA, and the key metrics.
fn progress_line(run: &Run, seen: (Instant, u64), now: SystemTime) -> String {
    let mut line = format!("{} {}", progress(run), run.status.name());
    if let Some(seconds) = elapsed(run, now) {
        line.push_str(&format!("  {}", clock(seconds)));
    }
    if let Some((rate, left)) = pace(run, run.step.saturating_sub(seen.1), seen.0.elapsed().as_secs_f64()) {
        line.push_str(&format!("  {rate:.3} steps/s  eta {}", clock(left)));
    }
    for (name, label) in KEY_METRICS {
        if let Some(value) = run.latest_metrics.get(name) {
            line.push_str(&format!("  {label} {value:.4}"));
        }
    }
    line
}

/// Follows the run every 2 s: on a terminal one line redrawn in place, else a line whenever
/// the step or status changes.
async fn watch(client: &RunsClient, id: Uuid, out: &mut impl Write) -> anyhow::Result<()> {
    let terminal = std::io::stdout().is_terminal();
    let mut last = None;
    let mut seen = None;
    loop {
        let run = client.get(id).await?;
        let since = *seen.get_or_insert((Instant::now(), run.step));
        let line = progress_line(&run, since, SystemTime::now());
        if terminal {
            write!(out, "\r{line}\x1b[K")?;
            out.flush()?;
        } else if last != Some((run.step, run.status)) {
            writeln!(out, "{line}")?;
            last = Some((run.step, run.status));
        }
        if run.status.is_final() {
            if terminal {
                writeln!(out)?;
            }
            return match run.status {
                RunStatus::Succeeded => Ok(()),
                status => bail!("run {id} {}: {}", status.name(), run.reason.unwrap_or_default()),
            };
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(status: RunStatus, step: u64) -> Run {
        serde_json::from_value(serde_json::json!({
            "id": "00000000-0000-0000-0000-000000000001", "name": "demo", "algorithm": "grpo",
            "status": status, "reason": null, "step": step, "total_steps": 10,
            "created_at": "2026-11-25T10:00:00.000Z", "updated_at": "2026-11-25T10:01:40.000Z",
            "latest_metrics": {"train/reward": 0.5, "train/loss": -0.01},
            "spec": {"algorithm": "grpo", "model": {"path": "/m"}, "data": {"train": {"kind": "arithmetic"}}},
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_summary_shows_progress_timing_metrics_and_checkpoints() {
        let now = humantime::parse_rfc3339("2026-11-25T10:02:00Z").unwrap_or_else(|e| panic!("{e}"));
        let running = summary(&run(RunStatus::Running, 4), &[], now);
        assert!(running.contains("status     running\n"), "{running}");
        assert!(running.contains("[############..................] 4/10"), "{running}");
        assert!(running.contains("elapsed    2m00s\n"), "{running}");
        // 4 steps in 120 s: 6 more take 180 s.
        assert!(running.contains("eta        3m00s (0.033 steps/s)"), "{running}");
        assert!(running.contains("  train/reward  0.500000\n"), "{running}");
        assert!(running.contains("checkpoints 0\n"), "{running}");
        // An ended run's time runs to its last update, and it has no ETA.
        let done = summary(&run(RunStatus::Succeeded, 10), &[], now);
        assert!(done.contains("elapsed    1m40s\n") && !done.contains("eta"), "{done}");
    }

    #[test]
    fn clocks_read_as_hours_minutes_and_seconds() {
        assert_eq!(clock(6.4), "6s");
        assert_eq!(clock(245.0), "4m05s");
        assert_eq!(clock(3723.0), "1h02m03s");
    }
}
