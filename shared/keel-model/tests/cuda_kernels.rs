//! The CUDA kernels and graphs: the program compiles with NVRTC for the GPUs Keel targets
//! and the graph shim is built and loads (no GPU needed), loading kernels or capturing a
//! graph where there is no GPU is an error and never a panic, and on a GPU every kernel
//! matches its tch path in f32, bf16 and f16 and decoding with kernels and graphs matches
//! the tch path (skipped, and said so, elsewhere).

#![allow(clippy::unwrap_used)]

use keel_model::cuda::graph::{CudaGraph, GraphPool};
use keel_model::cuda::{Kernel, Kernels, compile};
use keel_model::model::decode::graph_buckets;
use tch::{Device, Kind};

#[test]
fn the_kernels_compile_with_nvrtc_for_ampere_and_hopper() {
    for arch in ["compute_80", "compute_90"] {
        let ptx = compile(arch).unwrap_or_else(|e| panic!("{arch}: {e}")).to_src();
        for kernel in ["rms_norm", "rotary", "silu_mul", "paged_decode", "paged_reduce"] {
            for dtype in ["f32", "bf16", "f16"] {
                let entry = format!(".entry keel_{kernel}_{dtype}(");
                assert!(ptx.contains(&entry), "{arch}: no {entry} in the PTX");
            }
        }
    }
}

#[test]
fn an_unknown_architecture_is_a_compile_error() {
    let error = compile("compute_1").unwrap_err().to_string();
    assert!(error.contains("do not compile"), "{error}");
}

#[test]
fn graphs_are_captured_at_1_2_4_8_and_multiples_of_8() {
    assert_eq!(graph_buckets(1), [1]);
    assert_eq!(graph_buckets(6), [1, 2, 4, 6]);
    assert_eq!(graph_buckets(8), [1, 2, 4, 8]);
    assert_eq!(graph_buckets(30), [1, 2, 4, 8, 16, 24, 30]);
    assert_eq!(graph_buckets(256).len(), 3 + 32);
}

#[test]
fn the_graph_shim_loads_and_without_a_gpu_a_capture_is_an_error() {
    keel_model::cuda::graph::available().expect("the CUDA graph shim is built against .venv's torch and loads");
    if gpu().is_some() {
        return;
    }
    // A pool id is a counter in libtorch: no GPU needed. Capturing needs one.
    let pool = GraphPool::new().expect("a graph pool id");
    let mut ran = false;
    let captured = CudaGraph::capture(Device::Cuda(0), &pool, || {
        ran = true;
        Ok(())
    });
    let error = captured.unwrap_err().to_string();
    assert!(error.contains("CUDA graph") && error.lines().count() == 1, "{error}");
    assert!(!ran, "nothing runs when the capture cannot start");
    let error = CudaGraph::capture(Device::Cpu, &pool, || Ok(())).unwrap_err().to_string();
    assert!(error.contains("need a CUDA device"), "{error}");
}

fn gpu() -> Option<Device> {
    let device = keel_model::device::parse_device("cuda").ok();
    if device.is_none() {
        eprintln!("skipped: no CUDA device on this machine");
    }
    device
}

#[test]
fn without_a_gpu_loading_is_an_error_not_a_panic() {
    assert!(Kernels::load(Device::Cpu, &[Kind::Float]).is_err());
    if gpu().is_none() {
        let error = Kernels::load(Device::Cuda(0), &[Kind::Float]).unwrap_err();
        assert!(error.to_string().contains("CUDA"), "{error}");
    }
}

#[test]
fn on_a_gpu_every_kernel_matches_its_tch_path() {
    let Some(device) = gpu() else { return };
    let kinds = [Kind::Float, Kind::BFloat16, Kind::Half];
    let kernels = Kernels::load(device, &kinds).unwrap();
    assert!(kernels.fallbacks().is_empty(), "kernels switched off: {:?}", kernels.fallbacks());
    for kernel in Kernel::ALL {
        for kind in kinds {
            assert!(kernels.runs(kernel, device, kind), "{kernel:?} on {kind:?}");
            assert!(!kernels.runs(kernel, Device::Cpu, kind), "never on the CPU");
        }
    }
}

/// A small Qwen3 shape (grouped-query heads of 64) for the GPU decoding tests.
fn small_qwen3() -> keel_model::ModelConfig {
    keel_model::ModelConfig::from_json(serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 1000, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
    }))
    .unwrap()
}

