//! KV-cache and paged decoding against the full forward, bit-exact save/load, and clear errors for
//! bad inputs — on random models built by Keel itself.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use keel_model::{BLOCK_SIZE, CausalLm, Error, Init, KvCache, ModelConfig, PagedCache, SaveOptions, SeqChunk};
use serde_json::{Value, json};
use tch::{Device, Kind, Tensor};

fn config(arch: &str, extra: Value) -> ModelConfig {
    let mut value = json!({
        "architectures": [arch], "hidden_size": 48, "intermediate_size": 80,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 97, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
    });
    value.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    ModelConfig::from_json(value).unwrap()
}

fn random_model(cfg: ModelConfig, kind: Kind) -> CausalLm {
    tch::manual_seed(7);
    CausalLm::new(cfg, Device::Cpu, kind, Init::Random { std: 0.2 }).unwrap()
}

fn cached_vs_full(cfg: ModelConfig) {
    let model = random_model(cfg, Kind::Float);
    let ids: Vec<i64> = (0..24).map(|i| (i * 31 + 3) % 97).collect();
    let full = model.forward(&Tensor::from_slice(&ids).unsqueeze(0), None).unwrap();

    let mut cache = KvCache::new(model.config(), 1, 32, Kind::Float, Device::Cpu).unwrap();
    // Prefill 10, then a chunk of 3 (explicit mask over the cache), then one token at a time.
    let mut steps = vec![(0, 10), (10, 3)];
    steps.extend((13..24).map(|i| (i, 1)));
    for (start, len) in steps {
        let chunk = Tensor::from_slice(&ids[start..start + len]).unsqueeze(0);
        let logits = model.forward(&chunk, Some(&mut cache)).unwrap();
        let expected = full.narrow(1, start as i64, len as i64);
        let diff = (logits - expected).abs().max().double_value(&[]);
        assert!(diff <= 1e-4, "positions {start}..{}: max logit diff {diff:e}", start + len);
    }
    assert_eq!(cache.len(), 24);
}

#[test]
fn kv_cache_decoding_matches_full_forward() {
    cached_vs_full(config(
        "LlamaForCausalLM",
        json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    ));
    cached_vs_full(config("Qwen2ForCausalLM", json!({})));
    cached_vs_full(config("Qwen3ForCausalLM", json!({"head_dim": 16})));
    // A window of 5 is crossed by prefill, the chunk and every decode step.
    cached_vs_full(config("MistralForCausalLM", json!({"sliding_window": 5})));
}

/// A small config of each family that is configuration of the one decoder, every feature on:
/// windows shorter than the sequences, soft-caps that bite, rotary variants, multipliers.
fn families() -> Vec<(&'static str, ModelConfig)> {
    vec![
        (
            "gemma2",
            config(
                "Gemma2ForCausalLM",
                json!({"head_dim": 12, "sliding_window": 9, "query_pre_attn_scalar": 20,
            "attn_logit_softcapping": 3.0, "final_logit_softcapping": 4.0}),
            ),
        ),
        (
            "gemma3",
            config(
                "Gemma3ForCausalLM",
                json!({"head_dim": 12, "sliding_window": 7, "rope_local_base_freq": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "layer_types": ["sliding_attention", "full_attention"]}),
            ),
        ),
        (
            "phi3",
            config(
                "Phi3ForCausalLM",
                json!({"partial_rotary_factor": 0.5, "original_max_position_embeddings": 64,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.5, 2.0], "long_factor": [2.0, 3.0, 4.0]}}),
            ),
        ),
        (
            "olmo3",
            config(
                "Olmo3ForCausalLM",
                json!({"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]}),
            ),
        ),
        ("glm4", config("Glm4ForCausalLM", json!({"head_dim": 12}))),
        (
            "granite",
            config(
                "GraniteForCausalLM",
                json!({"embedding_multiplier": 6.0, "residual_multiplier": 0.5,
            "attention_multiplier": 0.1, "logits_scaling": 4.0}),
            ),
        ),
        ("smollm3", config("SmolLM3ForCausalLM", json!({"no_rope_layer_interval": 2}))),
    ]
}

