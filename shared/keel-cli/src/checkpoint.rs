//! `keel checkpoint`: list a run's checkpoints, upload a directory as a checkpoint, download
//! one as an HF directory (every file verified against its sha256, the directory appearing
//! only when complete), or export it as a tar file or (`--merged`) as a model directory with
//! a LoRA checkpoint's adapters merged into their base. Talks to the checkpoint service's REST
//! API (`--url`, default `KEEL_CHECKPOINT_URL` or http://127.0.0.1:8083).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use keel_client::checkpoint::{CheckpointClient, NewCheckpoint};
use keel_protocol::checkpoint::Checkpoint;
use uuid::Uuid;

#[derive(Debug, Subcommand)]
pub enum CheckpointCommand {
    /// A run's complete checkpoints, one line each: id, step, size, age and metrics.
    List {
        #[command(flatten)]
        service: Service,
        /// The run's id.
        #[arg(long)]
        run: String,
        /// Show this metric (repeatable; default: every metric the checkpoint has).
        #[arg(long = "metric")]
        metrics: Vec<String>,
    },
    /// Uploads a directory (an HF model directory, a trainer checkpoint) as a checkpoint.
    Upload(UploadArgs),
    /// Downloads a checkpoint as a directory, every file verified.
    Download {
        #[command(flatten)]
        service: Service,
        /// The checkpoint's id (from `keel checkpoint list` or `keel run show`).
        id: Uuid,
        /// The directory to create (it appears only when complete).
        #[arg(long)]
        out: PathBuf,
    },
    /// Writes a checkpoint as one tar file, or with `--merged` as a Hugging Face model
    /// directory (a LoRA checkpoint's adapters merged into their base).
    Export {
        #[command(flatten)]
        service: Service,
        /// The checkpoint's id (from `keel checkpoint list` or `keel run show`).
        id: Uuid,
        /// The tar file to write (with `--merged`: the model directory to create).
        #[arg(long)]
        out: PathBuf,
        /// Write a model directory that transformers and vLLM load: a LoRA checkpoint's
        /// adapters merged into their base model (saved in the base's dtype), or a whole
        /// checkpoint's weights without the trainer's state.
        #[arg(long)]
        merged: bool,
        /// With `--merged`: the base model's directory, when it is not where the
        /// checkpoint's `adapter_config.json` says (a checkpoint made on another machine).
        #[arg(long, requires = "merged")]
        base: Option<PathBuf>,
    },
}

#[derive(Debug, Args)]
pub struct Service {
    /// The checkpoint service (default: the local stack's, from `.keel/stack.env`, else
    /// http://127.0.0.1:8083).
    #[arg(long, env = "KEEL_CHECKPOINT_URL")]
    url: Option<String>,
    /// The store's API token, when it has one (default: the local stack's).
    #[arg(long, env = "KEEL_CHECKPOINT_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

impl Service {
    fn client(&self) -> CheckpointClient {
        let (url, token) =
            crate::stack::endpoint(self.url.clone(), self.token.clone(), "KEEL_CHECKPOINT", "http://127.0.0.1:8083");
        CheckpointClient::new(&url).with_token(token.as_deref())
    }
}

#[derive(Debug, Args)]
pub struct UploadArgs {
    #[command(flatten)]
    service: Service,
    /// The directory to upload.
    dir: PathBuf,
    /// The run it belongs to.
    #[arg(long)]
    run: String,
    /// The step it was saved at.
    #[arg(long)]
    step: u64,
    /// A metric, `name=value` (repeatable).
    #[arg(long = "metric")]
    metrics: Vec<String>,
}

pub fn run(command: CheckpointCommand) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        match command {
            CheckpointCommand::List { service, run, metrics } => {
                let mut out = std::io::stdout().lock();
                for c in service.client().list(&run).await? {
                    writeln!(out, "{}", line(&c, &metrics))?;
                }
            }
            CheckpointCommand::Upload(args) => {
                let mut metrics = BTreeMap::new();
                for m in &args.metrics {
                    let (name, value) =
                        m.split_once('=').with_context(|| format!("--metric `{m}`: expected name=value"))?;
                    metrics.insert(name.to_string(), value.parse::<f64>().with_context(|| format!("--metric `{m}`"))?);
                }
                let new = NewCheckpoint { run_id: args.run, step: args.step, metrics, ..NewCheckpoint::default() };
                let committed = args.service.client().upload_dir(&args.dir, new).await?;
                writeln!(std::io::stdout(), "{}", committed.id)?;
            }
            CheckpointCommand::Download { service, id, out } => {
                service.client().download_dir(id, &out).await?;
                writeln!(std::io::stdout(), "{}", out.display())?;
            }
            CheckpointCommand::Export { service, id, out, merged: false, .. } => {
                service.client().export_tar(id, &out).await?;
                writeln!(std::io::stdout(), "{}", out.display())?;
            }
            CheckpointCommand::Export { service, id, out, merged: true, base } => {
                anyhow::ensure!(!out.exists(), "{} already exists", out.display());
                let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
                let download = parent.join(format!(".checkpoint-{id}.{}", Uuid::new_v4().simple()));
                service.client().download_dir(id, &download).await?;
                let (from, to) = (download.clone(), out.clone());
                let written = tokio::task::spawn_blocking(move || merge(&from, base.as_deref(), &to)).await;
                let _ = std::fs::remove_dir_all(&download);
                written??;
                writeln!(std::io::stdout(), "{}", out.display())?;
            }
        }
        Ok(())
    })
}

