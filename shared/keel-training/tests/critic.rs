//! PPO's critic in the trainer, on a tiny Qwen3: it learns the returns a batch brings (its
//! value loss falls), trains alone through its warm-up steps, is saved in the checkpoint's
//! `critic/` and resumes from there exactly, trains the same at DP = 2 as on one rank, and is
//! refused under tensor parallelism.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use common::*;
use keel_protocol::trainer::{Advantages, CriticLoad, LoadRequest, Scorer, TrainBatch};
use keel_protocol::training::OptimizerConfig;
use keel_training::Trainer;
use serde_json::json;

fn request(model: &Path, dp: usize, warmup_steps: u64) -> LoadRequest {
    let training = json!({
        "loss": {"type": "clipped_pg", "reference_policy_kl_penalty": 0.0},
        "global_batch_size": 4, "micro_batch_size": 2, "optimizer": {"lr": 1e-4}, "max_grad_norm": 1.0,
    });
    let mut request = load_request(model, training);
    request.critic = Some(CriticLoad {
        model: source(model),
        optimizer: OptimizerConfig { lr: 3e-3, weight_decay: 0.0, ..Default::default() },
        value_clip: Some(0.5),
        warmup_steps,
    });
    request.data_parallel_size = dp;
    request
}

/// Eight rows of different lengths (two optimiser steps of four), their first two tokens the
/// prompt.
fn rows() -> TrainBatch {
    let starts: Vec<i64> = (0..8).map(|i| 11 + 29 * i).collect();
    let mut batch = counting(&starts, 0, 2);
    batch.input_ids = starts.iter().enumerate().map(|(i, &s)| (s..s + 5 + i as i64 % 4).collect()).collect();
    batch.token_mask =
        batch.input_ids.iter().map(|r| (0..r.len()).map(|i| if i < 2 { 0.0 } else { 1.0 }).collect()).collect();
    batch
}

/// A PPO batch: the rows, per-token advantages of alternating sign, the critic's values now,
/// and returns that depend on the row and the position (what the critic has to learn).
fn ppo_batch(trainer: &mut Trainer) -> TrainBatch {
    let rows = rows();
    let values = trainer.logprobs(Scorer::Critic, rows.input_ids.clone(), 1.0).unwrap();
    let per_token = |f: &dyn Fn(usize, usize) -> f32| -> Vec<Vec<f32>> {
        rows.token_mask
            .iter()
            .enumerate()
            .map(|(i, mask)| mask.iter().enumerate().map(|(t, &m)| if m > 0.0 { f(i, t) } else { 0.0 }).collect())
            .collect()
    };
    let advantages = per_token(&|i, t| if (i + t) % 2 == 0 { 0.5 } else { -0.5 });
    let returns = per_token(&|i, t| if i % 2 == 0 { 0.2 * t as f32 } else { -0.4 });
    TrainBatch {
        advantages: Some(Advantages::PerToken(advantages)),
        values: Some(values),
        returns: Some(returns),
        ..rows
    }
}

/// Trains `calls` PPO batches; the mean value loss of each call.
fn train(trainer: &mut Trainer, calls: usize) -> Vec<f64> {
    (0..calls)
        .map(|_| {
            let batch = ppo_batch(trainer);
            let trained = trainer.train(batch, 1.0).unwrap();
            assert_eq!(trained.steps.len(), 2);
            trained.steps.iter().map(|s| s.metrics["value_loss"]).sum::<f64>() / 2.0
        })
        .collect()
}

