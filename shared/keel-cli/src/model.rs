//! `keel model`: `init` writes a new HF model directory, `score` prints per-token logprobs of
//! JSONL token sequences, `generate` samples a completion.

use std::io::{BufRead, BufWriter, Write};
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use keel_model::device::{parse_device, parse_kind};
use keel_model::init::{InitSpec, Preset, init_model};
use keel_model::sampling::{FinishReason, SamplingParams, generate};
use keel_model::{Architecture, CausalLm, Tokenizer};
use serde_json::{Value, json};
use tch::Tensor;

use crate::runtime::RuntimeArgs;

#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Write a new model: random weights, a BPE tokenizer trained on the given text, a chat template.
    Init(InitArgs),
    /// Print log p(token_i | tokens before i) for each JSONL line `{"token_ids": [...]}`.
    Score(ScoreArgs),
    /// Generate a completion for a prompt.
    Generate(GenerateArgs),
    /// Measure prefill and decode tokens/s.
    Bench(crate::bench::BenchArgs),
}

#[derive(Debug, Args)]
pub struct InitArgs {
    /// llama, qwen2, qwen3, mistral, qwen3_moe, mixtral, gemma2, gemma3, phi3, olmo2, olmo3, glm4,
    /// granite or smollm3.
    #[arg(long)]
    arch: String,
    /// tiny (tests), small (demo) or medium (small's tokenizer, a larger model: a teacher).
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Text files the tokenizer is trained on.
    #[arg(long = "train-tokenizer", num_args = 1.., required = true)]
    train_tokenizer: Vec<PathBuf>,
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 0)]
    seed: i64,
}

#[derive(Debug, Args)]
pub struct ScoreArgs {
    #[command(flatten)]
    runtime: RuntimeArgs,
    /// JSONL input; `-` reads standard input.
    #[arg(long)]
    input: PathBuf,
    /// Logits are divided by this before the log-softmax.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Sequences scored together (right-padded).
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Tensor-parallel ranks (threads over the CPU collective; each loads only its slices).
    #[arg(long, default_value_t = 1)]
    tp: usize,
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    runtime: RuntimeArgs,
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print token ids, logprobs and the finish reason as JSON.
    #[arg(long)]
    json: bool,
    /// Tensor-parallel ranks (threads over the CPU collective, or one GPU each over NCCL
    /// from the device named); each loads only its slices.
    #[arg(long, default_value_t = 1)]
    tp: usize,
}

pub fn run(command: ModelCommand) -> anyhow::Result<()> {
    match command {
        ModelCommand::Init(args) => init(args),
        ModelCommand::Score(args) => score(args),
        ModelCommand::Generate(args) => generate_command(args),
        ModelCommand::Bench(args) => crate::bench::bench(args),
    }
}

fn init(args: InitArgs) -> anyhow::Result<()> {
    let spec = InitSpec {
        architecture: args.arch.parse::<Architecture>().with_context(|| format!("--arch {}", args.arch))?,
        preset: args.preset.parse::<Preset>()?,
        tokenizer_corpus: args.train_tokenizer,
        out: args.out,
        seed: args.seed,
    };
    init_model(&spec)?;
    println!("wrote {}", spec.out.display());
    Ok(())
}

/// Reads `{"token_ids": [...]}` lines, checking each against the vocabulary.
fn read_sequences(input: &PathBuf, vocab_size: i64) -> anyhow::Result<Vec<Vec<i64>>> {
    let reader: Box<dyn BufRead> = if input.as_os_str() == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        let file = std::fs::File::open(input).with_context(|| format!("{}", input.display()))?;
        Box::new(std::io::BufReader::new(file))
    };
    let mut sequences = Vec::new();
    for (index, line) in reader.lines().enumerate() {
        let at = || format!("{} line {}", input.display(), index + 1);
        let line = line.with_context(at)?;
        if line.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(&line).with_context(at)?;
        let ids = value
            .get("token_ids")
            .and_then(Value::as_array)
            .with_context(|| format!("{}: expected {{\"token_ids\": [...]}}", at()))?
            .iter()
            .map(|v| v.as_i64().with_context(|| format!("{}: token id {v} is not an integer", at())))
            .collect::<anyhow::Result<Vec<i64>>>()?;
        if ids.is_empty() {
            bail!("{}: token_ids is empty", at());
        }
        if let Some(bad) = ids.iter().find(|id| !(0..vocab_size).contains(*id)) {
            bail!("{}: token id {bad} is out of range for vocabulary size {vocab_size}", at());
        }
        sequences.push(ids);
    }
    Ok(sequences)
}

fn score(args: ScoreArgs) -> anyhow::Result<()> {
    if args.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    if args.tp == 0 {
        bail!("--tp must be at least 1");
    }
    let mut out = BufWriter::new(std::io::stdout().lock());
    if args.tp == 1 {
        let model = args.runtime.load()?;
        let sequences = read_sequences(&args.input, model.config().vocab_size)?;
        let logprobs = |ids: &Tensor, lengths: &[i64]| Ok(model.token_logprobs(ids, lengths, args.temperature)?);
        score_batches(&sequences, args.batch_size, logprobs, |line| writeln!(out, "{line}"))?;
    } else {
        for line in score_tensor_parallel(&args)? {
            writeln!(out, "{line}")?;
        }
    }
    out.flush()?;
    Ok(())
}

