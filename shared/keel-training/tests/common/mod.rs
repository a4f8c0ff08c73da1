//! Test support for the trainer: a tiny `keel model init` model, engines, synthetic data.

#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use keel_model::Architecture;
use keel_model::init::{InitSpec, Preset, init_model};
use keel_protocol::trainer::{LoadRequest, ModelSource, TrainBatch};
use keel_training::Engine;
use serde_json::{Value, json};

/// A new tiny Qwen3 model (random weights, trained tokenizer) in `dir/model`.
pub fn tiny_model(dir: &Path) -> PathBuf {
    tiny_model_of(dir, Architecture::Qwen3)
}

/// A new tiny model of `architecture` in `dir/model`.
pub fn tiny_model_of(dir: &Path, architecture: Architecture) -> PathBuf {
    let out = dir.join("model");
    init_model(&InitSpec {
        architecture,
        preset: Preset::Tiny,
        tokenizer_corpus: vec![keel_testkit::workspace_root().join("examples/tokenizer-corpus.txt")],
        out: out.clone(),
        seed: 7,
    })
    .unwrap();
    out
}

pub fn load_request(model: &Path, training: Value) -> LoadRequest {
    serde_json::from_value(json!({
        "run_id": "test-run",
        "policy": {"path": model.to_str().unwrap()},
        "training": training,
    }))
    .unwrap()
}

pub fn engine(model: &Path, training: Value) -> Engine {
    let request = load_request(model, training);
    assert!(request.training.problems("training").is_empty(), "{:?}", request.training.problems("training"));
    Engine::load(&request, "cpu").unwrap()
}

pub fn source(path: &Path) -> ModelSource {
    ModelSource { path: path.to_str().unwrap().into() }
}

/// Counting sequences `start, start + 1, ...` of `len` tokens; the first `prompt` tokens are
/// not trained on.
pub fn counting(starts: &[i64], len: i64, prompt: usize) -> TrainBatch {
    let input_ids: Vec<Vec<i64>> = starts.iter().map(|&s| (s..s + len).collect()).collect();
    let token_mask =
        input_ids.iter().map(|r| (0..r.len()).map(|i| if i < prompt { 0.0 } else { 1.0 }).collect()).collect();
    TrainBatch { input_ids, token_mask, ..Default::default() }
}

/// Preference pairs: a 3-token prompt, then a 4-token answer; chosen answers use even ids
/// from 100..140, rejected ones odd ids from 101..141, in combinations that vary with
/// `start`, so a held-out set of new starts has unseen prompts and answers. Rows
/// alternate chosen, rejected.
pub fn preferences(starts: &[i64]) -> TrainBatch {
    let mut input_ids = Vec::new();
    for &s in starts {
        let prompt = [s, s + 7, s + 3];
        let chosen: Vec<i64> = (1..=4).map(|k| 100 + 2 * ((s * 7 + k * 13) % 20)).collect();
        let rejected: Vec<i64> = (1..=4).map(|k| 101 + 2 * ((s * 5 + k * 11) % 20)).collect();
        input_ids.push(prompt.iter().copied().chain(chosen).collect::<Vec<_>>());
        input_ids.push(prompt.iter().copied().chain(rejected).collect::<Vec<_>>());
    }
    let token_mask = input_ids.iter().map(|r| (0..r.len()).map(|i| if i < 3 { 0.0 } else { 1.0 }).collect()).collect();
    TrainBatch { input_ids, token_mask, ..Default::default() }
}

/// Mean NLL per masked token of `batch` under the policy.
pub fn held_out_nll(engine: &mut Engine, batch: &TrainBatch) -> f64 {
    let lp = engine.logprobs(Default::default(), &batch.input_ids, 1.0).unwrap();
    let (mut sum, mut count) = (0.0, 0.0);
    for (row, mask) in lp.iter().zip(&batch.token_mask) {
        for i in 1..row.len() {
            sum -= row[i] as f64 * mask[i] as f64;
            count += mask[i] as f64;
        }
    }
    sum / count
}