#[test]
fn kv_cache_decoding_matches_full_forward_in_every_family() {
    for (_, cfg) in families() {
        cached_vs_full(cfg);
    }
}

/// Within the issue's 1e-4: Granite's multipliers and Gemma's √hidden scale make logits larger
/// than the older families' at the same weights.
#[test]
fn paged_attention_matches_the_contiguous_forward_in_every_family() {
    for (seed, (_, cfg)) in families().into_iter().enumerate() {
        paged_within(cfg, 10 + seed as u64, 1e-4);
    }
}

/// Sequences packed end to end in one row (the trainer's sequence packing: each at its own
/// positions, attending to itself) give each family the padded batch's logprobs, in the
/// scoring and the training pass.
#[test]
fn packed_rows_give_the_padded_logprobs_in_every_family() {
    for (name, cfg) in families() {
        let mut model = random_model(cfg, Kind::Float);
        model.set_prefix_sharing(false);
        let seqs = keel_testkit::sequences(&[23, 9, 14, 1], 97, 2);
        let width = 23;
        let flat: Vec<i64> =
            seqs.iter().flat_map(|s| s.iter().copied().chain(std::iter::repeat_n(0, width - s.len()))).collect();
        let ids = Tensor::from_slice(&flat).view([4, width as i64]);
        let lengths: Vec<i64> = seqs.iter().map(|s| s.len() as i64).collect();
        let padded = model.token_logprobs(&ids, &lengths, 0.9).unwrap();
        let row = keel_model::packed::PackedRow::new(&ids, &lengths).unwrap();
        let packed = model.packed_token_logprobs(&row, 0.9).unwrap();
        let (trained, _) = model.packed_train_logprobs(&row, 0.9).unwrap();
        for (what, got) in [("scored", &packed), ("trained", &trained.detach())] {
            let diff = (got - &padded).abs().max().double_value(&[]);
            assert!(diff <= 1e-5, "{name}: packed ({what}) vs padded logprobs differ by {diff:e}");
        }
    }
}

#[test]
fn the_fixed_shape_decode_step_matches_the_packed_pass_in_every_family() {
    for (_, cfg) in families() {
        decode_batch_vs_packed(cfg);
    }
}

/// Log-softmax of `logits` over the last dimension.
fn logprobs(logits: &Tensor) -> Tensor {
    logits.log_softmax(-1, Kind::Float)
}

/// A small deterministic generator for block tables and chunk sizes.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// Several sequences of different lengths, their blocks scattered at random over the pool,
/// computed in packed passes that mix prompt chunks of random sizes (chunked prefill) with
/// single-token decodes, give the logprobs of each sequence's own full forward.
fn paged_vs_contiguous(cfg: ModelConfig, seed: u64) {
    paged_within(cfg, seed, 1e-5);
}

