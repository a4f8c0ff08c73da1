//! `keel reward bench`: scored samples per second of one reward environment, in process (no
//! HTTP or NATS in the way), on samples read from a JSONL file of `{"messages", "metadata"}`
//! lines. `bench/reward-throughput` runs it beside a reference on the same samples.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use keel_environments::registry::EnvContext;
use keel_environments::sandbox::SandboxConfig;
use keel_environments::scoring::Scorer;
use keel_protocol::Subjects;
use keel_protocol::reward::{EnvConfig, EnvSample, EnvStepRequest, OnError};
use serde_json::json;

#[derive(Debug, Subcommand)]
pub enum RewardCommand {
    /// Scored samples/s of an environment on a JSONL file of samples.
    Bench(RewardBenchArgs),
}

#[derive(Debug, Args)]
pub struct RewardBenchArgs {
    /// The environment as JSON, e.g. '{"name": "math"}'.
    #[arg(long)]
    env: String,
    /// One `{"messages": [...], "metadata": {...}}` per line.
    #[arg(long)]
    input: PathBuf,
    /// Samples per request; requests run one after another.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Programs the code sandbox runs at once.
    #[arg(long, default_value_t = 2)]
    sandbox_slots: usize,
    /// Timed repetitions after one warm-up; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

pub fn run(command: RewardCommand) -> anyhow::Result<()> {
    match command {
        RewardCommand::Bench(args) => bench(args),
    }
}

fn bench(args: RewardBenchArgs) -> anyhow::Result<()> {
    if args.batch == 0 || args.repeats == 0 || args.sandbox_slots == 0 {
        bail!("--batch, --repeats and --sandbox-slots must be at least 1");
    }
    let env: EnvConfig = serde_json::from_str(&args.env).context("--env")?;
    let text = std::fs::read_to_string(&args.input).with_context(|| format!("cannot read {}", args.input.display()))?;
    let samples: Vec<EnvSample> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| serde_json::from_str(l).with_context(|| format!("{} line {}", args.input.display(), i + 1)))
        .collect::<anyhow::Result<_>>()?;
    if samples.is_empty() {
        bail!("{} holds no samples", args.input.display());
    }
    let sandbox = SandboxConfig { slots: args.sandbox_slots, ..SandboxConfig::default() };
    let ctx = EnvContext::new(Default::default(), false, None, Subjects::default(), "keel-bulk".into(), sandbox)
        .map_err(anyhow::Error::msg)?;
    // Requests run one after another, each of `--batch` samples.
    let scorer = Scorer::new(ctx, 1, args.batch);
    let runtime = tokio::runtime::Runtime::new()?;
    let pass = || -> anyhow::Result<(f64, Vec<f64>)> {
        let start = Instant::now();
        let mut rewards = Vec::with_capacity(samples.len());
        for chunk in samples.chunks(args.batch) {
            let request = EnvStepRequest { env: env.clone(), on_error: OnError::Fail, samples: chunk.to_vec() };
            let reply = runtime.block_on(scorer.step(request))?;
            rewards.extend(reply.results.iter().map(|r| r.reward));
        }
        Ok((start.elapsed().as_secs_f64(), rewards))
    };
    let (_, rewards) = pass()?;
    let times = (0..args.repeats).map(|_| pass().map(|(t, _)| t)).collect::<anyhow::Result<Vec<_>>>()?;
    let seconds = crate::bench::median(times);
    let line = json!({
        "engine": "keel",
        "env": env.name(),
        "samples": samples.len(),
        "seconds": seconds,
        "samples_per_s": samples.len() as f64 / seconds,
        "rewards": rewards,
    });
    println!("{line}");
    Ok(())
}