/// Writes the model the checkpoint directory `dir` stands for at `out` (see
/// `keel_model::lora::export_merged`).
#[cfg(feature = "engines")]
fn merge(dir: &std::path::Path, base: Option<&std::path::Path>, out: &std::path::Path) -> anyhow::Result<()> {
    keel_model::lora::export_merged(dir, base, out)
        .with_context(|| format!("writing the merged model to {}", out.display()))
}

#[cfg(not(feature = "engines"))]
fn merge(_: &std::path::Path, _: Option<&std::path::Path>, _: &std::path::Path) -> anyhow::Result<()> {
    anyhow::bail!("--merged loads the model: this keel was built without the `engines` feature")
}

/// One checkpoint in a line: id, step, size, and `metrics` (all of them when empty; one
/// it does not have shows as `-`).
pub fn line(c: &Checkpoint, metrics: &[String]) -> String {
    let bytes: u64 = c.files.iter().map(|f| f.size).sum();
    let shown: Vec<String> = if metrics.is_empty() {
        c.metrics.iter().map(|(name, value)| format!("{name}={value:.4}")).collect()
    } else {
        metrics
            .iter()
            .map(|name| match c.metrics.get(name) {
                Some(value) => format!("{name}={value:.4}"),
                None => format!("{name}=-"),
            })
            .collect()
    };
    format!("{}  step {:>6}  {:>10}  {}", c.id, c.step, size(bytes), shown.join("  ")).trim_end().to_string()
}

/// Bytes in the largest unit that keeps a number of at least 1 (`12.3 MiB`).
fn size(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes} B") } else { format!("{value:.1} {}", units[unit]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_line_is_short_and_shows_the_chosen_metrics() {
        let c: Checkpoint = serde_json::from_value(serde_json::json!({
            "id": "00000000-0000-0000-0000-000000000002", "run_id": "r", "step": 20, "status": "complete",
            "metrics": {"validation/accuracy": 0.4375, "train/loss": 0.25}, "info": {},
            "files": [{"path": "model.safetensors", "size": 3_145_728, "sha256": "00"}],
            "missing": [], "created_at": 0.0,
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        let all = line(&c, &[]);
        assert_eq!(
            all,
            "00000000-0000-0000-0000-000000000002  step     20     3.0 MiB  train/loss=0.2500  validation/accuracy=0.4375"
        );
        let chosen = line(&c, &["validation/accuracy".into(), "validation/pass@1".into()]);
        assert!(chosen.ends_with("3.0 MiB  validation/accuracy=0.4375  validation/pass@1=-"), "{chosen}");
        assert_eq!(size(512), "512 B");
    }
}