/// [`paged_vs_contiguous`] within `tolerance`.
fn paged_within(cfg: ModelConfig, seed: u64, tolerance: f64) {
    let arch = cfg.architecture;
    let model = random_model(cfg, Kind::Float);
    let lengths = [37usize, 5, 18, 1, 50];
    let seqs: Vec<Vec<i64>> = lengths
        .iter()
        .enumerate()
        .map(|(r, &n)| (0..n).map(|i| ((i + r * 13) as i64 * 29 + 1) % 97).collect())
        .collect();
    let mut rng = Lcg(seed);
    let needed: Vec<usize> = lengths.iter().map(|n| n.div_ceil(BLOCK_SIZE)).collect();
    let pool = needed.iter().sum::<usize>() + 3;
    let mut free: Vec<u32> = (0..pool as u32).collect();
    let tables: Vec<Vec<u32>> =
        needed.iter().map(|&k| (0..k).map(|_| free.swap_remove(rng.below(free.len()))).collect()).collect();
    let mut cache = PagedCache::new(model.config(), pool, Kind::Float, Device::Cpu).unwrap();
    let mut computed = vec![0usize; seqs.len()];
    let mut worst = 0.0f64;
    while computed.iter().zip(&lengths).any(|(c, n)| c < n) {
        let mut chunks = Vec::new();
        let mut which = Vec::new();
        for r in 0..seqs.len() {
            if computed[r] == lengths[r] || rng.below(4) == 0 {
                continue;
            }
            let take = (1 + rng.below(12)).min(lengths[r] - computed[r]);
            let end = computed[r] + take;
            chunks.push(SeqChunk {
                tokens: seqs[r][computed[r]..end].to_vec(),
                context: computed[r],
                blocks: tables[r].clone(),
                logits: true,
            });
            which.push((r, end));
            computed[r] = end;
        }
        if chunks.is_empty() {
            continue;
        }
        let got = logprobs(&model.forward_paged(&chunks, &mut cache).unwrap());
        for (row, &(r, end)) in which.iter().enumerate() {
            let full = model.forward(&Tensor::from_slice(&seqs[r][..end]).unsqueeze(0), None).unwrap();
            let want = logprobs(&full.get(0).get(end as i64 - 1));
            worst = worst.max((got.get(row as i64) - want).abs().max().double_value(&[]));
        }
    }
    assert!(worst <= tolerance, "{arch:?}: paged logprobs differ from the contiguous forward by {worst:e}");
}

#[test]
fn paged_attention_matches_the_contiguous_forward() {
    paged_vs_contiguous(config("Qwen3ForCausalLM", json!({"head_dim": 16})), 1);
    paged_vs_contiguous(config("LlamaForCausalLM", json!({})), 2);
    paged_vs_contiguous(config("MistralForCausalLM", json!({"sliding_window": 9})), 3);
}

/// The fixed-shape decode step (what a CUDA graph captures) gives what the packed pass
/// gives for the same rows: padded to a larger batch, with wider block tables than the rows
/// need, over prompts of different lengths, several steps in a row; bad rows are refused.
fn decode_batch_vs_packed(cfg: ModelConfig) {
    let model = random_model(cfg, Kind::Float);
    let lengths = [37usize, 5, 18, 1, 33];
    let steps = 4;
    let needed: Vec<usize> = lengths.iter().map(|n| (n + steps).div_ceil(BLOCK_SIZE)).collect();
    let pool = needed.iter().sum::<usize>() + 2;
    // Tables taken from the end of the pool backwards, so no row's blocks are in order.
    let mut next = pool as u32;
    let tables: Vec<Vec<u32>> = needed
        .iter()
        .map(|&k| {
            (0..k)
                .map(|_| {
                    next -= 1;
                    next
                })
                .collect()
        })
        .collect();
    let mut cache = PagedCache::new(model.config(), pool, Kind::Float, Device::Cpu).unwrap();
    let mut seqs: Vec<Vec<i64>> = lengths
        .iter()
        .enumerate()
        .map(|(r, &n)| (0..n).map(|i| ((i + r * 11) as i64 * 23 + 4) % 97).collect())
        .collect();
    let prefill: Vec<SeqChunk> = seqs
        .iter()
        .zip(&tables)
        .map(|(s, t)| SeqChunk { tokens: s[..s.len() - 1].to_vec(), context: 0, blocks: t.clone(), logits: false })
        .filter(|c| !c.tokens.is_empty())
        .collect();
    let _ = model.forward_paged(&prefill, &mut cache).unwrap();
    let mut batch = keel_model::DecodeBatch::new(8, 6, Device::Cpu).unwrap();
    for _ in 0..steps {
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
        let want = logprobs(&model.forward_paged(&chunks, &mut cache).unwrap());
        batch.fill(&chunks, &mut cache).unwrap();
        let got = model.forward_decode(&batch, &mut cache).unwrap();
        assert_eq!(got.size(), [8, 97], "every row of the batch, padding included");
        let got = logprobs(&got.narrow(0, 0, lengths.len() as i64));
        let worst = (got - &want).abs().max().double_value(&[]);
        assert!(worst <= 1e-5, "the decode step differs from the packed pass by {worst:e}");
        let next = Vec::<i64>::try_from(want.argmax(-1, false)).unwrap();
        for (s, t) in seqs.iter_mut().zip(next) {
            s.push(t);
        }
    }
    let too_wide = SeqChunk { tokens: vec![1], context: 6 * BLOCK_SIZE, blocks: vec![0; 7], logits: true };
    let error = batch.fill(&[too_wide], &mut cache).unwrap_err().to_string();
    assert!(error.contains("at most 6 blocks"), "{error}");
    let nine: Vec<SeqChunk> =
        (0..9).map(|_| SeqChunk { tokens: vec![1], context: 0, blocks: vec![0], logits: true }).collect();
    assert!(batch.fill(&nine, &mut cache).unwrap_err().to_string().contains("9 sequences"));
}

