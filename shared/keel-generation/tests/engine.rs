//! The scheduler on a small random model: preemption and recomputation, shared and cached
//! prefixes, chunked prefill and batch composition never change what a seeded request
//! produces; a pool too small for one sequence is refused at start-up.

#![allow(clippy::unwrap_used)]

use std::sync::atomic::Ordering;

use keel_generation::engine::{Engine, EngineConfig, RefitMode};
use keel_generation::request::{Event, GenRequest};
use keel_model::sampling::SamplingParams;
use keel_model::{BLOCK_SIZE, CausalLm, Init, ModelConfig};
use tch::{Device, Kind};

fn model() -> CausalLm {
    model_of("Qwen3ForCausalLM", serde_json::json!({}))
}

/// A small random model of `architecture`, with `extra` config fields.
fn model_of(architecture: &str, extra: serde_json::Value) -> CausalLm {
    let mut value = serde_json::json!({
        "architectures": [architecture], "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 97, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    });
    value.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let cfg = ModelConfig::from_json(value).unwrap();
    tch::manual_seed(11);
    CausalLm::new(cfg, Device::Cpu, Kind::Float, Init::Random { std: 0.5 }).unwrap()
}

fn engine(blocks: usize, max_num_seqs: usize, max_num_batched_tokens: usize) -> Engine {
    engine_with(model(), blocks, max_num_seqs, max_num_batched_tokens)
}

fn engine_with(model: CausalLm, blocks: usize, max_num_seqs: usize, max_num_batched_tokens: usize) -> Engine {
    let config = EngineConfig {
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len: 96,
        refit_mode: RefitMode::Drain,
        model_name: "tiny".into(),
    };
    Engine::start(model, None, blocks, config).unwrap()
}

fn request(prompt: Vec<i64>, n: usize, seed: u64, max_tokens: usize) -> GenRequest {
    GenRequest {
        prompt,
        n,
        max_tokens,
        sampling: SamplingParams { temperature: 1.0, top_p: 0.95, top_k: None, min_p: 0.0, seed },
        stop_token_ids: Vec::new(),
        stop: Vec::new(),
        include_stop_str_in_output: false,
        top_logprobs: 2,
        min_tokens: 0,
        guide: None,
        logit_bias: Vec::new(),
    }
}

fn prompt(len: usize, salt: i64) -> Vec<i64> {
    (0..len as i64).map(|i| (i * 31 + salt * 7 + 3) % 97).collect()
}

/// Tokens and logprobs of every sample of every request, all submitted at once.
type Outputs = Vec<Vec<(Vec<i64>, Vec<f32>)>>;

fn run(engine: &Engine, requests: Vec<GenRequest>) -> Outputs {
    let receivers: Vec<_> = requests
        .into_iter()
        .map(|r| {
            let n = r.n;
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            engine.submit(r, tx).unwrap();
            (rx, n)
        })
        .collect();
    receivers
        .into_iter()
        .map(|(mut rx, n)| {
            let mut samples = vec![(Vec::new(), Vec::new()); n];
            let mut finished = 0;
            while let Some(event) = rx.blocking_recv() {
                match event {
                    Event::Token(t) => {
                        samples[t.index].0.push(t.token);
                        samples[t.index].1.push(t.logprob);
                    }
                    Event::Finished { .. } => finished += 1,
                    Event::Failed(message) => panic!("generation failed: {message}"),
                }
            }
            assert_eq!(finished, n, "every sample finishes");
            samples
        })
        .collect()
}

fn assert_same(got: &Outputs, want: &Outputs, what: &str) {
    for (r, (g, w)) in got.iter().zip(want).enumerate() {
        for (s, (gs, ws)) in g.iter().zip(w).enumerate() {
            assert_eq!(gs.0, ws.0, "{what}: request {r} sample {s} tokens differ");
            let worst = gs.1.iter().zip(&ws.1).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(worst <= 1e-4, "{what}: request {r} sample {s} logprobs differ by {worst:e}");
        }
    }
}

fn requests() -> Vec<GenRequest> {
    vec![
        request(prompt(40, 1), 3, 5, 40),
        request(prompt(7, 2), 1, 9, 60),
        request(prompt(23, 3), 2, 13, 50),
        request(prompt(60, 4), 1, 17, 30),
    ]
}

/// With a pool that holds one full sequence, samples are preempted and recomputed, and
/// still produce what they produce with room for all.
#[test]
fn preempted_samples_produce_what_unpreempted_ones_do() {
    let roomy = engine(256, 16, 8192);
    let want = run(&roomy, requests());
    assert_eq!(roomy.stats.preemptions.load(Ordering::Relaxed), 0);
    let tight = engine(96 / BLOCK_SIZE, 16, 8192);
    let got = run(&tight, requests());
    assert!(tight.stats.preemptions.load(Ordering::Relaxed) > 0, "the small pool preempted");
    assert_same(&got, &want, "preempted");
    assert_eq!(tight.stats.blocks_used.load(Ordering::Relaxed), 0, "every block is let go");
}

/// Prompt chunks of 5 tokens per step give what whole prefills give.
#[test]
fn chunked_prefill_equals_whole_prefill() {
    let want = run(&engine(256, 16, 8192), requests());
    let chunked = engine(256, 16, 5);
    assert_same(&run(&chunked, requests()), &want, "chunked");
    let steps = chunked.stats.steps.load(Ordering::Relaxed);
    let tokens = chunked.stats.step_tokens.load(Ordering::Relaxed);
    assert!(tokens <= 5 * steps, "no step computed more than its budget: {tokens} tokens in {steps} steps");
}

/// The n samples of a request (sharing its prompt's blocks) and a request whose prompt is
/// found in the prefix cache produce what separate, uncached requests with the same seeds
/// produce.
#[test]
fn shared_and_cached_prefixes_equal_uncached_requests() {
    let shared_prompt = prompt(45, 8);
    let separate: Vec<GenRequest> = (0..3).map(|i| request(shared_prompt.clone(), 1, 21 + i, 30)).collect::<Vec<_>>();
    // One request at a time on engines that never saw the prompt: nothing is shared.
    let want: Vec<_> = separate.into_iter().map(|r| run(&engine(256, 16, 8192), vec![r]).remove(0).remove(0)).collect();
    let engine = engine(256, 16, 8192);
    let forked = run(&engine, vec![request(shared_prompt.clone(), 3, 21, 30)]).remove(0);
    assert_same(&vec![forked], &vec![want.clone()], "forked samples");
    let hits = engine.stats.prefix_hits.load(Ordering::Relaxed);
    let cached = run(&engine, vec![request(shared_prompt, 3, 21, 30)]).remove(0);
    assert_same(&vec![cached], &vec![want], "prefix-cached");
    let after = engine.stats.prefix_hits.load(Ordering::Relaxed);
    assert_eq!(after - hits, 2, "the prompt's two full blocks came from the cache");
}

/// For every family that is configuration of the one decoder (windows shorter than the
/// prompts, soft-caps, partial and interleaved rotary, NoPE layers, multipliers): a prompt
/// found in the prefix cache, chunked prefill, preemption and recomputation, and other requests
/// in the batch leave each seeded request's tokens and logprobs as they are alone.
#[test]
fn every_family_serves_the_same_with_prefix_hits_chunks_preemption_and_company() {
    let families = [
        (
            "Gemma2ForCausalLM",
            serde_json::json!({"sliding_window": 9, "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 4.0, "query_pre_attn_scalar": 20}),
        ),
        (
            "Gemma3ForCausalLM",
            serde_json::json!({"sliding_window": 9, "rope_local_base_freq": 100.0,
            "layer_types": ["sliding_attention", "full_attention"]}),
        ),
        (
            "Phi3ForCausalLM",
            serde_json::json!({"partial_rotary_factor": 0.5, "original_max_position_embeddings": 200,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [2.0, 3.0, 4.0, 5.0]}}),
        ),
        (
            "Olmo3ForCausalLM",
            serde_json::json!({"sliding_window": 9, "layer_types": ["sliding_attention", "full_attention"]}),
        ),
        ("Glm4ForCausalLM", serde_json::json!({})),
        (
            "GraniteForCausalLM",
            serde_json::json!({"embedding_multiplier": 6.0, "residual_multiplier": 0.5,
            "attention_multiplier": 0.1, "logits_scaling": 4.0}),
        ),
        ("SmolLM3ForCausalLM", serde_json::json!({"no_rope_layer_interval": 2})),
    ];
    for (architecture, extra) in families {
        let make = |blocks, tokens| engine_with(model_of(architecture, extra.clone()), blocks, 16, tokens);
        let alone: Vec<_> = requests().into_iter().map(|r| run(&make(256, 8192), vec![r]).remove(0)).collect();
        assert_same(&run(&make(256, 8192), requests()), &alone, &format!("{architecture}, batched"));
        assert_same(&run(&make(256, 5), requests()), &alone, &format!("{architecture}, chunked"));
        let tight = make(96 / BLOCK_SIZE, 8192);
        assert_same(&run(&tight, requests()), &alone, &format!("{architecture}, preempted"));
        assert!(tight.stats.preemptions.load(Ordering::Relaxed) > 0, "{architecture}: the small pool preempted");
        let cached = make(256, 8192);
        let first = run(&cached, vec![requests().remove(0)]);
        let hits = cached.stats.prefix_hits.load(Ordering::Relaxed);
        assert_same(&run(&cached, vec![requests().remove(0)]), &first, &format!("{architecture}, prefix-cached"));
        assert!(cached.stats.prefix_hits.load(Ordering::Relaxed) > hits, "{architecture}: the prompt was found");
    }
}

/// A seeded request produces the same tokens alone and among others.
#[test]
fn seeded_output_does_not_depend_on_the_batch() {
    let alone = run(&engine(256, 16, 8192), vec![request(prompt(23, 3), 2, 13, 50)]);
    let together = run(&engine(256, 16, 8192), requests());
    assert_same(&together[2..3].to_vec(), &alone, "batched");
}

#[test]
fn a_pool_too_small_for_one_sequence_is_refused() {
    let config = EngineConfig {
        max_num_seqs: 4,
        max_num_batched_tokens: 64,
        max_model_len: 96,
        refit_mode: RefitMode::Drain,
        model_name: "tiny".into(),
    };
    let error = Engine::start(model(), None, 5, config).unwrap_err().to_string();
    assert!(error.contains("fewer than one sequence of max_model_len 96 needs (6 blocks)"), "{error}");
}

/// Colocated sleep: it waits for the running samples, frees the KV pool (and, asked to,
/// moves the weights to host memory: nothing to move on a CPU), holds requests that arrive
/// meanwhile, and after the wake they produce what an engine that never slept produces.
#[test]
fn a_sleeping_engine_frees_its_pool_holds_requests_and_serves_the_same_after_waking() {
    use keel_generation::engine::Memory;
    let want = run(&engine(256, 16, 8192), requests());
    let sleeper = engine(256, 16, 8192);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    // A sleep asked for while a request runs waits for it to finish.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    sleeper.submit(request(prompt(40, 1), 3, 5, 40), tx).unwrap();
    assert!(matches!(rx.blocking_recv(), Some(Event::Token(_))), "the request runs");
    let (_, freed) = runtime.block_on(sleeper.change_memory(Memory::Sleep { offload_weights: true })).unwrap();
    let mut finished = 0;
    while let Ok(event) = rx.try_recv() {
        finished += usize::from(matches!(event, Event::Finished { .. }));
    }
    assert_eq!(finished, 3, "the running samples finished before the sleep");
    let pool = 2 * 2 * (256 + 1) * BLOCK_SIZE as u64 * 2 * 16 * 4; // keys and values, 2 layers, f32
    assert_eq!(freed, pool, "the whole pool is freed");
    assert_eq!(sleeper.stats.asleep.load(Ordering::Relaxed), 1);
    // Requests that arrive while it sleeps wait for the wake.
    let (tx, mut held) = tokio::sync::mpsc::unbounded_channel();
    sleeper.submit(request(prompt(7, 2), 1, 9, 60), tx).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(held.try_recv().is_err(), "nothing is generated while asleep");
    let (_, taken) = runtime.block_on(sleeper.change_memory(Memory::Wake)).unwrap();
    assert_eq!(taken, pool, "the pool is allocated again");
    let mut tokens = Vec::new();
    while let Some(event) = held.blocking_recv() {
        if let Event::Token(t) = event {
            tokens.push(t.token);
        }
    }
    assert_eq!(tokens, want[1][0].0, "the request held during the sleep");
    assert_same(&run(&sleeper, requests()), &want, "after a sleep and a wake");
    assert_eq!(sleeper.stats.sleeps.load(Ordering::Relaxed), 1);
}

/// A refit names its own mode over the engine's: on an engine configured to drain, a `pause`
/// refit swaps the weights under a running sample (which ends on the new version) and a
/// `drain` refit waits for it (it ends on the old one).
#[test]
fn a_refit_in_pause_mode_swaps_under_running_samples_and_a_drain_refit_waits_for_them() {
    use keel_generation::backend::Weights;
    let dir = tempfile::tempdir().unwrap();
    tch::manual_seed(99);
    let other = CausalLm::new(model().config().clone(), Device::Cpu, Kind::Float, Init::Random { std: 0.5 }).unwrap();
    other.save(dir.path(), keel_model::SaveOptions::default()).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    for (mode, version, ends_on) in [(RefitMode::Pause, 7, 7), (RefitMode::Drain, 8, 0)] {
        // Long samples (8 × 240 tokens), so that the refit comes while they run.
        let config = EngineConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: 512,
            max_model_len: 256,
            refit_mode: RefitMode::Drain,
            model_name: "tiny".into(),
        };
        let engine = Engine::start(model(), None, 512, config).unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        engine.submit(request(prompt(10, 1), 8, 5, 240), tx).unwrap();
        assert!(matches!(rx.blocking_recv(), Some(Event::Token(_))), "the sample runs");
        runtime.block_on(engine.refit(Weights::Dir(dir.path().to_path_buf()), version, Some(mode))).unwrap();
        assert_eq!(engine.weight_version(), version, "{mode:?}: the new version serves");
        let mut finished = Vec::new();
        while let Some(event) = rx.blocking_recv() {
            if let Event::Finished { version, .. } = event {
                finished.push(version);
            }
        }
        assert_eq!(finished, vec![ends_on; 8], "{mode:?}: the version the running samples ended on");
    }
}