#[test]
fn the_critic_learns_the_returns_warms_up_alone_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let mut trainer = Trainer::load(&request(&model, 1, 2), "cpu").unwrap();
    // The value head starts at zero: every value is 0.
    let values = trainer.logprobs(Scorer::Critic, rows().input_ids, 1.0).unwrap();
    assert!(values.iter().flatten().all(|&v| v == 0.0), "{values:?}");

    // Warm-up: the first call's two critic steps leave the policy as it was.
    let first = ppo_batch(&mut trainer);
    let trained = trainer.train(first, 1.0).unwrap();
    assert_eq!(trainer.step(), 0, "the policy waits for the critic's two warm-up steps");
    assert!(trained.steps.iter().all(|s| !s.metrics.contains_key("loss") && s.metrics.contains_key("value_loss")));
    let losses = train(&mut trainer, 12);
    assert_eq!(trainer.step(), 24, "then both train, one step per global batch");
    let (start, end) = (losses[0], losses[losses.len() - 1]);
    eprintln!("value loss by call: {losses:?}");
    assert!(end < 0.5 * start, "the critic learns the returns: value loss {start} → {end}");

    let saved = dir.path().join("step-13");
    let (_, files) = trainer.save(saved.clone(), json!({})).unwrap();
    for file in ["critic/model.safetensors", "critic/value_head.safetensors", "critic/optimizer.safetensors"] {
        assert!(files.contains(&file.to_string()), "{file} missing from {files:?}");
    }
    // Resumed from the checkpoint, the critic scores and trains exactly as the one that saved
    // it (its optimiser state and step came back too).
    let mut resumed = Trainer::load(&request(&saved, 1, 2), "cpu").unwrap();
    let ids = rows().input_ids;
    assert_eq!(
        trainer.logprobs(Scorer::Critic, ids.clone(), 1.0).unwrap(),
        resumed.logprobs(Scorer::Critic, ids.clone(), 1.0).unwrap()
    );
    let (a, b) = (train(&mut trainer, 1), train(&mut resumed, 1));
    assert_eq!(a, b, "the resumed critic's next value loss");
    assert_eq!(
        trainer.logprobs(Scorer::Critic, ids.clone(), 1.0).unwrap(),
        resumed.logprobs(Scorer::Critic, ids, 1.0).unwrap(),
        "the critic after one more step"
    );
    // A run without a critic loads the checkpoint's policy and leaves `critic/` alone.
    let mut plain = request(&saved, 1, 0);
    plain.critic = None;
    let mut policy = Trainer::load(&plain, "cpu").unwrap();
    let error = policy.logprobs(Scorer::Critic, rows().input_ids, 1.0).unwrap_err().to_string();
    assert!(error.contains("no critic"), "{error}");
}

#[test]
fn the_critic_trains_the_same_at_dp_2_and_tp_2() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let mut runs = Vec::new();
    let mut split = None;
    for (dp, tp) in [(1, 1), (2, 1), (1, 2)] {
        let mut load = request(&model, dp, 1);
        load.tensor_parallel_size = tp;
        let mut trainer = Trainer::load(&load, "cpu").unwrap();
        let losses = train(&mut trainer, 3);
        let values = trainer.logprobs(Scorer::Critic, rows().input_ids, 1.0).unwrap();
        runs.push(((dp, tp), losses, values));
        split = Some(trainer);
    }
    let (_, losses1, values1) = &runs[0];
    for (grid, losses, values) in &runs[1..] {
        for (a, b) in losses1.iter().zip(losses) {
            assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "value loss {losses1:?} whole, {losses:?} at {grid:?}");
        }
        for (a, b) in values1.iter().flatten().zip(values.iter().flatten()) {
            assert!((a - b).abs() <= 1e-5, "values after three calls differ at (DP, TP) {grid:?}: {a} vs {b}");
        }
    }
    // A TP 2 checkpoint holds the whole critic: resumed at TP 2 it scores as the one that
    // saved it, and at TP 1 as well.
    let mut split = split.unwrap();
    let saved = dir.path().join("tp-2");
    let (_, files) = split.save(saved.clone(), json!({})).unwrap();
    assert!(files.contains(&"critic/model.safetensors".to_string()), "{files:?}");
    let ids = rows().input_ids;
    let want = split.logprobs(Scorer::Critic, ids.clone(), 1.0).unwrap();
    for tp in [2, 1] {
        let mut load = request(&saved, 1, 1);
        load.tensor_parallel_size = tp;
        let got = Trainer::load(&load, "cpu").unwrap().logprobs(Scorer::Critic, ids.clone(), 1.0).unwrap();
        for (a, b) in want.iter().flatten().zip(got.iter().flatten()) {
            assert!((a - b).abs() <= 1e-5, "resumed at TP {tp}: {a} vs {b}");
        }
    }
}
