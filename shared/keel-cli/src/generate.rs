//! `keel generate bench`: the generator's engine (continuous batching scheduler, paged KV
//! cache) on B simultaneous greedy requests, measured the way `bench/hf_generate.py`
//! measures transformers' batched `generate`: time until every request has its first token,
//! then decode tokens/s over the remaining tokens.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use keel_generation::backend::Backend;
use keel_generation::engine::{Engine, EngineConfig, RefitMode, StepPhase};
use keel_generation::request::{Event, GenRequest};
use keel_model::CausalLm;
use keel_model::sampling::SamplingParams;
use serde_json::{Value, json};

use crate::bench::median;

#[derive(Debug, Subcommand)]
pub enum GenerateCommand {
    /// Measure time to first token and decode tokens/s of the generator engine.
    Bench(GenerateBenchArgs),
    /// Load a running OpenAI-compatible server with random prompts (as `vllm bench serve`).
    ServeBench(crate::serve::ServeBenchArgs),
}

#[derive(Debug, Args)]
pub struct GenerateBenchArgs {
    #[arg(long)]
    model: std::path::PathBuf,
    /// Simultaneous requests.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// Timed runs after one warm-up; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    #[arg(long)]
    threads: Option<i32>,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Tokens per engine step (the generator's `max_num_batched_tokens`).
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: usize,
    /// On CUDA, run every decode step eagerly (no CUDA graphs), as the generator's
    /// `enforce_eager`; Keel's CUDA kernels run either way, as they do in the generator.
    #[arg(long)]
    eager: bool,
}

pub fn run(command: GenerateCommand) -> anyhow::Result<()> {
    match command {
        GenerateCommand::Bench(args) => bench(args),
        GenerateCommand::ServeBench(args) => crate::serve::run(args),
    }
}

/// Seconds until every request has its first token, and until all are done.
fn one_run(engine: &Engine, args: &GenerateBenchArgs, vocab: i64) -> anyhow::Result<(f64, f64)> {
    let start = Instant::now();
    let mut receivers = Vec::new();
    for row in 0..args.batch {
        let prompt: Vec<i64> =
            (0..args.prompt_tokens).map(|i| ((row * args.prompt_tokens + i) as i64 * 37 + 5) % vocab).collect();
        let request = GenRequest {
            prompt,
            n: 1,
            max_tokens: args.decode_tokens,
            sampling: SamplingParams { temperature: 0.0, ..Default::default() },
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            include_stop_str_in_output: false,
            top_logprobs: 0,
            min_tokens: 0,
            guide: None,
            logit_bias: Vec::new(),
        };
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        engine.submit(request, tx).map_err(anyhow::Error::msg)?;
        receivers.push(rx);
    }
    for rx in &mut receivers {
        match rx.blocking_recv() {
            Some(Event::Token(_)) => {}
            other => bail!("expected a first token, got {other:?}"),
        }
    }
    let first = start.elapsed().as_secs_f64();
    for rx in &mut receivers {
        while let Some(event) = rx.blocking_recv() {
            if let Event::Failed(message) = event {
                bail!("generation failed: {message}");
            }
        }
    }
    Ok((first, start.elapsed().as_secs_f64()))
}

fn bench(args: GenerateBenchArgs) -> anyhow::Result<()> {
    if args.batch < 1 || args.prompt_tokens < 1 || args.decode_tokens < 2 || args.repeats < 1 {
        bail!("--batch, --prompt-tokens and --repeats must be at least 1, --decode-tokens at least 2");
    }
    crate::bench::set_threads(args.threads)?;
    let device = keel_model::device::parse_device(&args.device)?;
    let kind = keel_model::device::parse_kind(&args.dtype)?;
    let vocab = keel_model::ModelConfig::load(&args.model).context("reading the model's config")?.vocab_size;
    let length = args.prompt_tokens + args.decode_tokens;
    // Room for every request at once: the bench measures the engine, not preemption.
    let blocks = args.batch * length.div_ceil(keel_model::BLOCK_SIZE);
    let config = EngineConfig {
        max_num_seqs: args.batch,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_model_len: length,
        refit_mode: RefitMode::Drain,
        model_name: args.model.display().to_string(),
    };
    // The engine loads the model on its own thread (see `Engine::start_with`). On CUDA it runs
    // as the generator runs it: Keel's kernels, and the decode step replayed from CUDA graphs.
    let dir = args.model.clone();
    let (cuda, graphs, graph_rows) = (device != tch::Device::Cpu, !args.eager, args.batch);
    // Kernels on and off, and CUDA graph batch sizes captured: reported with the figures.
    let cuda_counts = std::sync::Arc::new([AtomicUsize::new(0), AtomicUsize::new(0), AtomicUsize::new(0)]);
    let counts = cuda_counts.clone();
    let load = move || {
        let mut model = CausalLm::load(&dir, device, kind)?;
        if cuda {
            let (on, off) = keel_generation::backend::attach_kernels(&mut model, device, kind);
            counts[0].store(on, Ordering::Relaxed);
            counts[1].store(off, Ordering::Relaxed);
        }
        let mut backend = Backend::whole(model, blocks)?;
        if cuda && graphs {
            counts[2].store(backend.capture_graphs_or_run_eagerly(graph_rows, length), Ordering::Relaxed);
        }
        Ok(backend)
    };
    let engine = Engine::start_with(load, None, config).context("loading the model")?;
    one_run(&engine, &args, vocab)?;
    // Where the timed runs' steps spent their time (the warm-up left out).
    let stats = &engine.stats;
    let phases_before: Vec<u64> = stats.phase_micros.iter().map(|p| p.load(Ordering::Relaxed)).collect();
    let steps_before = stats.steps.load(Ordering::Relaxed);
    let timed = Instant::now();
    let runs = (0..args.repeats).map(|_| one_run(&engine, &args, vocab)).collect::<anyhow::Result<Vec<_>>>()?;
    let wall_micros = timed.elapsed().as_micros() as f64;
    let steps = (stats.steps.load(Ordering::Relaxed) - steps_before).max(1) as f64;
    let mut phases = serde_json::Map::new();
    for (phase, before) in StepPhase::ALL.iter().zip(&phases_before) {
        let micros = stats.phase_micros[*phase as usize].load(Ordering::Relaxed) - before;
        phases.insert(phase.name().into(), json!(micros as f64 / steps / 1e3));
    }
    let in_steps: f64 = phases.values().filter_map(Value::as_f64).sum();
    phases.insert("between_steps".into(), json!(wall_micros / steps / 1e3 - in_steps));
    let ttft = median(runs.iter().map(|r| r.0).collect());
    let decode = median(runs.iter().map(|r| r.1 - r.0).collect());
    println!(
        "{}",
        json!({
            "engine": "keel", "batch": args.batch, "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens, "dtype": args.dtype, "threads": tch::get_num_threads(),
            "ttft_s": ttft, "decode_tokens_per_s": (args.batch * (args.decode_tokens - 1)) as f64 / decode,
            "steps": steps as u64 / args.repeats as u64, "step_phases_ms": phases,
            "cuda_kernels_on": cuda_counts[0].load(Ordering::Relaxed),
            "cuda_kernels_off": cuda_counts[1].load(Ordering::Relaxed),
            "cuda_graph_buckets": cuda_counts[2].load(Ordering::Relaxed),
        })
    );
    Ok(())
}
