//! `keel run`: submit a run spec to the orchestrator, list and show runs, watch one with a
//! progress bar and its key metrics, cancel it, print its samples. Talks to the
//! orchestrator's REST API (`--url`, default `KEEL_API_URL` or http://127.0.0.1:8080; a
//! bearer token from `--token` or `KEEL_API_TOKEN`).

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use keel_client::runs::RunsClient;
use keel_protocol::run::{Run, RunStatus};
use uuid::Uuid;

#[derive(Debug, Args)]
pub struct Api {
    /// The orchestrator.
    #[arg(long, env = "KEEL_API_URL", default_value = "http://127.0.0.1:8080", global = true)]
    url: String,
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

#[derive(Debug, Subcommand)]
pub enum RunCommand {
    /// Submits a run spec (YAML or JSON) and prints the run's id.
    Submit {
        file: PathBuf,
        /// Watch the run until it ends.
        #[arg(long)]
        watch: bool,
    },
    /// Runs, newest first.
    List {
        #[arg(long)]
        status: Option<String>,
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
    /// A run's status and latest metrics, as JSON.
    Show {
        id: Uuid,
    },
    /// Follows a run until it ends: a progress bar and the key metrics. Exits non-zero when
    /// the run fails or is cancelled.
    Watch {
        id: Uuid,
    },
    Cancel {
        id: Uuid,
    },
    /// Recorded prompts, completions and rewards.
    Samples {
        id: Uuid,
        #[arg(long)]
        step: Option<u64>,
        #[arg(long, default_value_t = 10)]
        limit: usize,
    },
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let client = RunsClient::new(&args.api.url, args.api.token);
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        match args.command {
            RunCommand::Submit { file, watch: follow } => {
                let text = std::fs::read_to_string(&file).with_context(|| format!("cannot read {}", file.display()))?;
                let yaml = file.extension().is_none_or(|e| e != "json");
                let run = client.submit(text, yaml).await?;
                println!("{}", run.id);
                if follow {
                    watch(&client, run.id).await?;
                }
            }
            RunCommand::List { status, limit } => {
                for run in client.list(status.as_deref(), limit, None).await?.runs {
                    println!(
                        "{}  {:<9}  {:<5}  step {:>5}/{:<5}  {}  {}",
                        run.id,
                        run.status.name(),
                        run.algorithm.name(),
                        run.step,
                        run.total_steps,
                        run.created_at,
                        run.name.as_deref().unwrap_or("")
                    );
                }
            }
            RunCommand::Show { id } => println!("{}", serde_json::to_string_pretty(&client.get(id).await?)?),
            RunCommand::Watch { id } => watch(&client, id).await?,
            RunCommand::Cancel { id } => println!("{}", client.cancel(id).await?.status.name()),
            RunCommand::Samples { id, step, limit } => {
                for s in client.samples(id, step, limit).await?.samples {
                    println!("--- step {} ({}), reward {:.3}", s.step, s.split, s.reward);
                    println!("prompt: {}", s.prompt.trim());
                    println!("completion: {}", s.completion.trim());
                    if let Some(truth) = s.ground_truth {
                        println!("ground truth: {truth}");
                    }
                }
            }
        }
        Ok(())
    })
}

/// The metrics the progress line shows, with their labels.
const KEY_METRICS: [(&str, &str); 5] = [
    ("train/reward", "reward"),
    ("train/loss", "loss"),
    ("validation/accuracy", "val acc"),
    ("validation/reward_mean", "val reward"),
    ("train/accuracy", "acc"),
];

fn progress_line(run: &Run) -> String {
    let width = 30;
    let done = (run.step * width).checked_div(run.total_steps).unwrap_or(0).min(width) as usize;
    let bar = format!("{}{}", "#".repeat(done), ".".repeat(width as usize - done));
    let mut line = format!("[{bar}] {}/{} {}", run.step, run.total_steps, run.status.name());
    for (name, label) in KEY_METRICS {
        if let Some(value) = run.latest_metrics.get(name) {
            line.push_str(&format!("  {label} {value:.4}"));
        }
    }
    line
}

async fn watch(client: &RunsClient, id: Uuid) -> anyhow::Result<()> {
    let mut last = String::new();
    loop {
        let run = client.get(id).await?;
        let line = progress_line(&run);
        if line != last {
            print!("\r{line}\x1b[K");
            std::io::stdout().flush()?;
            last = line;
        }
        if run.status.is_final() {
            println!();
            return match run.status {
                RunStatus::Succeeded => Ok(()),
                status => bail!("run {id} {}: {}", status.name(), run.reason.unwrap_or_default()),
            };
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}
