//! Training under tensor and data parallelism on the CPU collectives, against the same
//! training on one rank on a tiny Qwen3 (4 heads, 2 KV heads: split at TP = 2, replicated at
//! TP = 4): gradients, five AdamW steps with clipping, the checkpoint (loaded at TP = 1 and in
//! transformers), and resuming from it at either size; data parallelism (DP = 2, 3 and
//! DP = 2 × TP = 2, on the thread backend and on the TCP backend) with its sharded optimiser.

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
    grid_trainer(model, training, 1, tp)
}

fn grid_trainer(model: &Path, training: Value, dp: usize, tp: usize) -> Trainer {
    let mut request = load_request(model, training);
    request.tensor_parallel_size = tp;
    request.data_parallel_size = dp;
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

/// A reward model (a value head on the final hidden states) trains at TP 2 as at TP 1: the
/// same Bradley–Terry losses and, after them, the same scores.
#[test]
fn a_reward_model_trains_at_tp_2_as_at_tp_1() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let training = json!({
        "loss": {"type": "bradley_terry"}, "global_batch_size": 8, "micro_batch_size": 4, "optimizer": {"lr": 2e-3},
    });
    let pairs = common::preferences(&(0..8).map(|i| 30 + 11 * i).collect::<Vec<_>>());
    let held_out = common::preferences(&(0..4).map(|i| 33 + 17 * i).collect::<Vec<_>>());
    let runs: Vec<(Vec<f64>, Vec<f32>)> = [1, 2]
        .into_iter()
        .map(|tp| {
            let mut trainer = trainer(&model, training.clone(), tp);
            let losses = (0..3).map(|_| trainer.train(pairs.clone(), 1.0).unwrap().steps[0].metrics["loss"]).collect();
            (losses, trainer.scores(&held_out.input_ids).unwrap())
        })
        .collect();
    let ((losses1, scores1), (losses2, scores2)) = (&runs[0], &runs[1]);
    for (a, b) in losses1.iter().zip(losses2) {
        assert!((a - b).abs() <= 1e-5, "losses {losses1:?} at TP 1, {losses2:?} at TP 2");
    }
    for (a, b) in scores1.iter().zip(scores2) {
        assert!((a - b).abs() <= 1e-4, "scores {scores1:?} at TP 1, {scores2:?} at TP 2");
    }
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
    let error = load(training(), 0);
    assert!(error.contains("tensor_parallel_size"), "{error}");
}

/// Five steps (loss, gradient norm), the weights and optimiser state after them, and the
/// checkpoint's directory, at DP × TP.
fn five_steps(model: &Path, dir: &Path, dp: usize, tp: usize) -> (Vec<(f64, f64)>, std::path::PathBuf) {
    let mut trainer = grid_trainer(model, training(), dp, tp);
    assert_eq!((trainer.data_parallel_size(), trainer.tensor_parallel_size()), (dp, tp));
    let trained = trainer.train(rows(), 1.0).unwrap();
    assert_eq!(trainer.step(), 5);
    let path = dir.join(format!("dp{dp}-tp{tp}"));
    let (_, files) = trainer.save(path.clone(), json!({})).unwrap();
    assert!(files.iter().any(|f| f.ends_with(".safetensors")), "DP={dp} TP={tp}: {files:?}");
    (trained.steps.iter().map(|s| (s.metrics["loss"], s.metrics["grad_norm"])).collect(), path)
}

fn assert_same_run(label: &str, run: &[(f64, f64)], one: &[(f64, f64)], path: &Path, reference: &Path) {
    for ((loss, norm), (loss1, norm1)) in run.iter().zip(one) {
        assert!(
            (loss - loss1).abs() <= 1e-5 && (norm - norm1).abs() <= 1e-5 * norm1.max(1.0),
            "{label}: {run:?} vs {one:?}"
        );
    }
    let (diff, name) = max_diff(&weights(path), &weights(reference));
    eprintln!("{label}: five steps, max weight difference from one rank {diff:e} (`{name}`)");
    assert!(diff <= 1e-5, "{label}: weight `{name}` differs by {diff:e} after five steps");
    let optimizer = |p: &Path| tensors(&p.join("optimizer.safetensors"));
    let (diff, name) = max_diff(&optimizer(path), &optimizer(reference));
    assert!(diff <= 1e-5, "{label}: optimiser state `{name}` differs by {diff:e}");
}

#[test]
fn five_steps_at_dp_2_3_and_dp_2_by_tp_2_equal_one_rank_and_resume_anywhere() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let (one, reference) = five_steps(&model, dir.path(), 1, 1);
    // Clipping was active, so the global norm over the summed gradients had to be right.
    assert!(one.iter().any(|(_, norm)| *norm > 0.5), "{one:?}");
    let mut grid = None;
    for (dp, tp) in [(2, 1), (3, 1), (2, 2)] {
        let (run, path) = five_steps(&model, dir.path(), dp, tp);
        assert_same_run(&format!("DP={dp} TP={tp}"), &run, &one, &path, &reference);
        grid = Some(path);
    }
    // The DP = 2 × TP = 2 checkpoint resumes at DP = 1 × TP = 1 and at DP = 2: one more step
    // each, the same weights.
    let grid = grid.unwrap();
    let more: TrainBatch = TrainBatch {
        input_ids: rows().input_ids[..4].to_vec(),
        token_mask: rows().token_mask[..4].to_vec(),
        ..Default::default()
    };
    let mut resumed = Vec::new();
    for (dp, tp) in [(1, 1), (2, 1)] {
        let mut trainer = grid_trainer(&grid, training(), dp, tp);
        assert_eq!(trainer.step(), 5, "DP={dp} TP={tp} resumes at step 5");
        trainer.train(more.clone(), 1.0).unwrap();
        let path = dir.path().join(format!("resumed-dp{dp}-tp{tp}"));
        trainer.save(path.clone(), json!({})).unwrap();
        resumed.push(path);
    }
    let (diff, name) = max_diff(&weights(&resumed[1]), &weights(&resumed[0]));
    assert!(diff <= 1e-5, "resumed at DP=2 vs DP=1: `{name}` differs by {diff:e}");
}

