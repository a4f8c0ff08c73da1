//! KV-cache decoding against the full forward, bit-exact save/load, and clear errors for
//! bad inputs — on random models built by Keel itself.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use keel_model::{CausalLm, Error, Init, KvCache, ModelConfig, SaveOptions, SlotCache};
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

/// Sequences of different lengths prefilled into slots one by one, then decoded together
/// (with one slot copied from another, as n samples share a prefill), match each sequence's
/// own full forward.
fn slots_vs_full(cfg: ModelConfig) {
    let model = random_model(cfg, Kind::Float);
    let seqs: Vec<Vec<i64>> = [7usize, 12, 3]
        .iter()
        .enumerate()
        .map(|(r, &n)| (0..n + 5).map(|i| ((i + r * 11) as i64 * 29 + 1) % 97).collect())
        .collect();
    let mut cache = SlotCache::new(model.config(), 5, 24, Kind::Float, Device::Cpu).unwrap();
    let slots = [4usize, 0, 2];
    let prompt_len = |r: usize| seqs[r].len() - 5;
    for (r, &slot) in slots.iter().enumerate() {
        let prompt = Tensor::from_slice(&seqs[r][..prompt_len(r)]).unsqueeze(0);
        let _ = model.forward_slots(&prompt, &mut cache, &[slot]).unwrap();
    }
    // Slot 1 shares sequence 1's prefill and decodes sequence 1 again.
    cache.copy_slot(0, 1).unwrap();
    let rows = [0usize, 1, 2, 1];
    let decode_slots = [4usize, 0, 2, 1];
    for step in 0..5 {
        let next: Vec<i64> = rows.iter().map(|&r| seqs[r][prompt_len(r) + step]).collect();
        let logits = model.forward_slots(&Tensor::from_slice(&next).unsqueeze(1), &mut cache, &decode_slots).unwrap();
        for (b, &r) in rows.iter().enumerate() {
            let upto = prompt_len(r) + step + 1;
            let full = model.forward(&Tensor::from_slice(&seqs[r][..upto]).unsqueeze(0), None).unwrap();
            let diff = (logits.get(b as i64).get(0) - full.get(0).get(upto as i64 - 1)).abs().max().double_value(&[]);
            assert!(diff <= 1e-4, "row {b} step {step}: max logit diff {diff:e}");
        }
    }
    assert_eq!((cache.len(4), cache.len(0), cache.len(1), cache.len(3)), (12, 17, 17, 0));
    let err = model.forward_slots(&Tensor::from_slice(&[1i64, 2]).unsqueeze(1), &mut cache, &[0, 0]).unwrap_err();
    assert!(err.to_string().contains("repeated"), "{err}");
}

#[test]
fn slot_cache_decodes_rows_of_different_lengths_together() {
    slots_vs_full(config("Qwen3ForCausalLM", json!({"head_dim": 16})));
    slots_vs_full(config("MistralForCausalLM", json!({"sliding_window": 5})));
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
