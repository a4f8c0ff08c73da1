//! `keel model bench`: prefill and decode throughput of the model core, measured the way
//! `bench/hf_throughput.py` measures transformers (same token ids, same shapes, greedy
//! decoding with a KV cache), so `bench/model-throughput` can print them side by side.

use std::time::Instant;

use anyhow::bail;
use clap::Args;
use keel_model::{CausalLm, KvCache};
use serde_json::json;
use tch::{Device, Kind, Tensor};

use crate::runtime::RuntimeArgs;

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    runtime: RuntimeArgs,
    #[arg(long, default_value_t = 1)]
    batch: i64,
    #[arg(long, default_value_t = 128)]
    prompt_tokens: i64,
    #[arg(long, default_value_t = 64)]
    decode_tokens: i64,
    /// Timed repetitions after one warm-up; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Intra-op CPU threads (default: libtorch's choice).
    #[arg(long)]
    threads: Option<i32>,
}

fn synchronize(device: Device) {
    if let Device::Cuda(index) = device {
        tch::Cuda::synchronize(index as i64);
    }
}

/// Seconds for one prefill and for the decode steps that follow it.
fn one_run(model: &CausalLm, args: &BenchArgs) -> anyhow::Result<(f64, f64)> {
    let vocab = model.config().vocab_size;
    let device = model.device();
    let ids: Vec<i64> = (0..args.batch * args.prompt_tokens).map(|i| (i * 37 + 5) % vocab).collect();
    let prompt = Tensor::from_slice(&ids).f_view([args.batch, args.prompt_tokens])?.f_to_device(device)?;
    let mut cache =
        KvCache::new(model.config(), args.batch, args.prompt_tokens + args.decode_tokens, model.kind(), device)?;
    synchronize(device);
    let start = Instant::now();
    let logits = model.forward(&prompt, Some(&mut cache))?;
    let mut next = logits.f_select(1, -1)?.f_argmax(-1, true)?;
    synchronize(device);
    let prefill = start.elapsed().as_secs_f64();
    let start = Instant::now();
    for _ in 0..args.decode_tokens {
        let logits = model.forward(&next, Some(&mut cache))?;
        next = logits.f_select(1, -1)?.f_argmax(-1, true)?;
    }
    synchronize(device);
    Ok((prefill, start.elapsed().as_secs_f64()))
}

/// The median of timed runs.
pub(crate) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Applies `--threads` (intra-op CPU threads; default: libtorch's choice).
pub(crate) fn set_threads(threads: Option<i32>) -> anyhow::Result<()> {
    match threads {
        Some(threads) if threads < 1 => bail!("--threads must be at least 1"),
        Some(threads) => tch::set_num_threads(threads),
        None => {}
    }
    Ok(())
}

pub fn bench(args: BenchArgs) -> anyhow::Result<()> {
    if args.batch < 1 || args.prompt_tokens < 1 || args.decode_tokens < 1 || args.repeats < 1 {
        bail!("--batch, --prompt-tokens, --decode-tokens and --repeats must be at least 1");
    }
    if args.batch.checked_mul(args.prompt_tokens + args.decode_tokens).is_none_or(|tokens| tokens > 1 << 24) {
        bail!("--batch × (--prompt-tokens + --decode-tokens) must stay below 2^24 tokens");
    }
    set_threads(args.threads)?;
    let model = args.runtime.load()?;
    let _no_grad = tch::no_grad_guard();
    one_run(&model, &args)?;
    let runs = (0..args.repeats).map(|_| one_run(&model, &args)).collect::<anyhow::Result<Vec<_>>>()?;
    let prefill = median(runs.iter().map(|r| r.0).collect());
    let decode = median(runs.iter().map(|r| r.1).collect());
    let kind = match model.kind() {
        Kind::BFloat16 => "bf16",
        Kind::Half => "f16",
        _ => "f32",
    };
    println!(
        "{}",
        json!({
            "engine": "keel", "batch": args.batch, "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens, "dtype": kind, "threads": tch::get_num_threads(),
            "prefill_tokens_per_s": (args.batch * args.prompt_tokens) as f64 / prefill,
            "decode_tokens_per_s": (args.batch * args.decode_tokens) as f64 / decode,
        })
    );
    Ok(())
}