/// A global batch smaller than the group leaves a rank without rows; it still takes part
/// (zero gradients), and the step is the single rank's. Metrics combine by kind.
#[test]
fn a_data_parallel_rank_without_rows_still_steps_with_the_group() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let five: TrainBatch = TrainBatch {
        input_ids: rows().input_ids[..5].to_vec(),
        token_mask: rows().token_mask[..5].to_vec(),
        ..Default::default()
    };
    let mut results = Vec::new();
    for dp in [1, 2] {
        let mut trainer = grid_trainer(&model, training(), dp, 1);
        // Two steps: 4 rows, then 1 row (DP rank 0 has none of it).
        let trained = trainer.train(five.clone(), 1.0).unwrap();
        let path = dir.path().join(format!("five-dp{dp}"));
        trainer.save(path.clone(), json!({})).unwrap();
        results.push((trained.steps, weights(&path)));
    }
    let (one, two) = (&results[0], &results[1]);
    assert_eq!(one.0.len(), 2);
    for (a, b) in one.0.iter().zip(&two.0) {
        assert_eq!(a.metrics.keys().collect::<Vec<_>>(), b.metrics.keys().collect::<Vec<_>>());
        for (name, value) in &a.metrics {
            let other = b.metrics[name];
            assert!((value - other).abs() <= 1e-5 * value.abs().max(1.0), "step {}: {name} {value} vs {other}", a.step);
        }
    }
    let (diff, name) = max_diff(&two.1, &one.1);
    assert!(diff <= 1e-5, "DP=2 with an empty shard: `{name}` differs by {diff:e}");
}

/// Data parallelism over the TCP backend (the ranks could be processes on several hosts;
/// here they are threads on loopback): the same five steps as one rank.
#[test]
fn data_parallel_ranks_over_tcp_step_as_one_rank() {
    use keel_collective::tcp::TcpCollective;
    use keel_training::Engine;
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let (one, reference) = five_steps(&model, dir.path(), 1, 1);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hub = listener.local_addr().unwrap();
    let timeout = std::time::Duration::from_secs(60);
    let out = dir.path().join("tcp");
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let listener = listener.try_clone().unwrap();
            let (model, out) = (model.clone(), out.clone());
            std::thread::spawn(move || {
                let comm = if rank == 0 {
                    TcpCollective::accept(&listener, 2, "dp-test", timeout).unwrap()
                } else {
                    TcpCollective::connect(hub, rank, 2, "dp-test", timeout).unwrap()
                };
                let request = load_request(&model, training());
                let mut engine = Engine::load_group(&request, "cpu", None, Some(Arc::new(comm))).unwrap();
                let batch = Batch::new(&rows(), &engine.config().loss).unwrap();
                let trained = engine.train(batch, 1.0).unwrap();
                let files = engine.save(&out, json!({})).unwrap();
                assert_eq!(files.is_empty(), rank != 0, "the first replica writes the checkpoint");
                trained.steps.iter().map(|s| (s.metrics["loss"], s.metrics["grad_norm"])).collect::<Vec<_>>()
            })
        })
        .collect();
    let runs: Vec<Vec<(f64, f64)>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(runs[0], runs[1], "both ranks report the group's metrics");
    assert_same_run("DP=2 over TCP", &runs[0], &one, &out, &reference);
}

/// Each replica scores its share of the rows (one of them none when there are fewer rows
/// than replicas); every replica returns the whole, as one rank computes it.
#[test]
fn data_parallel_replicas_split_the_logprobs_and_return_the_whole() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let sequences: Vec<Vec<i64>> = rows().input_ids[..5].to_vec();
    let one = grid_trainer(&model, training(), 1, 1).logprobs(Default::default(), sequences.clone(), 1.0).unwrap();
    for (dp, tp, n) in [(2, 1, 5), (3, 1, 5), (3, 1, 2), (2, 2, 5)] {
        let mut trainer = grid_trainer(&model, training(), dp, tp);
        let got = trainer.logprobs(Default::default(), sequences[..n].to_vec(), 1.0).unwrap();
        assert_eq!(got.len(), n, "DP={dp} TP={tp}: {n} rows");
        for (row, (a, b)) in got.iter().zip(&one).enumerate() {
            assert_eq!(a.len(), b.len(), "DP={dp} TP={tp}: row {row}'s length");
            let diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(diff <= 1e-5, "DP={dp} TP={tp}: row {row} differs by {diff:e}");
        }
    }
}

#[test]
fn what_data_parallelism_cannot_do_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    for (dp, tp) in [(0, 1), (33, 2)] {
        let mut request = load_request(&model, training());
        request.data_parallel_size = dp;
        request.tensor_parallel_size = tp;
        let error = Trainer::load(&request, "cpu").map(|_| ()).unwrap_err().to_string();
        assert!(error.contains("data_parallel_size"), "DP={dp} TP={tp}: {error}");
    }
}
