//! `keel train bench`: tokens/s of one training step of the trainer's engine (forward,
//! backward, gradient clipping, AdamW) on a fixed batch, measured the way
//! `bench/hf_train_throughput.py` measures a PyTorch eager loop, so
//! `bench/train-throughput` can print them side by side. With mixed lengths (`--min-len`)
//! it compares padded, packed and dynamic microbatches; tokens/s counts real tokens only.
//! With `--data-parallel N` it runs N processes of itself, data-parallel ranks over the TCP
//! collective on loopback, each training on its share of the same global batch; rank 0
//! prints the line (tokens/s of the whole global batch).

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
    /// Every --group consecutive sequences begin with the same --prompt-len tokens, as a
    /// GRPO group's samples begin with their prompt.
    #[arg(long, default_value_t = 1)]
    group: usize,
    /// Tokens each group's sequences share (see --group).
    #[arg(long, default_value_t = 0)]
    prompt_len: usize,
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
    /// Data-parallel ranks, each a process of its own (this command starts them).
    #[arg(long, default_value_t = 1)]
    data_parallel: usize,
    /// Set by the process that starts the ranks: this process's data-parallel rank.
    #[arg(long, hide = true)]
    dp_rank: Option<usize>,
    /// Set by the process that starts the ranks: rank 0's address.
    #[arg(long, hide = true)]
    dp_hub: Option<std::net::SocketAddr>,
}

/// How long a data-parallel rank waits for the others.
const RANK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Starts `--data-parallel` processes of this command, each told its rank and rank 0's
/// address, and passes rank 0's output on.
fn launch_ranks(world: usize) -> anyhow::Result<()> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let exe = std::env::current_exe()?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let children = (0..world)
        .map(|rank| {
            std::process::Command::new(&exe)
                .args(&args)
                .args(["--dp-rank", &rank.to_string(), "--dp-hub", &format!("127.0.0.1:{port}")])
                .stdout(std::process::Stdio::piped())
                .spawn()
                .with_context(|| format!("starting data-parallel rank {rank}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut failed = Vec::new();
    for (rank, child) in children.into_iter().enumerate() {
        let output = child.wait_with_output()?;
        if !output.status.success() {
            failed.push(format!("rank {rank}: {}", output.status));
        }
        if rank == 0 {
            print!("{}", String::from_utf8_lossy(&output.stdout));
        }
    }
    if !failed.is_empty() {
        bail!("data-parallel ranks failed: {}", failed.join(", "));
    }
    Ok(())
}

pub fn run(command: TrainCommand) -> anyhow::Result<()> {
    match command {
        TrainCommand::Bench(args) => bench(args),
    }
}

fn bench(args: TrainBenchArgs) -> anyhow::Result<()> {
    if args.data_parallel == 0 {
        bail!("--data-parallel must be at least 1");
    }
    if args.data_parallel > 1 && args.dp_rank.is_none() {
        return launch_ranks(args.data_parallel);
    }
    let micro = args.micro_batch.unwrap_or(args.batch);
    if args.batch < 1 || args.seq_len < 2 || args.repeats < 1 || micro < 1 || micro > args.batch {
        bail!("--batch ≥ 1, 1 ≤ --micro-batch ≤ --batch, --seq-len ≥ 2 and --repeats ≥ 1 are required");
    }
    let min_len = args.min_len.unwrap_or(args.seq_len);
    if !(2..=args.seq_len).contains(&min_len) {
        bail!("--min-len must be 2 to --seq-len");
    }
    if args.group < 1 || args.prompt_len >= min_len {
        bail!("--group must be at least 1 and --prompt-len shorter than every sequence");
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
    let data = match (args.dp_rank, args.dp_hub) {
        (Some(rank), Some(hub)) => {
            use keel_collective::tcp::TcpCollective;
            let comm = if rank == 0 {
                let listener = std::net::TcpListener::bind(hub).with_context(|| format!("listening on {hub}"))?;
                TcpCollective::accept(&listener, args.data_parallel, "keel-train-bench", RANK_TIMEOUT)?
            } else {
                TcpCollective::connect(hub, rank, args.data_parallel, "keel-train-bench", RANK_TIMEOUT)?
            };
            Some(std::sync::Arc::new(comm) as keel_collective::SharedComm)
        }
        _ => None,
    };
    let mut engine = Engine::load_group(&request, &args.device, None, data).context("loading the model")?;
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
    // A group's sequences take their first --prompt-len tokens from the group's first row.
    let token = |row: usize, i: usize| {
        let source = if i < args.prompt_len { row / args.group * args.group } else { row };
        ((source * args.seq_len + i) * 37) as i64 % vocab
    };
    let input_ids: Vec<Vec<i64>> =
        lengths.iter().enumerate().map(|(row, &len)| (0..len).map(|i| token(row, i)).collect()).collect();
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
    // The step's seconds, and its forward, backward and optimiser parts (the engine's timing).
    let mut step = || -> anyhow::Result<[f64; 4]> {
        let batch = Batch::new(&wire, &engine.config().loss)?;
        let start = Instant::now();
        let trained = engine.train(batch, 1.0)?;
        if let tch::Device::Cuda(index) = device {
            tch::Cuda::synchronize(index as i64);
        }
        let part = |name: &str| trained.timing.get(name).copied().unwrap_or(f64::NAN);
        Ok([start.elapsed().as_secs_f64(), part("forward"), part("backward"), part("optimizer")])
    };
    step()?;
    let timed = (0..args.repeats).map(|_| step()).collect::<anyhow::Result<Vec<_>>>()?;
    let [median, forward, backward, optimizer] =
        std::array::from_fn(|i| crate::bench::median(timed.iter().map(|t| t[i]).collect()));
    if args.dp_rank.is_some_and(|rank| rank != 0) {
        return Ok(());
    }
    println!(
        "{}",
        json!({
            "engine": "keel", "batch": args.batch, "micro_batch": micro, "seq_len": args.seq_len,
            "min_len": min_len, "batching": args.batching, "tokens": tokens, "computed_tokens": computed,
            "dtype": args.dtype, "threads": tch::get_num_threads(), "data_parallel": args.data_parallel,
            "step_seconds": median, "tokens_per_s": tokens as f64 / median,
            "forward_seconds": forward, "backward_seconds": backward, "optimizer_seconds": optimizer,
            "group": args.group, "prompt_len": args.prompt_len,
        })
    );
    Ok(())
}
