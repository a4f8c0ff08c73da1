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
/// sequence (logits within 1e-3), bf16 on at least 90% (ties may flip).
fn agree(kind: Kind, what: &str, got: (&[Vec<i64>], &[tch::Tensor]), want: (&[Vec<i64>], &[tch::Tensor])) {
    let total = want.0.len();
    let same = got.0.iter().zip(want.0).filter(|(g, w)| g == w).count();
    let worst = got.1.iter().zip(want.1).map(|(g, w)| (g - w).abs().max().double_value(&[])).fold(0.0, f64::max);
    eprintln!("{kind:?} {what}: {same}/{total} identical greedy sequences; largest logit difference {worst:e}");
    if kind == Kind::Float {
        assert_eq!(same, total, "{what}: f32 greedy decoding must not change");
        assert!(worst < 1e-3, "{what}: f32 logits differ by {worst:e}");
    } else {
        assert!(same * 10 >= total * 9, "{what}: bf16: only {same}/{total} identical");
    }
}

/// Greedy decoding of 200 prompts on a small random Qwen3 with kernels, against the tch
/// path on the same GPU: the fraction of identical sequences (bf16 ties aside) and the
/// largest logit difference are printed; f32 must agree on every sequence.
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