#[test]
fn the_fixed_shape_decode_step_matches_the_packed_pass() {
    decode_batch_vs_packed(config("Qwen3ForCausalLM", json!({"head_dim": 16})));
    decode_batch_vs_packed(config("MistralForCausalLM", json!({"sliding_window": 9})));
}

/// A block copied from another (copy on write) continues as the original would, and a
/// chunk that asks for no logits still fills the cache.
#[test]
fn copied_blocks_and_chunks_without_logits() {
    let model = random_model(config("Qwen2ForCausalLM", json!({})), Kind::Float);
    let prompt: Vec<i64> = (0..20).map(|i| (i * 7 + 2) % 97).collect();
    let mut cache = PagedCache::new(model.config(), 4, Kind::Float, Device::Cpu).unwrap();
    let chunk = |tokens: &[i64], context: usize, blocks: &[u32], logits: bool| SeqChunk {
        tokens: tokens.to_vec(),
        context,
        blocks: blocks.to_vec(),
        logits,
    };
    let none = model.forward_paged(&[chunk(&prompt[..12], 0, &[0, 1], false)], &mut cache).unwrap();
    assert_eq!(none.size(), [0, 97]);
    let _ = model.forward_paged(&[chunk(&prompt[12..], 12, &[0, 1], true)], &mut cache).unwrap();
    // Block 1 (positions 16..20) is copied to block 2; both sequences decode the same token.
    cache.copy_block(1, 2).unwrap();
    let both =
        model.forward_paged(&[chunk(&[5], 20, &[0, 1], true), chunk(&[5], 20, &[0, 2], true)], &mut cache).unwrap();
    let mut whole = prompt.clone();
    whole.push(5);
    let full = model.forward(&Tensor::from_slice(&whole).unsqueeze(0), None).unwrap().get(0).get(20);
    for row in 0..2 {
        let diff = (both.get(row) - &full).abs().max().double_value(&[]);
        assert!(diff <= 1e-4, "row {row}: {diff:e}");
    }
    // Bad chunks are refused with what is wrong.
    let err = model.forward_paged(&[chunk(&[1, 2], 15, &[0], true)], &mut cache).unwrap_err().to_string();
    assert!(err.contains("blocks hold 16"), "{err}");
    let err = model.forward_paged(&[chunk(&[1], 0, &[9], true)], &mut cache).unwrap_err().to_string();
    assert!(err.contains("block 9"), "{err}");
    assert!(model.forward_paged(&[chunk(&[500], 0, &[0], true)], &mut cache).is_err());
}

#[test]
fn kv_cache_refuses_overflow() {
    let model = random_model(config("LlamaForCausalLM", json!({})), Kind::Float);
    let mut cache = KvCache::new(model.config(), 1, 4, Kind::Float, Device::Cpu).unwrap();
    let err = model.forward(&Tensor::from_slice(&[1i64, 2, 3, 4, 5]).unsqueeze(0), Some(&mut cache)).unwrap_err();
    assert!(err.to_string().contains("do not fit"), "{err}");
    assert_eq!(cache.len(), 0);
    // A cache made for another batch size or dtype is refused, not broadcast into.
    let two_rows = Tensor::from_slice(&[1i64, 2]).view([2, 1]);
    let err = model.forward(&two_rows, Some(&mut cache)).unwrap_err().to_string();
    assert!(err.contains("batch 2"), "{err}");
    let mut half = KvCache::new(model.config(), 1, 4, Kind::BFloat16, Device::Cpu).unwrap();
    assert!(model.forward(&Tensor::from_slice(&[1i64]).view([1, 1]), Some(&mut half)).is_err());
}

