//! `keel checkpoint`: list a run's checkpoints, upload a directory as a checkpoint, download
//! one as an HF directory (every file verified against its sha256, the directory appearing
//! only when complete), or export it as a tar file. Talks to the checkpoint service's REST
//! API (`--url`, default `KEEL_CHECKPOINT_URL` or http://127.0.0.1:8083).

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use keel_client::checkpoint::{CheckpointClient, NewCheckpoint};
use uuid::Uuid;

#[derive(Debug, Subcommand)]
pub enum CheckpointCommand {
    /// A run's complete checkpoints.
    List {
        #[command(flatten)]
        service: Service,
        #[arg(long)]
        run: String,
    },
    /// Uploads a directory (an HF model directory, a trainer checkpoint) as a checkpoint.
    Upload(UploadArgs),
    /// Downloads a checkpoint as a directory, every file verified.
    Download {
        #[command(flatten)]
        service: Service,
        id: Uuid,
        #[arg(long)]
        out: PathBuf,
    },
    /// Writes a checkpoint as one tar file.
    Export {
        #[command(flatten)]
        service: Service,
        id: Uuid,
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Debug, Args)]
pub struct Service {
    /// The checkpoint service.
    #[arg(long, env = "KEEL_CHECKPOINT_URL", default_value = "http://127.0.0.1:8083")]
    url: String,
    /// The store's API token, when it has one.
    #[arg(long, env = "KEEL_CHECKPOINT_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

impl Service {
    fn client(&self) -> CheckpointClient {
        CheckpointClient::new(&self.url).with_token(self.token.as_deref())
    }
}

#[derive(Debug, Args)]
pub struct UploadArgs {
    #[command(flatten)]
    service: Service,
    dir: PathBuf,
    #[arg(long)]
    run: String,
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
            CheckpointCommand::List { service, run } => {
                for c in service.client().list(&run).await? {
                    let size: u64 = c.files.iter().map(|f| f.size).sum();
                    println!(
                        "{}  step {:>6}  {:>12} bytes  {}",
                        c.id,
                        c.step,
                        size,
                        serde_json::to_string(&c.metrics)?
                    );
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
                println!("{}", committed.id);
            }
            CheckpointCommand::Download { service, id, out } => {
                service.client().download_dir(id, &out).await?;
                println!("{}", out.display());
            }
            CheckpointCommand::Export { service, id, out } => {
                service.client().export_tar(id, &out).await?;
                println!("{}", out.display());
            }
        }
        Ok(())
    })
}