/// Greedy sequences and per-step logits of one path against another's: prints the fraction
/// of identical sequences and the largest logit difference; f32 must agree on every
/// sequence (logits within 1e-3). In bf16 identical greedy sequences decide nothing (a near
/// tie flips with any change of summation order): the logprob errors below decide.
fn agree(kind: Kind, what: &str, got: (&[Vec<i64>], &[tch::Tensor]), want: (&[Vec<i64>], &[tch::Tensor])) {
    let total = want.0.len();
    let same = got.0.iter().zip(want.0).filter(|(g, w)| g == w).count();
    let worst = got.1.iter().zip(want.1).map(|(g, w)| (g - w).abs().max().double_value(&[])).fold(0.0, f64::max);
    eprintln!("{kind:?} {what}: {same}/{total} identical greedy sequences; largest logit difference {worst:e}");
    if kind == Kind::Float {
        assert_eq!(same, total, "{what}: f32 greedy decoding must not change");
        assert!(worst < 1e-3, "{what}: f32 logits differ by {worst:e}");
    }
}

/// Greedy decoding of 200 prompts on a small random Qwen3 with kernels, against the tch
/// path on the same GPU: the fraction of identical sequences and the largest logit
/// difference are printed; f32 must agree on every sequence.
#[test]
fn on_a_gpu_greedy_decoding_with_kernels_equals_the_tch_path() {
    use keel_model::{BLOCK_SIZE, CausalLm, Init, PagedCache, SeqChunk};
    let Some(device) = gpu() else { return };
    let cfg = small_qwen3();
    for kind in [Kind::Float, Kind::BFloat16] {
        tch::manual_seed(3);
        let mut model = CausalLm::new(cfg.clone(), device, kind, Init::Random { std: 0.2 }).unwrap();
        let (prompts, new_tokens) = (200usize, 24usize);
        let decode = |model: &CausalLm| -> (Vec<Vec<i64>>, Vec<tch::Tensor>) {
            let per_seq = (40 + new_tokens).div_ceil(BLOCK_SIZE);
            let mut cache = PagedCache::new(&cfg, prompts * per_seq, kind, device).unwrap();
            let tables: Vec<Vec<u32>> =
                (0..prompts).map(|p| (0..per_seq).map(|b| (p * per_seq + b) as u32).collect()).collect();
            let mut seqs: Vec<Vec<i64>> =
                (0..prompts).map(|p| (0..(8 + p % 32)).map(|i| ((p * 131 + i * 17) % 1000) as i64).collect()).collect();
            let mut logits_seen = Vec::new();
            let mut context = vec![0usize; prompts];
            for _ in 0..new_tokens {
                let chunks: Vec<SeqChunk> = (0..prompts)
                    .map(|p| SeqChunk {
                        tokens: seqs[p][context[p]..].to_vec(),
                        context: context[p],
                        blocks: tables[p].clone(),
                        logits: true,
                    })
                    .collect();
                let logits = model.forward_paged(&chunks, &mut cache).unwrap();
                let next = Vec::<i64>::try_from(logits.argmax(-1, false).to_device(Device::Cpu)).unwrap();
                for p in 0..prompts {
                    context[p] = seqs[p].len();
                    seqs[p].push(next[p]);
                }
                logits_seen.push(logits.to_kind(Kind::Float).to_device(Device::Cpu));
            }
            (seqs, logits_seen)
        };
        let (want, want_logits) = decode(&model);
        let kernels = Kernels::load(device, &[kind]).unwrap();
        assert!(kernels.fallbacks().is_empty(), "{:?}", kernels.fallbacks());
        model.use_kernels(std::sync::Arc::new(kernels));
        let (got, got_logits) = decode(&model);
        agree(kind, "kernels", (&got, &got_logits), (&want, &want_logits));
    }
}

