//! `keel generate serve-bench`: a load generator for an OpenAI-compatible `/v1/completions`
//! endpoint, measured the way `vllm bench serve` measures a server. Prompts are random token
//! ids of a fixed length, every request asks for a fixed number of new tokens (greedy,
//! `ignore_eos`, streamed with a usage chunk), and requests arrive as a Poisson process at
//! `--request-rate` or all at once. It prints one JSON line: requests/s, output tokens/s, and
//! time to first token (TTFT), time per output token after the first (TPOT) and inter-token
//! latency (ITL) as mean, median and p99 in milliseconds.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};
use tokio::sync::Semaphore;

#[derive(Debug, Args)]
pub struct ServeBenchArgs {
    /// The server's base URL, e.g. http://127.0.0.1:8000.
    #[arg(long)]
    url: String,
    /// The server's API key, sent as `Authorization: Bearer <key>` (a Keel generator's
    /// `api_key`, vLLM's `--api-key`).
    #[arg(long, env = "KEEL_GENERATOR_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The served model's name (default: the first one `/v1/models` lists).
    #[arg(long)]
    model: Option<String>,
    /// Prompt token ids are drawn uniformly from 0..VOCAB_SIZE (the tokenizer's size).
    #[arg(long)]
    vocab_size: i64,
    /// Tokens per prompt.
    #[arg(long, default_value_t = 512)]
    input_len: usize,
    /// New tokens per request (always all of them: `ignore_eos`).
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    #[arg(long, default_value_t = 500)]
    num_prompts: usize,
    /// Requests per second, arriving as a Poisson process; `inf` sends every request at once.
    #[arg(long, default_value_t = f64::INFINITY)]
    request_rate: f64,
    /// At most this many requests in flight (default: no limit).
    #[arg(long)]
    max_concurrency: Option<usize>,
    /// Seeds the prompts and the arrival times.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Writes the prompts here as JSON (a list of token-id lists), for a reference run on
    /// the same prompts.
    #[arg(long)]
    save_prompts: Option<PathBuf>,
}

/// What one request saw.
#[derive(Debug, Default)]
struct Outcome {
    ttft: f64,
    latency: f64,
    output_tokens: usize,
    /// Gaps between successive chunks after the first.
    itl: Vec<f64>,
}

pub fn run(args: ServeBenchArgs) -> anyhow::Result<()> {
    check(&args)?;
    let prompts = prompts(&args);
    if let Some(path) = &args.save_prompts {
        std::fs::write(path, serde_json::to_vec(&prompts)?).with_context(|| format!("writing {}", path.display()))?;
    }
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(serve_bench(args, prompts))
}

fn check(args: &ServeBenchArgs) -> anyhow::Result<()> {
    if args.vocab_size < 1 || args.input_len < 1 || args.output_len < 1 || args.num_prompts < 1 {
        bail!("--vocab-size, --input-len, --output-len and --num-prompts must be at least 1");
    }
    if args.request_rate.is_nan() || args.request_rate <= 0.0 {
        bail!("--request-rate must be above 0 (or inf), not {}", args.request_rate);
    }
    if args.max_concurrency == Some(0) {
        bail!("--max-concurrency must be at least 1");
    }
    Ok(())
}

fn prompts(args: &ServeBenchArgs) -> Vec<Vec<i64>> {
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    (0..args.num_prompts).map(|_| (0..args.input_len).map(|_| rng.random_range(0..args.vocab_size)).collect()).collect()
}

/// Seconds after the start at which each request is sent.
fn arrivals(count: usize, rate: f64, seed: u64) -> Vec<f64> {
    if rate.is_infinite() {
        return vec![0.0; count];
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_a771);
    let mut at = 0.0;
    (0..count)
        .map(|_| {
            let now = at;
            // Exponential gaps: -ln(U) / rate with U in (0, 1].
            at += -(1.0f64 - rng.random::<f64>()).ln() / rate;
            now
        })
        .collect()
}

