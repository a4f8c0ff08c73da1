//! Keel's logprobs against transformers' on random models of every supported architecture
//! and config feature, in f32, on right-padded batches.

#![allow(clippy::unwrap_used)]

mod common;

use common::{keel_logprobs, load_f32};
use keel_model::SaveOptions;
use keel_testkit::{max_abs_diff, reference, reference_logprobs, sequences};

const TOLERANCE: f64 = 1e-4;
/// Lengths of one right-padded batch: longer than Mistral's window of 6, and a length-1 row.
const LENGTHS: [usize; 4] = [23, 14, 6, 1];

fn check_variant(variant: &str, dtype: &str, temperature: f64) {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = dir.path().join("model");
    reference(&["make-model", variant, model_dir.to_str().unwrap(), "--dtype", dtype]);
    let model = load_f32(&model_dir);
    let seqs = sequences(&LENGTHS, model.config().vocab_size, 1);
    let expected = reference_logprobs(&model_dir, &seqs, temperature, dir.path());
    let actual = keel_logprobs(&model, &seqs, temperature);
    let diff = max_abs_diff(&actual, &expected);
    assert!(diff <= TOLERANCE, "{variant}: max |keel - transformers| = {diff:e}");
    assert!(actual.iter().all(|row| row[0] == 0.0), "position 0 must be 0");
}

#[test]
fn llama3_rope_scaling() {
    check_variant("llama3-rope", "float32", 1.0);
}

#[test]
fn llama_linear_rope_scaling_at_temperature() {
    check_variant("llama-linear-rope", "float32", 0.7);
}

#[test]
fn llama_tied_embeddings() {
    check_variant("llama-tied", "float32", 1.0);
}

#[test]
fn llama_attention_and_mlp_bias() {
    check_variant("llama-bias", "float32", 1.0);
}

#[test]
fn llama_head_dim_not_hidden_over_heads() {
    check_variant("llama-head-dim", "float32", 1.0);
}

#[test]
fn qwen2_qkv_bias() {
    check_variant("qwen2-bias", "float32", 1.0);
}

#[test]
fn qwen3_qk_norm() {
    check_variant("qwen3-qk-norm", "float32", 1.0);
}

#[test]
fn qwen3_single_kv_head_and_wide_heads() {
    check_variant("qwen3-head-dim", "float32", 1.0);
}

#[test]
fn mistral_sliding_window() {
    check_variant("mistral-window", "float32", 1.0);
}

#[test]
fn bf16_checkpoint_loads_into_f32() {
    check_variant("qwen2-bias", "bfloat16", 1.0);
}

/// A Keel save, sharded, loads in transformers and scores the same.
#[test]
fn sharded_keel_save_loads_in_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source");
    reference(&["make-model", "qwen3-qk-norm", source.to_str().unwrap()]);
    let model = load_f32(&source);
    let saved = dir.path().join("saved");
    model.save(&saved, SaveOptions { max_shard_bytes: 40_000 }).unwrap();
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(saved.join("model.safetensors.index.json")).unwrap()).unwrap();
    let mut files: Vec<&str> = index["weight_map"].as_object().unwrap().values().map(|f| f.as_str().unwrap()).collect();
    files.sort_unstable();
    files.dedup();
    assert!(files.len() > 1, "expected several shards, got {files:?}");
    assert!(!saved.join("model.safetensors").exists());

    let seqs = sequences(&LENGTHS, model.config().vocab_size, 2);
    let expected = reference_logprobs(&saved, &seqs, 1.0, dir.path());
    let diff = max_abs_diff(&keel_logprobs(&model, &seqs, 1.0), &expected);
    assert!(diff <= TOLERANCE, "max |keel - transformers| = {diff:e}");
}

#[test]
fn qwen3_moe_top_k_weights_unnormalised_and_a_dense_layer() {
    check_variant("qwen3-moe", "float32", 1.0);
}

#[test]
fn qwen3_moe_renormalised_top_k_at_temperature() {
    check_variant("qwen3-moe-norm", "float32", 0.8);
}

#[test]
fn mixtral_sliding_window() {
    check_variant("mixtral", "float32", 1.0);
}