/// On a GPU, decode steps replayed from CUDA graphs (rows padded to their bucket) give the
/// tokens and logits of the eager step with the same kernels; the fraction of identical
/// greedy sequences is printed.
#[test]
fn on_a_gpu_graph_replays_equal_eager_decoding() {
    use keel_model::{BLOCK_SIZE, CausalLm, DecodeGraphs, Init, PagedCache, SeqChunk};
    let Some(device) = gpu() else { return };
    let cfg = small_qwen3();
    for kind in [Kind::Float, Kind::BFloat16] {
        tch::manual_seed(5);
        let mut model = CausalLm::new(cfg.clone(), device, kind, Init::Random { std: 0.2 }).unwrap();
        model.use_kernels(std::sync::Arc::new(Kernels::load(device, &[kind]).unwrap()));
        let (prompts, new_tokens, max_len) = (19usize, 16usize, 128usize);
        let width = max_len.div_ceil(BLOCK_SIZE);
        let mut cache = PagedCache::new(&cfg, 2 * prompts * width, kind, device).unwrap();
        let mut graphs = DecodeGraphs::capture(&model, &mut cache, 24, width).unwrap();
        assert_eq!(graphs.buckets(), [1, 2, 4, 8, 16, 24]);
        let decode = |model: &CausalLm, cache: &mut PagedCache, graphs: Option<&mut DecodeGraphs>, offset: usize| {
            let tables: Vec<Vec<u32>> =
                (0..prompts).map(|p| (0..width).map(|b| ((offset + p) * width + b) as u32).collect()).collect();
            let mut seqs: Vec<Vec<i64>> =
                (0..prompts).map(|p| (0..(5 + p * 3)).map(|i| ((p * 71 + i * 13) % 1000) as i64).collect()).collect();
            let prefill: Vec<SeqChunk> = seqs
                .iter()
                .zip(&tables)
                .map(|(s, t)| SeqChunk { tokens: s.clone(), context: 0, blocks: t.clone(), logits: true })
                .collect();
            let first = model.forward_paged(&prefill, cache).unwrap().argmax(-1, false).to_device(Device::Cpu);
            for (s, t) in seqs.iter_mut().zip(Vec::<i64>::try_from(first).unwrap()) {
                s.push(t);
            }
            let mut graphs = graphs;
            let mut all_logits = Vec::new();
            for _ in 1..new_tokens {
                let chunks: Vec<SeqChunk> = seqs
                    .iter()
                    .zip(&tables)
                    .map(|(s, t)| SeqChunk {
                        tokens: vec![s[s.len() - 1]],
                        context: s.len() - 1,
                        blocks: t.clone(),
                        logits: true,
                    })
                    .collect();
                let logits = match graphs.as_deref_mut() {
                    Some(g) => g.run(model, &chunks, cache).unwrap(),
                    None => model.forward_paged(&chunks, cache).unwrap(),
                };
                let logits = logits.to_kind(Kind::Float).to_device(Device::Cpu);
                for (s, t) in seqs.iter_mut().zip(Vec::<i64>::try_from(logits.argmax(-1, false)).unwrap()) {
                    s.push(t);
                }
                all_logits.push(logits);
            }
            (seqs, all_logits)
        };
        let (want, want_logits) = decode(&model, &mut cache, None, 0);
        let (got, got_logits) = decode(&model, &mut cache, Some(&mut graphs), prompts);
        agree(kind, "graphs", (&got, &got_logits), (&want, &want_logits));
    }
}

/// Per-token logprob errors of one decoding path against the f32 reference: the mean, the
/// 99th percentile and the largest |logprob − reference logprob| over every scored token.
#[derive(Debug, Clone, Copy)]
struct Errors {
    mean: f64,
    p99: f64,
    max: f64,
}

impl Errors {
    fn of(got: &[f64], want: &[f64]) -> Self {
        assert_eq!(got.len(), want.len());
        let mut errors: Vec<f64> = got.iter().zip(want).map(|(g, w)| (g - w).abs()).collect();
        assert!(errors.iter().all(|e| e.is_finite()), "a logprob is not finite");
        errors.sort_by(f64::total_cmp);
        let mean = errors.iter().sum::<f64>() / errors.len() as f64;
        let p99 = errors[(errors.len() * 99 / 100).min(errors.len() - 1)];
        Self { mean, p99, max: errors[errors.len() - 1] }
    }

    /// Within the tch path's own error: a kernel whose error is no larger than the error the
    /// dtype already costs (a little slack: the two paths round differently, not worse).
    fn within(&self, tch: &Errors) -> bool {
        self.mean <= 1.25 * tch.mean + 1e-4 && self.p99 <= 1.5 * tch.p99 + 1e-3
    }
}

/// A language a model can learn in seconds and then predicts with confidence, as a trained
/// model does (not the near-uniform distributions of random weights): each token is followed
/// by one of three successors of its own, with probabilities 0.7, 0.2 and 0.1.
/// Drawn from tch's generator, which the test seeds.
fn bigram_text(vocab: i64, len: usize) -> Vec<i64> {
    let mut text = vec![tch::Tensor::randint(vocab, [1], (Kind::Int64, Device::Cpu)).int64_value(&[0])];
    let draws = Vec::<f64>::try_from(tch::Tensor::rand([len as i64], (Kind::Double, Device::Cpu))).unwrap();
    for u in &draws[1..] {
        let t = text[text.len() - 1];
        let pick = if *u < 0.7 {
            0
        } else if *u < 0.9 {
            1
        } else {
            2
        };
        text.push((t * 37 + 11 + pick * 101) % vocab);
    }
    text
}