fn assert_same_parameters(a: &CausalLm, b: &CausalLm) {
    let (va, vb) = (a.var_store().variables(), b.var_store().variables());
    assert_eq!(va.len(), vb.len());
    for (name, ta) in va {
        let tb = &vb[&name];
        assert_eq!(ta.kind(), tb.kind(), "{name}");
        assert!(ta.equal(tb), "{name} differs after save → load");
    }
}

#[test]
fn save_then_load_is_bit_exact() {
    for (kind, arch) in
        [(Kind::Float, "Qwen3ForCausalLM"), (Kind::BFloat16, "Qwen2ForCausalLM"), (Kind::Half, "LlamaForCausalLM")]
    {
        let model = random_model(config(arch, json!({"tie_word_embeddings": arch == "LlamaForCausalLM"})), kind);
        let dir = tempfile::tempdir().unwrap();
        model.save(dir.path(), SaveOptions::default()).unwrap();
        assert_same_parameters(&model, &CausalLm::load(dir.path(), Device::Cpu, kind).unwrap());
        // Sharded, into the same directory: the single file is replaced by shards.
        model.save(dir.path(), SaveOptions { max_shard_bytes: 20_000 }).unwrap();
        assert!(!dir.path().join("model.safetensors").exists());
        assert_same_parameters(&model, &CausalLm::load(dir.path(), Device::Cpu, kind).unwrap());
    }
}

/// Saves a model whose weight map was edited by `edit`, for the bad-checkpoint tests.
fn save_edited(dir: &Path, edit: impl FnOnce(&mut std::collections::BTreeMap<String, Tensor>)) {
    let model = random_model(config("LlamaForCausalLM", json!({})), Kind::Float);
    model.save(dir, SaveOptions::default()).unwrap();
    let mut params: std::collections::BTreeMap<_, _> = model.var_store().variables().into_iter().collect();
    edit(&mut params);
    keel_model::weights::save(dir, &params, SaveOptions::default()).unwrap();
}

fn load_error(dir: &Path) -> String {
    CausalLm::load(dir, Device::Cpu, Kind::Float).unwrap_err().to_string()
}

#[test]
fn missing_unexpected_and_misshapen_tensors_are_named() {
    let dir = tempfile::tempdir().unwrap();
    save_edited(dir.path(), |p| {
        p.remove("model.layers.1.mlp.up_proj.weight");
        p.insert("model.layers.0.extra.weight".into(), Tensor::zeros([2], (Kind::Float, Device::Cpu)));
        p.insert("model.norm.weight".into(), Tensor::zeros([47], (Kind::Float, Device::Cpu)));
    });
    let err = load_error(dir.path());
    assert!(err.contains("missing tensor `model.layers.1.mlp.up_proj.weight`"), "{err}");
    assert!(err.contains("unexpected tensor `model.layers.0.extra.weight`"), "{err}");
    assert!(err.contains("`model.norm.weight` has shape [47], expected [48]"), "{err}");
}

#[test]
fn unsupported_tensor_dtype_is_named() {
    let dir = tempfile::tempdir().unwrap();
    save_edited(dir.path(), |_| {});
    // A hand-written safetensors file holding one f64 tensor.
    let header = br#"{"model.norm.weight":{"dtype":"F64","shape":[48],"data_offsets":[0,384]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0u8; 384]);
    std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("tensor `model.norm.weight` has unsupported dtype F64"), "{err}");
    assert!(err.contains("missing tensor `lm_head.weight`"), "{err}");
}

