//! `keel train bench`: tokens/s of one training step of the trainer's engine (forward,
//! backward, gradient clipping, AdamW) on a fixed batch, measured the way
//! `bench/hf_train_throughput.py` measures a PyTorch eager loop, so
//! `bench/train-throughput` can print them side by side. With mixed lengths (`--min-len`)
//! it compares padded, packed and dynamic microbatches; tokens/s counts real tokens only.

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
    /// The longest sequence; every sequence has this length unless --min-len is given.
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Mixed lengths: each sequence's length drawn uniformly from --min-len to --seq-len
    /// (seeded, the same every run).
    #[arg(long)]
    min_len: Option<usize>,
    /// How microbatches are made: `rows` (--micro-batch rows, padded), `packed` (sequence
    /// packing) or `dynamic` (length-sorted padded microbatches), the last two by --mb-tokens.
    #[arg(long, default_value = "rows")]
    batching: String,
    /// Tokens per microbatch for `packed` and `dynamic` (default: --micro-batch × --seq-len).
    #[arg(long)]
    mb_tokens: Option<usize>,
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
    let min_len = args.min_len.unwrap_or(args.seq_len);
    if !(2..=args.seq_len).contains(&min_len) {
        bail!("--min-len must be 2 to --seq-len");
    }
    crate::bench::set_threads(args.threads)?;
    let budget_tokens = args.mb_tokens.unwrap_or(micro * args.seq_len);
    let budget = json!({"enabled": true, "train_mb_tokens": budget_tokens});
    let (packing, dynamic) = match args.batching.as_str() {
        "rows" => (json!({"enabled": false}), json!({"enabled": false})),
        "packed" => (budget, json!({"enabled": false})),
        "dynamic" => (json!({"enabled": false}), budget),
        other => bail!("--batching is rows, packed or dynamic, not `{other}`"),
    };
    let request: LoadRequest = serde_json::from_value(json!({
        "run_id": "bench",
        "policy": {"path": args.model},
        "training": {
            "loss": {"type": "nll"}, "global_batch_size": args.batch, "micro_batch_size": micro,
            "optimizer": {"lr": 1e-5, "weight_decay": 0.01}, "max_grad_norm": 1.0,
            "sequence_packing": packing, "dynamic_batching": dynamic,
        },
        "device": args.device, "dtype": args.dtype,
    }))?;
    let problems = request.training.problems("training");
    if !problems.is_empty() {
        bail!("{}", keel_protocol::join_problems(&problems));
    }
    let mut engine = Engine::load(&request, &args.device).context("loading the model")?;
    let vocab = engine.policy().config().vocab_size;
    // A fixed xorshift stream: the same lengths on every run and machine.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut length = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        min_len + (state % (args.seq_len - min_len + 1) as u64) as usize
    };
    let lengths: Vec<usize> = (0..args.batch).map(|_| length()).collect();
    let input_ids: Vec<Vec<i64>> = lengths
        .iter()
        .enumerate()
        .map(|(row, &len)| (0..len as i64).map(|i| (row as i64 * args.seq_len as i64 + i) * 37 % vocab).collect())
        .collect();
    let token_mask: Vec<Vec<f32>> = lengths.iter().map(|&len| vec![1.0; len]).collect();
    let tokens: usize = lengths.iter().sum();
    // The positions the microbatches compute: padded rows are as long as their microbatch's
    // longest; packed ones hold only real tokens.
    let packed = args.batching == "packed";
    let budget = (args.batching != "rows").then_some((budget_tokens, packed));
    let as_i64: Vec<i64> = lengths.iter().map(|&l| l as i64).collect();
    let computed: i64 = keel_training::batch::microbatches(&as_i64, micro, budget, false)
        .iter()
        .map(|rows| {
            let longest = rows.iter().map(|&r| as_i64[r]).max().unwrap_or(0);
            if packed { rows.iter().map(|&r| as_i64[r]).sum() } else { longest * rows.len() as i64 }
        })
        .sum();
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
            "min_len": min_len, "batching": args.batching, "tokens": tokens, "computed_tokens": computed,
            "dtype": args.dtype, "threads": tch::get_num_threads(),
            "step_seconds": median, "tokens_per_s": tokens as f64 / median,
        })
    );
    Ok(())
}