/// Trains `model` (f32) on [`bigram_text`] with AdamW until its loss is near the language's
/// entropy (0.8 nats); returns the last loss.
fn train_on_bigrams(model: &keel_model::CausalLm, steps: usize) -> f64 {
    use tch::nn::OptimizerConfig;
    let vocab = model.config().vocab_size;
    let device = model.device();
    let mut optimiser = tch::nn::AdamW::default().build(model.var_store(), 1e-2).unwrap();
    let (batch, len) = (32usize, 64usize);
    let mut loss_value = f64::NAN;
    for step in 0..steps {
        let ids: Vec<i64> = (0..batch).flat_map(|_| bigram_text(vocab, len)).collect();
        let ids = tch::Tensor::from_slice(&ids).view([batch as i64, len as i64]).to_device(device);
        let logprobs = model.token_logprobs(&ids, &vec![len as i64; batch], 1.0).unwrap();
        let loss = -logprobs.sum(Kind::Float) / (batch * (len - 1)) as f64;
        optimiser.backward_step(&loss);
        loss_value = loss.double_value(&[]);
        if step % 50 == 0 {
            eprintln!("training step {step}: loss {loss_value:.3}");
        }
    }
    loss_value
}

/// Teacher-forced logprobs through the paged cache, as the generator computes them: every
/// sequence's first `prompts[p]` tokens prefilled in one pass, then one token per sequence
/// per step (decode attention; graph replays with `graphs`). With `sample`, the next tokens
/// are drawn from the model (f32 softmax) and appended to `seqs`; otherwise `seqs` already
/// hold them. Returns the logprob of every token after the prompts, step by step.
fn forced_logprobs(
    model: &keel_model::CausalLm,
    graphs: Option<&mut keel_model::DecodeGraphs>,
    cache: &mut keel_model::PagedCache,
    seqs: &mut [Vec<i64>],
    prompts: &[usize],
    new_tokens: usize,
    sample: bool,
) -> Vec<f64> {
    use keel_model::{BLOCK_SIZE, SeqChunk};
    let width = (prompts.iter().max().unwrap() + new_tokens).div_ceil(BLOCK_SIZE);
    let tables: Vec<Vec<u32>> = (0..seqs.len()).map(|p| (0..width).map(|b| (p * width + b) as u32).collect()).collect();
    let mut graphs = graphs;
    let mut logprobs = Vec::new();
    for step in 0..new_tokens {
        let chunks: Vec<SeqChunk> = (0..seqs.len())
            .map(|p| {
                let (start, end) = if step == 0 { (0, prompts[p]) } else { (prompts[p] + step - 1, prompts[p] + step) };
                SeqChunk {
                    tokens: seqs[p][start..end].to_vec(),
                    context: start,
                    blocks: tables[p].clone(),
                    logits: true,
                }
            })
            .collect();
        let logits = match graphs.as_deref_mut() {
            Some(g) if step > 0 => g.run(model, &chunks, cache).unwrap(),
            _ => model.forward_paged(&chunks, cache).unwrap(),
        };
        let dist = logits.log_softmax(-1, Kind::Float);
        if sample {
            let next = Vec::<i64>::try_from(dist.exp().multinomial(1, true).view([-1]).to_device(Device::Cpu)).unwrap();
            for (s, t) in seqs.iter_mut().zip(next) {
                s.push(t);
            }
        }
        let targets: Vec<i64> = (0..seqs.len()).map(|p| seqs[p][prompts[p] + step]).collect();
        let targets = tch::Tensor::from_slice(&targets).to_device(dist.device()).unsqueeze(-1);
        let chosen = dist.gather(-1, &targets, false).view([-1]).to_kind(Kind::Double).to_device(Device::Cpu);
        logprobs.extend(Vec::<f64>::try_from(chosen).unwrap());
    }
    logprobs
}