#[test]
fn corrupt_header_missing_dir_and_unknown_architecture() {
    let dir = tempfile::tempdir().unwrap();
    save_edited(dir.path(), |_| {});
    std::fs::write(dir.path().join("model.safetensors"), b"\xff\xff\xff\xff\xff\xff\xff\x7fnot a header").unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("model.safetensors: corrupt safetensors file"), "{err}");

    let err = load_error(&dir.path().join("nope"));
    assert!(err.contains("does not exist"), "{err}");

    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap()).unwrap();
    cfg["architectures"] = json!(["FalconForCausalLM"]);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("unknown architecture `FalconForCausalLM`"), "{err}");

    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    cfg["architectures"] = json!(["LlamaForCausalLM"]);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    assert!(load_error(dir.path()).contains("no weights"));
}

#[test]
fn token_ids_out_of_range_are_refused() {
    let model = random_model(config("LlamaForCausalLM", json!({})), Kind::Float);
    let ids = Tensor::from_slice(&[1i64, 2, 97, 4, 5, 6]).view([2, 3]);
    match model.token_logprobs(&ids, &[3, 3], 1.0).unwrap_err() {
        Error::TokenOutOfRange { id: 97, row: 0, position: 2, vocab_size: 97 } => {}
        other => panic!("unexpected error: {other}"),
    }
    let negative = Tensor::from_slice(&[1i64, -1]).view([1, 2]);
    assert!(model.forward(&negative, None).unwrap_err().to_string().contains("token id -1"));
    // Padding past a row's length is not checked (any id may pad).
    let padded = Tensor::from_slice(&[1i64, 2, 3, 4, 5, -100]).view([2, 3]);
    assert!(model.token_logprobs(&padded, &[3, 2], 1.0).is_ok());
    assert!(model.token_logprobs(&padded, &[3, 4], 1.0).unwrap_err().to_string().contains("outside 1..=3"));
}

#[test]
fn padding_does_not_change_logprobs() {
    let model = random_model(config("Qwen2ForCausalLM", json!({})), Kind::Float);
    let seqs = keel_testkit::sequences(&[9, 4], 97, 3);
    let batched = common::keel_logprobs(&model, &seqs, 1.0);
    let single = common::keel_logprobs(&model, &seqs[1..], 1.0);
    assert!(keel_testkit::max_abs_diff(&batched[1..], &single) <= 1e-5);
    assert_eq!(batched[1].len(), 4);
}

/// The bf16 path (what CUDA runs) computes the same logprobs as f32 to bf16 precision.
#[test]
fn bf16_logprobs_track_f32() {
    let model = random_model(config("Qwen3ForCausalLM", json!({"head_dim": 16})), Kind::Float);
    let dir = tempfile::tempdir().unwrap();
    model.save(dir.path(), SaveOptions::default()).unwrap();
    let bf16 = CausalLm::load(dir.path(), Device::Cpu, Kind::BFloat16).unwrap();
    assert_eq!(bf16.kind(), Kind::BFloat16);
    let seqs = keel_testkit::sequences(&[12, 5], 97, 1);
    let (full, half) = (common::keel_logprobs(&model, &seqs, 1.0), common::keel_logprobs(&bf16, &seqs, 1.0));
    let diff = keel_testkit::max_abs_diff(&full, &half);
    assert!(diff > 0.0 && diff < 0.15, "bf16 vs f32 logprob difference {diff}");
}

/// Rows of a GRPO-like batch: `prompts` prompts of different lengths that begin alike (a chat
/// template's start), each followed by `samples` answers of different lengths, right-padded.
fn grouped_rows(prompts: usize, samples: usize, vocab: i64) -> (Tensor, Vec<i64>) {
    let mut rows: Vec<Vec<i64>> = Vec::new();
    for p in 0..prompts {
        let prompt: Vec<i64> =
            [1, 2, 3].into_iter().chain((0..5 + 2 * p as i64).map(|i| (i * 7 + p as i64 * 13 + 5) % vocab)).collect();
        for s in 0..samples {
            let answer = (0..1 + (s * 5 + p) as i64 % 9).map(|i| (i * 11 + s as i64 * 17 + p as i64 * 3 + 1) % vocab);
            rows.push(prompt.iter().copied().chain(answer).collect());
        }
    }
    // Two samples with the same answer: their whole rows are shared.
    rows[1] = rows[0].clone();
    let width = rows.iter().map(Vec::len).max().unwrap();
    let lengths: Vec<i64> = rows.iter().map(|r| r.len() as i64).collect();
    let flat: Vec<i64> =
        rows.iter().flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(0, width - r.len()))).collect();
    (Tensor::from_slice(&flat).view([rows.len() as i64, width as i64]), lengths)
}