async fn serve_bench(args: ServeBenchArgs, prompts: Vec<Vec<i64>>) -> anyhow::Result<()> {
    let base = args.url.trim_end_matches('/').to_string();
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(key) = &args.api_key {
        let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}"))
            .context("--api-key: not a valid header value")?;
        value.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    let client = reqwest::Client::builder().pool_max_idle_per_host(4096).default_headers(headers).build()?;
    let model = match &args.model {
        Some(model) => model.clone(),
        None => served_model(&client, &base).await?,
    };
    let limit = Arc::new(Semaphore::new(args.max_concurrency.unwrap_or(Semaphore::MAX_PERMITS)));
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (prompt, at) in prompts.into_iter().zip(arrivals(args.num_prompts, args.request_rate, args.seed)) {
        tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
        let permit = limit.clone().acquire_owned().await?;
        let body = json!({
            "model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0,
            "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true},
        });
        let (client, url) = (client.clone(), format!("{base}/v1/completions"));
        tasks.spawn(async move {
            let outcome = one_request(&client, &url, &body).await;
            drop(permit);
            outcome
        });
    }
    let mut outcomes = Vec::new();
    let mut failures = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined? {
            Ok(outcome) => outcomes.push(outcome),
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    let duration = start.elapsed().as_secs_f64();
    if let Some(first) = failures.first() {
        if outcomes.is_empty() {
            bail!("every request failed; the first: {first}");
        }
        eprintln!("{} of {} requests failed; the first: {first}", failures.len(), args.num_prompts);
    }
    println!("{}", summary(&args, &outcomes, failures.len(), duration));
    Ok(())
}

async fn served_model(client: &reqwest::Client, base: &str) -> anyhow::Result<String> {
    let models: Value = client.get(format!("{base}/v1/models")).send().await?.error_for_status()?.json().await?;
    models["data"][0]["id"].as_str().map(str::to_string).with_context(|| format!("{base}/v1/models lists no model"))
}

/// Sends one streamed completion and times its chunks.
async fn one_request(client: &reqwest::Client, url: &str, body: &Value) -> anyhow::Result<Outcome> {
    let sent = Instant::now();
    let mut response = client.post(url).json(body).send().await?;
    if !response.status().is_success() {
        let status = response.status();
        bail!("{status}: {}", response.text().await.unwrap_or_default());
    }
    let mut outcome = Outcome::default();
    let mut last: Option<Instant> = None;
    let mut pending = Vec::new();
    while let Some(bytes) = response.chunk().await? {
        pending.extend_from_slice(&bytes);
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            let Some(data) = std::str::from_utf8(&event)?.trim().strip_prefix("data:") else { continue };
            let data = data.trim();
            if data == "[DONE]" {
                continue;
            }
            let chunk: Value = serde_json::from_str(data).with_context(|| format!("a stream chunk: {data}"))?;
            if let Some(error) = chunk.get("error") {
                bail!("the stream failed: {error}");
            }
            if let Some(tokens) = chunk["usage"]["completion_tokens"].as_u64() {
                outcome.output_tokens = tokens as usize;
            }
            if chunk["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                let now = Instant::now();
                match last {
                    None => outcome.ttft = (now - sent).as_secs_f64(),
                    Some(previous) => outcome.itl.push((now - previous).as_secs_f64()),
                }
                last = Some(now);
            }
        }
    }
    outcome.latency = sent.elapsed().as_secs_f64();
    if last.is_none() {
        bail!("the stream ended without a token");
    }
    if outcome.output_tokens == 0 {
        bail!("the stream had no usage chunk (stream_options.include_usage)");
    }
    Ok(outcome)
}

/// Mean, median and 99th percentile in milliseconds.
fn stats(mut values: Vec<f64>) -> Value {
    if values.is_empty() {
        return json!({"mean_ms": null, "median_ms": null, "p99_ms": null});
    }
    values.sort_by(f64::total_cmp);
    let at = |q: f64| {
        // Linear interpolation between closest ranks, as numpy's default percentile.
        let pos = q * (values.len() - 1) as f64;
        let (low, high) = (pos.floor() as usize, pos.ceil() as usize);
        values[low] + (values[high] - values[low]) * (pos - low as f64)
    };
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    json!({"mean_ms": mean * 1e3, "median_ms": at(0.5) * 1e3, "p99_ms": at(0.99) * 1e3})
}

fn summary(args: &ServeBenchArgs, outcomes: &[Outcome], failed: usize, duration: f64) -> Value {
    let output: usize = outcomes.iter().map(|o| o.output_tokens).sum();
    let tpot = outcomes
        .iter()
        .filter(|o| o.output_tokens > 1)
        .map(|o| (o.latency - o.ttft) / (o.output_tokens - 1) as f64)
        .collect();
    json!({
        "engine": "keel-serve-bench", "url": args.url, "input_len": args.input_len, "output_len": args.output_len,
        "num_prompts": args.num_prompts,
        "request_rate": if args.request_rate.is_infinite() { json!("inf") } else { json!(args.request_rate) },
        "max_concurrency": args.max_concurrency, "completed": outcomes.len(), "failed": failed,
        "duration_s": duration, "requests_per_s": outcomes.len() as f64 / duration,
        "output_tokens": output, "output_tokens_per_s": output as f64 / duration,
        "total_tokens_per_s": (output + outcomes.len() * args.input_len) as f64 / duration,
        "ttft": stats(outcomes.iter().map(|o| o.ttft).collect()), "tpot": stats(tpot),
        "itl": stats(outcomes.iter().flat_map(|o| o.itl.iter().copied()).collect()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_arrivals_have_the_asked_rate_and_inf_sends_at_once() {
        assert_eq!(arrivals(5, f64::INFINITY, 1), vec![0.0; 5]);
        let at = arrivals(20_000, 16.0, 3);
        assert!(at.windows(2).all(|w| w[1] >= w[0]), "arrival times only grow");
        let rate = (at.len() - 1) as f64 / at[at.len() - 1];
        // 20,000 exponential gaps: the mean gap's relative standard error is under 1%.
        assert!((rate - 16.0).abs() < 0.05 * 16.0, "measured rate {rate}");
        assert_eq!(at, arrivals(20_000, 16.0, 3), "seeded");
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let s = stats((1..=101).map(|v| v as f64 / 1e3).collect());
        assert!((s["median_ms"].as_f64().unwrap_or_default() - 51.0).abs() < 1e-9);
        assert!((s["p99_ms"].as_f64().unwrap_or_default() - 100.0).abs() < 1e-9);
        let s = stats(vec![0.001, 0.002]);
        assert!((s["median_ms"].as_f64().unwrap_or_default() - 1.5).abs() < 1e-9);
        assert!((s["p99_ms"].as_f64().unwrap_or_default() - 1.99).abs() < 1e-9);
        assert!(stats(Vec::new())["mean_ms"].is_null());
    }
}