/// Scores `sequences` in right-padded batches of `batch_size`; `emit` gets one JSON line per
/// sequence, in order.
fn score_batches(
    sequences: &[Vec<i64>],
    batch_size: usize,
    logprobs: impl Fn(&Tensor, &[i64]) -> anyhow::Result<Tensor>,
    mut emit: impl FnMut(Value) -> std::io::Result<()>,
) -> anyhow::Result<()> {
    let _no_grad = tch::no_grad_guard();
    for batch in sequences.chunks(batch_size) {
        let width = batch.iter().map(Vec::len).max().unwrap_or(0);
        let padded: Vec<i64> =
            batch.iter().flat_map(|s| s.iter().copied().chain(std::iter::repeat_n(0, width - s.len()))).collect();
        let ids = Tensor::from_slice(&padded).f_view([batch.len() as i64, width as i64])?;
        let lengths: Vec<i64> = batch.iter().map(|s| s.len() as i64).collect();
        let flat = Vec::<f32>::try_from(logprobs(&ids, &lengths)?.f_flatten(0, -1)?)?;
        for (row, seq) in batch.iter().enumerate() {
            emit(json!({ "logprobs": &flat[row * width..row * width + seq.len()] }))?;
        }
    }
    Ok(())
}

/// Runs `work` on `tp` tensor-parallel ranks, one thread each, every rank loading only its
/// slices of the model (CPU collective on the CPU, NCCL with rank r on `cuda:N+r`); returns
/// rank 0's result.
fn on_ranks<T: Send + 'static>(
    runtime: &RuntimeArgs,
    tp: usize,
    work: impl Fn(&CausalLm) -> anyhow::Result<T> + Send + Clone + 'static,
) -> anyhow::Result<T> {
    if tp == 0 {
        bail!("--tp must be at least 1");
    }
    let device = parse_device(&runtime.device)?;
    let kind = parse_kind(&runtime.dtype)?;
    let comms = keel_collective::new_group(tp, device).with_context(|| format!("--tp {tp} on {}", runtime.device))?;
    let threads: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let (dir, work) = (runtime.model.clone(), work.clone());
            let device = keel_collective::rank_device(device, rank);
            std::thread::spawn(move || -> anyhow::Result<T> {
                let model = CausalLm::load_shard(&dir, comm, device, kind).with_context(|| format!("rank {rank}"))?;
                work(&model)
            })
        })
        .collect();
    let mut outputs = Vec::new();
    for (rank, thread) in threads.into_iter().enumerate() {
        match thread.join() {
            Ok(result) => outputs.push(result.with_context(|| format!("tensor-parallel rank {rank}"))?),
            Err(_) => bail!("tensor-parallel rank {rank} panicked"),
        }
    }
    Ok(outputs.swap_remove(0))
}

/// `--tp N`: rank 0's lines are the output.
fn score_tensor_parallel(args: &ScoreArgs) -> anyhow::Result<Vec<Value>> {
    let cfg = keel_model::ModelConfig::load(&args.runtime.model)?;
    let sequences = std::sync::Arc::new(read_sequences(&args.input, cfg.vocab_size)?);
    let (batch_size, temperature) = (args.batch_size, args.temperature);
    on_ranks(&args.runtime, args.tp, move |model| {
        let logprobs = |ids: &Tensor, lengths: &[i64]| Ok(model.token_logprobs(ids, lengths, temperature)?);
        let mut lines = Vec::new();
        score_batches(&sequences, batch_size, logprobs, |line| {
            lines.push(line);
            Ok(())
        })?;
        Ok(lines)
    })
}

fn generate_command(args: GenerateArgs) -> anyhow::Result<()> {
    let cfg = keel_model::ModelConfig::load(&args.runtime.model)?;
    let tokenizer = Tokenizer::load(&args.runtime.model)?;
    let prompt_ids: Vec<i64> = if args.chat {
        let text = tokenizer.apply_chat_template(&json!([{"role": "user", "content": args.prompt}]), true)?;
        tokenizer.encode(&text, false)?
    } else {
        tokenizer.encode(&args.prompt, true)?
    }
    .into_iter()
    .map(i64::from)
    .collect();
    let mut stop_ids = tokenizer.eos_token_ids().to_vec();
    if stop_ids.is_empty() {
        stop_ids = cfg.eos_token_ids.clone();
    }
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: 0.0,
        seed: args.seed,
    };
    let generation = if args.tp == 1 {
        generate(&args.runtime.load()?, &prompt_ids, args.max_tokens, &stop_ids, params)?
    } else {
        // Every rank decodes the same tokens from the same gathered logits.
        let (prompt, max_tokens, stop) = (prompt_ids.clone(), args.max_tokens, stop_ids.clone());
        on_ranks(&args.runtime, args.tp, move |model| Ok(generate(model, &prompt, max_tokens, &stop, params.clone())?))?
    };
    let ids: Vec<u32> = generation.tokens.iter().map(|&t| t as u32).collect();
    let text = tokenizer.decode(&ids, true)?;
    if args.json {
        let finish_reason = match generation.finish_reason {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        };
        println!(
            "{}",
            json!({"text": text, "prompt_token_ids": prompt_ids, "token_ids": generation.tokens,
                   "logprobs": generation.logprobs, "finish_reason": finish_reason})
        );
    } else {
        println!("{text}");
    }
    Ok(())
}