/// Logprobs and every parameter's gradient of Σ weight · logprob, through `train_logprobs`.
fn logprobs_and_gradients(model: &CausalLm, ids: &Tensor, lengths: &[i64], temperature: f64) -> (Tensor, Vec<Tensor>) {
    for p in model.var_store().trainable_variables() {
        let mut g = p.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
    let (logprobs, _) = model.train_logprobs(ids, lengths, temperature).unwrap();
    let weights =
        Tensor::arange(logprobs.numel() as i64, (Kind::Float, Device::Cpu)).view(logprobs.size().as_slice()).sin();
    (&logprobs * weights).sum(Kind::Float).backward();
    let grads = model.var_store().trainable_variables().iter().map(|p| p.grad().copy()).collect();
    (logprobs.detach(), grads)
}

/// A batch whose rows share prompts runs as one tree per prompt (the prompt once, each
/// answer after it attending to it), and gives the padded pass's logprobs and gradients
/// (1e-5, f32), with sliding windows and a temperature too; rows with nothing to share run
/// padded.
#[test]
fn shared_prompts_give_the_padded_logprobs_and_gradients() {
    let others = families().into_iter().map(|(_, cfg)| cfg);
    for cfg in [
        config("Qwen3ForCausalLM", json!({"head_dim": 16})),
        config("MistralForCausalLM", json!({"sliding_window": 6})),
    ]
    .into_iter()
    .chain(others)
    {
        let mut model = random_model(cfg, Kind::Float);
        let (ids, lengths) = grouped_rows(3, 4, 97);
        assert_eq!(model.prefix_tree_rows(&ids, &lengths).unwrap(), Some(3), "one tree per prompt");
        for temperature in [1.0, 0.7] {
            let (tree, tree_grads) = logprobs_and_gradients(&model, &ids, &lengths, temperature);
            model.set_prefix_sharing(false);
            assert_eq!(model.prefix_tree_rows(&ids, &lengths).unwrap(), None);
            let (padded, padded_grads) = logprobs_and_gradients(&model, &ids, &lengths, temperature);
            let no_grad = model.token_logprobs(&ids, &lengths, temperature).unwrap();
            model.set_prefix_sharing(true);
            let scored = tch::no_grad(|| model.token_logprobs(&ids, &lengths, temperature).unwrap());
            assert_eq!(tree.size(), padded.size());
            for (name, got) in [("train", &tree), ("scored", &scored)] {
                let diff = (got - &padded).abs().max().double_value(&[]);
                assert!(diff < 1e-5, "{name} logprobs differ from the padded pass's by {diff}");
            }
            assert!((&no_grad - &padded).abs().max().double_value(&[]) == 0.0);
            for (got, want) in tree_grads.iter().zip(&padded_grads) {
                let scale = want.abs().max().double_value(&[]).max(1.0);
                let diff = (got - want).abs().max().double_value(&[]);
                assert!(diff < 1e-5 * scale, "a gradient (max {scale}) differs by {diff}");
            }
        }
    }
    // Unrelated rows: nothing shared, the padded pass.
    let model = random_model(config("Qwen3ForCausalLM", json!({"head_dim": 16})), Kind::Float);
    let ids = Tensor::from_slice(&[5i64, 6, 7, 8, 9, 10, 11, 0, 12, 13, 14, 15]).view([3, 4]);
    assert_eq!(model.prefix_tree_rows(&ids, &[4, 3, 4]).unwrap(), None);
}
