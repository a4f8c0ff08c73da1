//! Training under tensor parallelism on the CPU collective, against the same training at
//! TP = 1 on a tiny Qwen3 (4 heads, 2 KV heads: split at TP = 2, replicated at TP = 4):
//! gradients, five AdamW steps with clipping, the checkpoint (loaded at TP = 1 and in
//! transformers), and resuming from it at either size.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::*;
use keel_model::CausalLm;
use keel_protocol::trainer::{Advantages, TrainBatch};
use keel_training::Trainer;
use keel_training::batch::Batch;
use serde_json::{Value, json};
use tch::{Device, Kind, Tensor};

fn trainer(model: &Path, training: Value, tp: usize) -> Trainer {
    let mut request = load_request(model, training);
    request.tensor_parallel_size = tp;
    Trainer::load(&request, "cpu").unwrap()
}

fn training() -> Value {
    json!({
        "loss": {"type": "nll"}, "global_batch_size": 4, "micro_batch_size": 2,
        "optimizer": {"lr": 1e-4, "weight_decay": 0.01}, "max_grad_norm": 0.5,
    })
}

/// Twenty rows of different lengths: five optimiser steps of four.
fn rows() -> TrainBatch {
    let starts: Vec<i64> = (0..20).map(|i| (7 + 23 * i) % 380).collect();
    let mut batch = counting(&starts, 0, 2);
    batch.input_ids = starts.iter().enumerate().map(|(i, &s)| (s..s + 6 + (i as i64 * 5) % 9).collect()).collect();
    batch.token_mask =
        batch.input_ids.iter().map(|r| (0..r.len()).map(|i| if i < 2 { 0.0 } else { 1.0 }).collect()).collect();
    batch
}

fn tensors(path: &Path) -> BTreeMap<String, Tensor> {
    Tensor::read_safetensors(path).unwrap().into_iter().collect()
}

/// Max |a − b| over tensors of the same names.
fn max_diff(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> (f64, String) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "the same tensors");
    a.iter()
        .map(|(name, x)| {
            let d = (x.to_kind(Kind::Double) - b[name].to_kind(Kind::Double)).abs().max().double_value(&[]);
            (d, name.clone())
        })
        .fold((0.0, String::new()), |best, next| if next.0 > best.0 { next } else { best })
}

fn weights(dir: &Path) -> BTreeMap<String, Tensor> {
    let model = CausalLm::load(dir, Device::Cpu, Kind::Float).unwrap();
    model.var_store().variables().into_iter().map(|(k, v)| (k, v.detach())).collect()
}

#[test]
fn gradients_at_tp_2_and_4_and_packed_equal_tp_1() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let losses = [
        json!({"type": "nll"}),
        json!({"type": "dpo", "sft_loss_weight": 0.3}),
        json!({"type": "clipped_pg", "reference_policy_kl_penalty": 0.1, "use_importance_sampling_correction": true}),
    ];
    for loss in losses {
        let config = json!({"loss": loss, "global_batch_size": 8, "micro_batch_size": 4});
        let mut wire = if loss["type"] == "dpo" { preferences(&[3, 9, 21, 40]) } else { rows() };
        wire.input_ids.truncate(8);
        wire.token_mask.truncate(8);
        // Logprobs the losses compare against: the policy's own, moved a little.
        let own = trainer(&model, config.clone(), 1).logprobs(Default::default(), wire.input_ids.clone(), 1.0).unwrap();
        let moved = |by: f32| -> Vec<Vec<f32>> {
            own.iter()
                .enumerate()
                .map(|(r, row)| {
                    row.iter()
                        .enumerate()
                        .map(|(i, x)| if i == 0 { 0.0 } else { x + by * ((r + i) % 3) as f32 })
                        .collect()
                })
                .collect()
        };
        wire.reference_logprobs = Some(moved(0.2));
        if loss["type"] == "clipped_pg" {
            wire.prev_logprobs = Some(moved(-0.1));
            wire.generation_logprobs = Some(moved(0.05));
            wire.advantages = Some(Advantages::PerSample((0..8).map(|i| i as f32 * 0.4 - 1.3).collect()));
        }
        let gradients = |tp: usize, packing: bool| -> BTreeMap<String, Tensor> {
            let mut config = config.clone();
            config["sequence_packing"] = json!({"enabled": packing, "train_mb_tokens": 30});
            let mut trainer = trainer(&model, config, tp);
            let wire = wire.clone();
            trainer
                .on_every_rank(move |engine| {
                    let batch = Batch::new(&wire, &engine.config().loss)?;
                    engine.zero_grad();
                    engine.accumulate_gradients(&batch, 4, 0.9)?;
                    engine.gradients()
                })
                .unwrap()
        };
        let whole = gradients(1, false);
        for tp in [2, 4] {
            let (diff, name) = max_diff(&gradients(tp, false), &whole);
            eprintln!("{}: TP={tp} max gradient difference from TP=1 {diff:e} (`{name}`)", loss["type"]);
            assert!(diff <= 1e-5, "{loss}: TP={tp} gradient of `{name}` differs by {diff:e}");
        }
        // Sequences packed into microbatches of at most 30 tokens, at TP 1 and 2.
        for tp in [1, 2] {
            let (diff, name) = max_diff(&gradients(tp, true), &whole);
            eprintln!("{}: packed at TP={tp} max gradient difference {diff:e} (`{name}`)", loss["type"]);
            assert!(diff <= 1e-5, "{loss}: packed at TP={tp} gradient of `{name}` differs by {diff:e}");
        }
    }
}