/// What decides whether the kernels are right in bf16: the per-token logprob error of each
/// decoding path against an f32 reference (the tch path in f32, same weights, same device),
/// over sequences sampled from the model itself, on random weights (near-uniform
/// distributions, where greedy argmax flips on any rounding) and on a model trained until it
/// predicts with confidence. The kernels (and, on a GPU, graph replays) pass when their
/// error is within the tch bf16 path's own error; in f32 they must equal the reference.
/// Prints one markdown row per path. On a machine without a GPU the same check runs on the
/// CPU's tch paths (and says the kernels were skipped).
#[test]
fn bf16_logprob_error_of_the_kernels_is_within_the_tch_paths() {
    use keel_model::{CausalLm, DecodeGraphs, Init, PagedCache};
    let device = keel_model::device::parse_device("cuda").ok();
    let on_gpu = device.is_some();
    let device = device.unwrap_or(Device::Cpu);
    let cfg = small_qwen3();
    let (sequences, new_tokens, train_steps) = if on_gpu { (200usize, 32usize, 300usize) } else { (12, 8, 150) };
    if !on_gpu {
        eprintln!("skipped: the kernels and graph replays (no CUDA device); the tch paths are checked on the CPU");
    }
    println!("| weights | path | tokens | mean abs error | p99 | max | reference mean logprob |");
    println!("|---|---|---|---|---|---|---|");
    for weights in ["random", "trained"] {
        tch::manual_seed(11);
        let mut model = CausalLm::new(cfg.clone(), device, Kind::Float, Init::Random { std: 0.2 }).unwrap();
        if weights == "trained" {
            let loss = train_on_bigrams(&model, train_steps);
            eprintln!("trained on bigrams: loss {loss:.3} nats (the language's entropy is 0.80)");
            assert!(loss.is_finite());
        }
        let prompts: Vec<usize> = (0..sequences).map(|p| 8 + p % 24).collect();
        let mut seqs: Vec<Vec<i64>> = prompts.iter().map(|&n| bigram_text(cfg.vocab_size, n)).collect();
        let blocks = |n: usize| n * (30 + new_tokens).div_ceil(keel_model::BLOCK_SIZE) + 1;
        let mut cache = PagedCache::new(&cfg, blocks(sequences), Kind::Float, device).unwrap();
        tch::manual_seed(13);
        let reference = forced_logprobs(&model, None, &mut cache, &mut seqs, &prompts, new_tokens, true);
        let reference_mean = reference.iter().sum::<f64>() / reference.len() as f64;
        let row = |path: &str, errors: Errors| {
            println!(
                "| {weights} | {path} | {} | {:.2e} | {:.2e} | {:.2e} | {reference_mean:.3} |",
                reference.len(),
                errors.mean,
                errors.p99,
                errors.max
            );
        };
        // Every path scores the same tokens: no greedy divergence to account for.
        let mut run = |model: &CausalLm, graphs: bool| {
            let mut cache = PagedCache::new(&cfg, blocks(sequences), model.kind(), device).unwrap();
            let mut graphs = graphs.then(|| {
                let width = (30 + new_tokens).div_ceil(keel_model::BLOCK_SIZE);
                DecodeGraphs::capture(model, &mut cache, sequences, width).unwrap()
            });
            let got = forced_logprobs(model, graphs.as_mut(), &mut cache, &mut seqs, &prompts, new_tokens, false);
            Errors::of(&got, &reference)
        };
        if on_gpu {
            let kernels = std::sync::Arc::new(Kernels::load(device, &[Kind::Float, Kind::BFloat16]).unwrap());
            assert!(kernels.fallbacks().is_empty(), "{:?}", kernels.fallbacks());
            model.use_kernels(kernels.clone());
            let f32_kernels = run(&model, false);
            row("f32 kernels", f32_kernels);
            let f32_graphs = run(&model, true);
            row("f32 kernels + graphs", f32_graphs);
            assert!(f32_kernels.max < 1e-3 && f32_graphs.max < 1e-3, "{weights}: f32 kernels change logprobs");
            // The tch path in bf16: a model without kernels, same weights.
            let mut tch_model = CausalLm::new(cfg.clone(), device, Kind::Float, Init::Random { std: 0.2 }).unwrap();
            tch_model.var_store_mut().copy(model.var_store()).unwrap();
            tch_model.set_kind(Kind::BFloat16).unwrap();
            let tch_bf16 = run(&tch_model, false);
            row("bf16 tch", tch_bf16);
            model.set_kind(Kind::BFloat16).unwrap();
            let bf16_kernels = run(&model, false);
            row("bf16 kernels", bf16_kernels);
            let bf16_graphs = run(&model, true);
            row("bf16 kernels + graphs", bf16_graphs);
            for (path, errors) in [("kernels", bf16_kernels), ("kernels + graphs", bf16_graphs)] {
                assert!(
                    errors.within(&tch_bf16),
                    "{weights}: bf16 {path}: {errors:?} is outside the tch path's {tch_bf16:?}"
                );
            }
        } else {
            model.set_kind(Kind::BFloat16).unwrap();
            let tch_bf16 = run(&model, false);
            row("bf16 tch", tch_bf16);
            // bf16 keeps 8 bits of mantissa: a logprob moves by a few hundredths, not more.
            assert!(tch_bf16.mean < 0.1, "{weights}: bf16 on the CPU: {tch_bf16:?}");
        }
    }
}