/// An MoE model saved by Keel is a checkpoint transformers loads (the per-expert names of
/// the Hub's files), and scores the same.
#[test]
fn moe_keel_save_loads_in_transformers() {
    for variant in ["qwen3-moe", "mixtral"] {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("source");
        reference(&["make-model", variant, source.to_str().unwrap(), "--seed", "3"]);
        let model = load_f32(&source);
        let saved = dir.path().join("saved");
        model.save(&saved, SaveOptions::default()).unwrap();
        let seqs = sequences(&LENGTHS, model.config().vocab_size, 4);
        let expected = reference_logprobs(&saved, &seqs, 1.0, dir.path());
        let diff = max_abs_diff(&keel_logprobs(&model, &seqs, 1.0), &expected);
        assert!(diff <= TOLERANCE, "{variant}: max |keel - transformers| = {diff:e}");
    }
}

/// Two tensor-parallel ranks, each loading its slices of every expert from the checkpoint,
/// score what transformers scores.
#[test]
fn moe_at_tp_2_equals_transformers() {
    for variant in ["qwen3-moe", "mixtral"] {
        let dir = tempfile::tempdir().unwrap();
        let model_dir = dir.path().join("model");
        reference(&["make-model", variant, model_dir.to_str().unwrap()]);
        let vocab = load_f32(&model_dir).config().vocab_size;
        let seqs = sequences(&LENGTHS, vocab, 5);
        let expected = reference_logprobs(&model_dir, &seqs, 1.0, dir.path());
        let comms = keel_collective::cpu::CpuGroup::new(2).unwrap();
        let ranks: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (dir, seqs) = (model_dir.clone(), seqs.clone());
                std::thread::spawn(move || {
                    let comm: keel_collective::SharedComm = std::sync::Arc::new(comm);
                    let model = keel_model::CausalLm::load_shard(&dir, comm, tch::Device::Cpu, tch::Kind::Float)
                        .expect("a rank's slices");
                    keel_logprobs(&model, &seqs, 1.0)
                })
            })
            .collect();
        for rank in ranks {
            let diff = max_abs_diff(&rank.join().unwrap(), &expected);
            assert!(diff <= TOLERANCE, "{variant} at TP 2: max |keel - transformers| = {diff:e}");
        }
    }
}

/// The router's load-balancing loss of a right-padded batch (padding left out) is
/// transformers' `aux_loss` for the same batch.
#[test]
fn router_load_balancing_loss_equals_transformers() {
    for variant in ["qwen3-moe", "qwen3-moe-norm", "mixtral"] {
        let dir = tempfile::tempdir().unwrap();
        let model_dir = dir.path().join("model");
        reference(&["make-model", variant, model_dir.to_str().unwrap()]);
        let model = load_f32(&model_dir);
        let seqs = sequences(&LENGTHS, model.config().vocab_size, 6);
        let input = dir.path().join("input.jsonl");
        keel_testkit::write_jsonl(&input, &seqs);
        let expected = reference(&["router-loss", model_dir.to_str().unwrap(), input.to_str().unwrap()])["aux_loss"]
            .as_f64()
            .unwrap();
        let width = seqs.iter().map(Vec::len).max().unwrap();
        let padded: Vec<i64> =
            seqs.iter().flat_map(|s| s.iter().copied().chain(std::iter::repeat_n(7, width - s.len()))).collect();
        let ids = tch::Tensor::from_slice(&padded).view([seqs.len() as i64, width as i64]);
        let lengths: Vec<i64> = seqs.iter().map(|s| s.len() as i64).collect();
        let (_, tape) = model.train_logprobs(&ids, &lengths, 1.0).unwrap();
        let actual = tape.router_aux_loss().expect("an MoE model's loss").double_value(&[]);
        assert!((actual - expected).abs() <= 1e-5, "{variant}: keel {actual} vs transformers {expected}");
        // Trained only where the config asks for it (transformers' `output_router_logits`).
        assert_eq!(tape.router_loss().unwrap().is_some(), variant == "qwen3-moe-norm", "{variant}");
    }
}
