//! `keel train bench`: tokens/s of one training step of the trainer's engine (forward,
//! backward, gradient clipping, AdamW) on a fixed batch, measured the way
//! `bench/hf_train_throughput.py` measures a PyTorch eager loop, so
//! `bench/train-throughput` can print them side by side.

use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use keel_protocol::trainer::{LoadRequest, TrainBatch};
use keel_training::Engine;
use keel_training::batch::Batch;
use serde_json::json;

#[derive(Debug, Subcommand)]
pub enum TrainCommand {
    /// Measure training tokens/s (SFT loss, AdamW, one optimiser step per batch).
    Bench(TrainBenchArgs),
}

#[derive(Debug, Args)]
pub struct TrainBenchArgs {
    #[arg(long)]
    model: std::path::PathBuf,
    /// Sequences per optimiser step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Sequences per forward/backward pass (gradients accumulate).
    #[arg(long)]
    micro_batch: Option<usize>,
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Timed steps after one warm-up step; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Intra-op CPU threads (default: libtorch's choice).
    #[arg(long)]
    threads: Option<i32>,
    /// Compute dtype: f32, bf16 or f16 (master weights stay f32).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
}

pub fn run(command: TrainCommand) -> anyhow::Result<()> {
    match command {
        TrainCommand::Bench(args) => bench(args),
    }
}

fn bench(args: TrainBenchArgs) -> anyhow::Result<()> {
    let micro = args.micro_batch.unwrap_or(args.batch);
    if args.batch < 1 || args.seq_len < 2 || args.repeats < 1 || micro < 1 || micro > args.batch {
        bail!("--batch ≥ 1, 1 ≤ --micro-batch ≤ --batch, --seq-len ≥ 2 and --repeats ≥ 1 are required");
    }
    crate::bench::set_threads(args.threads)?;
    let request: LoadRequest = serde_json::from_value(json!({
        "run_id": "bench",
        "policy": {"path": args.model},
        "training": {
            "loss": {"type": "nll"}, "global_batch_size": args.batch, "micro_batch_size": micro,
            "optimizer": {"lr": 1e-5, "weight_decay": 0.01}, "max_grad_norm": 1.0,
        },
        "device": args.device, "dtype": args.dtype,
    }))?;
    let problems = request.training.problems("training");
    if !problems.is_empty() {
        bail!("{}", keel_protocol::join_problems(&problems));
    }
    let mut engine = Engine::load(&request, &args.device).context("loading the model")?;
    let vocab = engine.policy().config().vocab_size;
    let input_ids: Vec<Vec<i64>> = (0..args.batch as i64)
        .map(|row| (0..args.seq_len as i64).map(|i| (row * args.seq_len as i64 + i) * 37 % vocab).collect())
        .collect();
    let token_mask = vec![vec![1.0; args.seq_len]; args.batch];
    let wire = TrainBatch { input_ids, token_mask, ..Default::default() };
    let device = engine.policy().device();
    let mut step = || -> anyhow::Result<f64> {
        let batch = Batch::new(&wire, &engine.config().loss)?;
        let start = Instant::now();
        engine.train(batch, 1.0)?;
        if let tch::Device::Cuda(index) = device {
            tch::Cuda::synchronize(index as i64);
        }
        Ok(start.elapsed().as_secs_f64())
    };
    step()?;
    let median = crate::bench::median((0..args.repeats).map(|_| step()).collect::<anyhow::Result<Vec<_>>>()?);
    println!(
        "{}",
        json!({
            "engine": "keel", "batch": args.batch, "micro_batch": micro, "seq_len": args.seq_len,
            "dtype": args.dtype, "threads": tch::get_num_threads(),
            "step_seconds": median, "tokens_per_s": (args.batch * args.seq_len) as f64 / median,
        })
    );
    Ok(())
}