#[test]
fn five_steps_at_tp_2_and_4_give_the_weights_and_checkpoint_of_tp_1() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let mut saved = Vec::new();
    let mut metrics = Vec::new();
    for tp in [1, 2, 4] {
        let mut trainer = trainer(&model, training(), tp);
        let trained = trainer.train(rows(), 1.0).unwrap();
        assert_eq!(trained.steps.len(), 5);
        assert_eq!(trainer.step(), 5);
        metrics.push(trained.steps.iter().map(|s| (s.metrics["loss"], s.metrics["grad_norm"])).collect::<Vec<_>>());
        let path = dir.path().join(format!("tp{tp}"));
        let (step, files) = trainer.save(path.clone(), json!({"tp": tp})).unwrap();
        assert_eq!(step, 5);
        assert!(files.iter().any(|f| f.ends_with(".safetensors")), "{files:?}");
        saved.push(path);
    }
    // Clipping was active (the norm is above 0.5), so the global norm had to be right.
    assert!(metrics[0].iter().any(|(_, norm)| *norm > 0.5), "{:?}", metrics[0]);
    for (tp, run) in [(2, &metrics[1]), (4, &metrics[2])] {
        for ((loss, norm), (loss1, norm1)) in run.iter().zip(&metrics[0]) {
            assert!((loss - loss1).abs() <= 1e-5 && (norm - norm1).abs() <= 1e-5 * norm1.max(1.0), "TP={tp}: {run:?}");
        }
    }
    // The TP checkpoints load at TP = 1 with the same weights and optimiser state.
    let reference = weights(&saved[0]);
    let optimizer = tensors(&saved[0].join("optimizer.safetensors"));
    for (tp, path) in [(2, &saved[1]), (4, &saved[2])] {
        let (diff, name) = max_diff(&weights(path), &reference);
        eprintln!("TP={tp}: five steps, max weight difference from TP=1 {diff:e} (`{name}`)");
        assert!(diff <= 1e-5, "TP={tp}: weight `{name}` differs by {diff:e} after five steps");
        let (diff, name) = max_diff(&tensors(&path.join("optimizer.safetensors")), &optimizer);
        assert!(diff <= 1e-5, "TP={tp}: optimiser state `{name}` differs by {diff:e}");
    }
    // Transformers loads the TP = 2 checkpoint and scores as Keel does.
    let sequences = vec![vec![5, 17, 200, 31, 9, 64], vec![100, 3, 3, 77]];
    let hf = keel_testkit::reference_logprobs(&saved[1], &sequences, 1.0, dir.path());
    let mut one = trainer(&saved[1], training(), 1);
    let ours: Vec<Vec<f64>> = one
        .logprobs(Default::default(), sequences.clone(), 1.0)
        .unwrap()
        .into_iter()
        .map(|row| row.into_iter().map(f64::from).collect())
        .collect();
    let diff = keel_testkit::max_abs_diff(&ours, &hf);
    assert!(diff <= 1e-4, "transformers on the TP=2 checkpoint: max diff {diff:e}");

    // Resuming the TP = 2 checkpoint at TP = 2 and at TP = 1: one more step each, the same.
    let more: TrainBatch = TrainBatch {
        input_ids: rows().input_ids[..4].to_vec(),
        token_mask: rows().token_mask[..4].to_vec(),
        ..Default::default()
    };
    let mut resumed = Vec::new();
    for tp in [1, 2] {
        let mut trainer = trainer(&saved[1], training(), tp);
        assert_eq!(trainer.step(), 5, "TP={tp} resumes at step 5");
        trainer.train(more.clone(), 1.0).unwrap();
        let path = dir.path().join(format!("resumed-tp{tp}"));
        trainer.save(path.clone(), json!({})).unwrap();
        resumed.push(weights(&path));
    }
    let (diff, name) = max_diff(&resumed[1], &resumed[0]);
    assert!(diff <= 1e-5, "resumed at TP=2 vs TP=1: `{name}` differs by {diff:e}");
}

#[test]
fn what_tensor_parallelism_cannot_do_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let load = |training: Value, tp: usize| {
        let mut request = load_request(&model, training);
        request.tensor_parallel_size = tp;
        Trainer::load(&request, "cpu").map(|_| ()).unwrap_err().to_string()
    };
    let error = load(training(), 3);
    assert!(error.contains("num_attention_heads"), "{error}");
    let error = load(json!({"loss": {"type": "bradley_terry"}, "global_batch_size": 2, "micro_batch_size": 2}), 2);
    assert!(error.contains("tensor_parallel_size"), "{error}");
    let error = load(training(), 0);
    assert!(error.contains("tensor_parallel_size"), "{error}");
}
