//! The training engine on a tiny `keel model init` model: microbatch invariance of loss and
//! gradients, SFT / DPO / reward-model training that learns, f32 master weights under bf16
//! compute, and checkpoints that resume exactly; SFT (whole and LoRA), DPO and reward models
//! learning on a tiny model of every other architecture.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use common::*;
use keel_protocol::trainer::{Advantages, Scorer, TrainBatch};
use keel_training::Engine;
use keel_training::batch::Batch;
use serde_json::json;
use tch::{Kind, Tensor};

/// Deterministic noise in [−scale, scale).
fn noise(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            scale * (2.0 * ((x >> 40) as f32 / (1u64 << 24) as f32) - 1.0)
        })
        .collect()
}

/// Eight rows of different lengths with every optional field filled.
fn rich_batch(engine: &mut Engine) -> TrainBatch {
    let starts = [11, 40, 75, 120, 160, 201, 230, 260];
    let mut batch = counting(&starts, 0, 2);
    batch.input_ids = starts.iter().enumerate().map(|(i, &s)| (s..s + 5 + (i as i64 * 3) % 8).collect()).collect();
    batch.token_mask =
        batch.input_ids.iter().map(|r| (0..r.len()).map(|i| if i < 2 { 0.0 } else { 1.0 }).collect()).collect();
    let lp = engine.logprobs(Scorer::Policy, &batch.input_ids, 1.0).unwrap();
    let perturbed = |seed: u64, scale: f32| -> Vec<Vec<f32>> {
        lp.iter()
            .enumerate()
            .map(|(r, row)| {
                let n = noise(seed + r as u64, row.len(), scale);
                row.iter().zip(n).enumerate().map(|(i, (x, d))| if i == 0 { 0.0 } else { x + d }).collect()
            })
            .collect()
    };
    batch.prev_logprobs = Some(perturbed(1, 0.3));
    batch.generation_logprobs = Some(perturbed(2, 0.3));
    batch.reference_logprobs = Some(perturbed(3, 1.0));
    batch.advantages = Some(Advantages::PerSample(noise(4, 8, 1.5)));
    batch.sample_mask = Some(vec![1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
    batch
}

fn loss_and_gradients(engine: &mut Engine, batch: &Batch, micro: usize) -> (f64, BTreeMap<String, Tensor>) {
    engine.zero_grad();
    let metrics = engine.accumulate_gradients(batch, micro, 0.7).unwrap();
    let grads = engine.gradients().unwrap();
    engine.zero_grad();
    (metrics.get("loss").unwrap(), grads)
}

#[test]
fn loss_and_gradients_do_not_depend_on_the_microbatch_split() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let losses = [
        json!({"type": "clipped_pg", "use_importance_sampling_correction": true, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio_max": 2.0, "reference_policy_kl_penalty": 0.1}),
        json!({"type": "clipped_pg", "token_level_loss": false, "sequence_level_importance_ratios": true}),
        json!({"type": "nll"}),
        json!({"type": "dpo", "sft_loss_weight": 0.3}),
        json!({"type": "bradley_terry"}),
    ];
    for loss in losses {
        let mut engine = engine(&model, json!({"loss": loss, "global_batch_size": 8, "micro_batch_size": 8}));
        let wire = rich_batch(&mut engine);
        let batch = Batch::new(&wire, &engine.config().loss).unwrap();
        let (whole, whole_grads) = loss_and_gradients(&mut engine, &batch, 8);
        assert!(whole.is_finite() && whole != 0.0, "{loss}: {whole}");
        for micro in [4, 2] {
            let (split, grads) = loss_and_gradients(&mut engine, &batch, micro);
            assert!((split - whole).abs() < 1e-6, "{loss} micro {micro}: loss {split} vs {whole}");
            let mut largest = 0.0f64;
            for (name, g) in &whole_grads {
                // f32 sums in another order: 1e-6, relative to gradients larger than 1.
                let scale = g.abs().max().double_value(&[]);
                let diff = (&grads[name] - g).abs().max().double_value(&[]);
                assert!(
                    diff < 1e-6 * scale.max(1.0),
                    "{loss} micro {micro}: gradient of {name} (max {scale}) differs by {diff}"
                );
                largest = largest.max(scale);
            }
            assert!(largest > 1e-4, "{loss}: gradients are all ~0 ({largest})");
        }
    }
}

/// Sequence packing and dynamic batching (microbatches by a token budget) give the loss,
/// the gradients and the logprobs of the plain padded microbatches (1e-5, f32).
#[test]
fn packed_and_dynamic_microbatches_match_padded_ones() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let losses = [
        json!({"type": "clipped_pg", "reference_policy_kl_penalty": 0.1, "ratio_clip_c": 3.0}),
        json!({"type": "clipped_pg", "token_level_loss": false, "sequence_level_importance_ratios": true}),
        json!({"type": "nll"}),
        json!({"type": "dpo", "sft_loss_weight": 0.3}),
    ];
    let budget = json!({"enabled": true, "train_mb_tokens": 24, "logprob_mb_tokens": 17});
    for loss in losses {
        let config = |extra: (&str, &serde_json::Value)| {
            let mut c = json!({"loss": loss, "global_batch_size": 8, "micro_batch_size": 8});
            c[extra.0] = extra.1.clone();
            c
        };
        let mut plain = engine(&model, config(("sequence_packing", &json!({"enabled": false}))));
        let wire = rich_batch(&mut plain);
        let batch = |e: &Engine| Batch::new(&wire, &e.config().loss).unwrap();
        let padded = batch(&plain);
        let (want, want_grads) = loss_and_gradients(&mut plain, &padded, 8);
        let want_logprobs = plain.logprobs(Scorer::Policy, &wire.input_ids, 0.7).unwrap();
        for mode in ["sequence_packing", "dynamic_batching"] {
            let mut other = engine(&model, config((mode, &budget)));
            let budgeted = batch(&other);
            let (got, grads) = loss_and_gradients(&mut other, &budgeted, 8);
            assert!((got - want).abs() < 1e-5, "{loss} {mode}: loss {got} vs {want}");
            for (name, g) in &want_grads {
                let scale = g.abs().max().double_value(&[]).max(1.0);
                let diff = (&grads[name] - g).abs().max().double_value(&[]);
                assert!(diff < 1e-5 * scale, "{loss} {mode}: gradient of {name} differs by {diff}");
            }
            let logprobs = other.logprobs(Scorer::Policy, &wire.input_ids, 0.7).unwrap();
            for (a, b) in logprobs.iter().flatten().zip(want_logprobs.iter().flatten()) {
                assert!((a - b).abs() < 1e-5, "{loss} {mode}: logprob {a} vs {b}");
            }
        }
    }
}

#[test]
fn sft_lowers_held_out_loss() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let training = json!({
        "loss": {"type": "nll"}, "global_batch_size": 16, "micro_batch_size": 8,
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0},
        "scheduler": {"warmup_steps": 5, "decay": "cosine", "total_steps": 100},
    });
    let mut engine = engine(&model, training);
    let train_starts: Vec<i64> = (0..64).map(|i| 20 + 5 * i).collect();
    let held_out = counting(&(0..16).map(|i| 22 + 5 * i).collect::<Vec<_>>(), 12, 2);
    let before = held_out_nll(&mut engine, &held_out);
    for _ in 0..25 {
        let batch = Batch::new(&counting(&train_starts, 12, 2), &engine.config().loss).unwrap();
        let trained = engine.train(batch, 1.0).unwrap();
        assert_eq!(trained.steps.len(), 4, "64 rows at global batch 16");
    }
    let after = held_out_nll(&mut engine, &held_out);
    eprintln!("SFT held-out NLL: {before:.3} -> {after:.3} after {} steps", engine.step());
    assert_eq!(engine.step(), 100);
    assert!(after < 0.5 * before, "held-out NLL {before} -> {after}");
}

/// Fraction of pairs whose implicit DPO reward (Σ policy − reference over the answer) prefers the chosen answer.
fn preference_accuracy(engine: &mut Engine, batch: &TrainBatch) -> f64 {
    let policy = engine.logprobs(Scorer::Policy, &batch.input_ids, 1.0).unwrap();
    let reference = engine.logprobs(Scorer::Reference, &batch.input_ids, 1.0).unwrap();
    let reward = |row: usize| -> f32 {
        (1..policy[row].len()).map(|i| (policy[row][i] - reference[row][i]) * batch.token_mask[row][i]).sum()
    };
    let pairs = batch.input_ids.len() / 2;
    (0..pairs).filter(|&p| reward(2 * p) > reward(2 * p + 1)).count() as f64 / pairs as f64
}

#[test]
fn dpo_learns_synthetic_preferences() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let training = json!({
        "loss": {"type": "dpo", "reference_policy_kl_penalty": 0.1},
        "global_batch_size": 32, "micro_batch_size": 16, "optimizer": {"lr": 2e-3},
    });
    let mut engine = engine(&model, training.clone());
    let held_out = preferences(&(0..20).map(|i| 33 + 17 * i).collect::<Vec<_>>());
    let before = preference_accuracy(&mut engine, &held_out);
    let train = preferences(&(0..32).map(|i| 30 + 11 * i).collect::<Vec<_>>());
    let mut last = BTreeMap::new();
    for _ in 0..20 {
        let trained = engine.train(Batch::new(&train, &engine.config().loss).unwrap(), 1.0).unwrap();
        last = trained.steps.last().unwrap().metrics.clone();
    }
    let after = preference_accuracy(&mut engine, &held_out);
    eprintln!("DPO held-out preference accuracy: {before:.2} -> {after:.2}; last step {last:?}");
    assert!(after > 0.9, "held-out accuracy {after}");
    assert!(last["loss"] < std::f64::consts::LN_2, "{last:?}");

    // Resumed from its checkpoint without naming a reference, the run keeps its original one.
    let saved = dir.path().join("dpo-step-20");
    engine.save(&saved, json!(null)).unwrap();
    let mut resumed = common::engine(&saved, training);
    let reference = |e: &mut Engine| e.logprobs(Scorer::Reference, &held_out.input_ids, 1.0).unwrap();
    assert_eq!(reference(&mut resumed), reference(&mut engine));
    assert_eq!(preference_accuracy(&mut resumed, &held_out), after);
}

/// `evaluate` gives the metrics the first training step would (the same loss over the same
/// global batch, whatever the microbatch split) and changes nothing: no step, the same weights.
#[test]
fn evaluation_is_a_training_step_without_the_update() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let training = |micro: usize| {
        json!({
            "loss": {"type": "dpo", "reference_policy_kl_penalty": 0.1, "sft_loss_weight": 0.2},
            "global_batch_size": 32, "micro_batch_size": micro, "optimizer": {"lr": 2e-3},
        })
    };
    let pairs = preferences(&(0..16).map(|i| 30 + 11 * i).collect::<Vec<_>>());
    let batch = |e: &Engine| Batch::new(&pairs, &e.config().loss).unwrap();
    let mut engine = engine(&model, training(4));
    let policy = |e: &mut Engine| e.logprobs(Scorer::Policy, &pairs.input_ids, 1.0).unwrap();
    let before = policy(&mut engine);
    let evaluated = engine.evaluate(batch(&engine), 1.0).unwrap();
    assert_eq!(engine.step(), 0);
    assert_eq!(policy(&mut engine), before, "evaluation changed the weights");
    let mut whole = common::engine(&model, training(32));
    let one_microbatch = whole.evaluate(batch(&whole), 1.0).unwrap();
    let trained = engine.train(batch(&engine), 1.0).unwrap();
    let first = &trained.steps[0].metrics;
    for name in ["loss", "preference_loss", "sft_loss", "accuracy", "rewards_margin_mean", "global_valid_tokens"] {
        let (got, split, want) = (evaluated.metrics[name], one_microbatch.metrics[name], first[name]);
        assert!((got - want).abs() < 1e-5 && (split - want).abs() < 1e-5, "{name}: {got} / {split} vs {want}");
    }
    assert!(!evaluated.metrics.contains_key("grad_norm") && !evaluated.metrics.contains_key("lr"));
}

#[test]
fn reward_model_separates_chosen_from_rejected_and_its_head_is_saved() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let training = json!({
        "loss": {"type": "bradley_terry"}, "global_batch_size": 32, "micro_batch_size": 16,
        "optimizer": {"lr": 2e-3},
    });
    let mut engine = engine(&model, training.clone());
    assert!(engine.has_value_head());
    let train = preferences(&(0..32).map(|i| 30 + 11 * i).collect::<Vec<_>>());
    for _ in 0..20 {
        engine.train(Batch::new(&train, &engine.config().loss).unwrap(), 1.0).unwrap();
    }
    let held_out = preferences(&(0..20).map(|i| 33 + 17 * i).collect::<Vec<_>>());
    let scores = engine.scores(&held_out.input_ids).unwrap();
    let separated = scores.chunks(2).filter(|p| p[0] > p[1]).count() as f64 / (scores.len() / 2) as f64;
    eprintln!("RM held-out pairs ranked correctly: {separated:.2}");
    assert!(separated > 0.9, "{separated}: {scores:?}");

    let saved = dir.path().join("rm-step-20");
    let files = engine.save(&saved, json!({"note": "rm"})).unwrap();
    assert!(files.contains(&"value_head.safetensors".to_string()), "{files:?}");
    // A scoring-only load of the checkpoint has the head and gives the same scores.
    let scorer =
        common::engine(&saved, json!({"loss": {"type": "nll"}, "global_batch_size": 4, "micro_batch_size": 4}));
    assert!(scorer.has_value_head());
    assert_eq!(scorer.scores(&held_out.input_ids).unwrap(), scores);
}

#[test]
fn bf16_compute_keeps_f32_master_weights() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let mut request = load_request(
        &model,
        json!({
            "loss": {"type": "nll"}, "global_batch_size": 8, "micro_batch_size": 4, "optimizer": {"lr": 1e-5},
        }),
    );
    request.dtype = Some("bf16".into());
    let mut engine = Engine::load(&request, "cpu").unwrap();
    let original = keel_model::CausalLm::load(&model, tch::Device::Cpu, Kind::Float).unwrap().var_store().variables();
    engine
        .train(
            Batch::new(&counting(&(0..8).map(|i| 30 + 9 * i).collect::<Vec<_>>(), 10, 2), &engine.config().loss)
                .unwrap(),
            1.0,
        )
        .unwrap();
    let saved = dir.path().join("bf16-ckpt");
    engine.save(&saved, json!(null)).unwrap();
    let state: BTreeMap<String, Tensor> =
        Tensor::read_safetensors(saved.join("optimizer.safetensors")).unwrap().into_iter().collect();
    let name = "model.layers.0.mlp.up_proj.weight";
    let master = &state[&format!("master.{name}")];
    assert_eq!(master.kind(), Kind::Float);
    let params = engine.policy().var_store().variables();
    assert_eq!(params[name].kind(), Kind::BFloat16);
    // The parameter is the master rounded to bf16, and the master moved by less than bf16 can hold.
    assert!(params[name].to_kind(Kind::Float).equal(&master.to_kind(Kind::BFloat16).to_kind(Kind::Float)));
    let moved = (master - original[name].to_kind(Kind::Float)).abs().max().double_value(&[]);
    assert!(moved > 0.0 && moved < 1e-4, "master moved by {moved}");
}

#[test]
fn a_checkpoint_resumes_exactly_and_is_never_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let training = json!({
        "loss": {"type": "nll"}, "global_batch_size": 8, "micro_batch_size": 4,
        "optimizer": {"lr": 1e-3}, "scheduler": {"warmup_steps": 4},
    });
    let batch = counting(&(0..8).map(|i| 30 + 9 * i).collect::<Vec<_>>(), 10, 2);
    let mut first = engine(&model, training.clone());
    for _ in 0..2 {
        first.train(Batch::new(&batch, &first.config().loss).unwrap(), 1.0).unwrap();
    }
    let saved = dir.path().join("step-2");
    let files = first.save(&saved, json!({"consumed_samples": 16})).unwrap();
    for file in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        assert!(files.contains(&file.to_string()), "{file} missing from {files:?}");
    }
    let err = first.save(&saved, json!(null)).unwrap_err().to_string();
    assert!(err.contains("already exists"), "{err}");
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name())
        .filter(|n| n.to_string_lossy().contains("partial"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    let mut resumed = engine(&saved, training);
    assert_eq!(resumed.step(), 2);
    let a = first.train(Batch::new(&batch, &first.config().loss).unwrap(), 1.0).unwrap();
    let b = resumed.train(Batch::new(&batch, &resumed.config().loss).unwrap(), 1.0).unwrap();
    assert_eq!(a.steps[0].metrics["lr"], b.steps[0].metrics["lr"], "the schedule resumed at step 2");
    let (pa, pb) = (first.policy().var_store().variables(), resumed.policy().var_store().variables());
    for (name, value) in &pa {
        let diff = (value - &pb[name]).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{name} differs by {diff} after the resumed step");
    }
}

#[test]
fn an_offloaded_reference_scores_like_a_resident_one() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let training = json!({"loss": {"type": "dpo"}, "global_batch_size": 4, "micro_batch_size": 2});
    let ids = preferences(&[30, 41]).input_ids;
    let mut resident = engine(&model, training.clone());
    let mut request = load_request(&model, training);
    request.reference_offload = true;
    let mut offloaded = Engine::load(&request, "cpu").unwrap();
    let a = resident.logprobs(Scorer::Reference, &ids, 0.9).unwrap();
    assert_eq!(offloaded.logprobs(Scorer::Reference, &ids, 0.9).unwrap(), a);
    assert_eq!(offloaded.logprobs(Scorer::Policy, &ids, 0.9).unwrap(), a, "policy = reference before training");
}

/// With one optimiser step over the batch, the policy's logprobs before the update are taken
/// from the training forward (detached) instead of a pass of their own: the step's metrics and
/// the updated weights are those of training with a separate pass's logprobs (1e-6, f32).
/// With two optimiser steps the separate pass still runs.
#[test]
fn one_update_takes_the_logprobs_before_it_from_its_own_forward() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let loss =
        json!({"type": "clipped_pg", "reference_policy_kl_penalty": 0.1, "use_importance_sampling_correction": true});
    let config = |global: usize| json!({"loss": loss, "global_batch_size": global, "micro_batch_size": 4});
    let mut separate = engine(&model, config(8));
    let mut reused = engine(&model, config(8));
    let mut wire = rich_batch(&mut separate);
    wire.prev_logprobs = Some(separate.logprobs(Scorer::Policy, &wire.input_ids, 0.7).unwrap());
    let with_pass = separate.train(Batch::new(&wire, &separate.config().loss).unwrap(), 0.7).unwrap();
    wire.prev_logprobs = None;
    let from_forward = reused.train(Batch::new(&wire, &reused.config().loss).unwrap(), 0.7).unwrap();
    assert!(!from_forward.timing.contains_key("prev_logprobs"), "{:?}", from_forward.timing);
    assert_eq!(with_pass.steps.len(), 1);
    for (name, value) in &with_pass.steps[0].metrics {
        let other = from_forward.steps[0].metrics[name];
        assert!((value - other).abs() <= 1e-6 * value.abs().max(1.0), "{name}: {value} vs {other}");
    }
    let after = |engine: &mut Engine| engine.logprobs(Scorer::Policy, &wire.input_ids, 1.0).unwrap();
    let (a, b) = (after(&mut separate), after(&mut reused));
    let before = reused.logprobs(Scorer::Reference, &wire.input_ids, 1.0).unwrap();
    let mut moved = 0.0f32;
    for ((x, y), r) in a.iter().flatten().zip(b.iter().flatten()).zip(before.iter().flatten()) {
        assert!((x - y).abs() <= 1e-6 * x.abs().max(1.0), "updated weights differ: {x} vs {y}");
        moved = moved.max((x - r).abs());
    }
    assert!(moved > 1e-4, "the update moved the policy ({moved})");

    // Two optimiser steps: the second one's "before" is not the first one's forward.
    let mut two = engine(&model, config(4));
    let two_steps = two.train(Batch::new(&wire, &two.config().loss).unwrap(), 0.7).unwrap();
    assert_eq!(two_steps.steps.len(), 2);
    assert!(two_steps.timing.contains_key("prev_logprobs"), "{:?}", two_steps.timing);
}

/// SFT (whole and LoRA), DPO and a reward model each learn on a tiny model of every other
/// architecture (a few steps each, on the same synthetic data as the Qwen3 tests above).
#[test]
fn every_architecture_learns_sft_lora_sft_dpo_and_a_reward_model() {
    use keel_model::Architecture as A;
    let families = [
        A::Llama,
        A::Qwen2,
        A::Mistral,
        A::Qwen3Moe,
        A::Mixtral,
        A::Gemma2,
        A::Gemma3,
        A::Phi3,
        A::Olmo2,
        A::Olmo3,
        A::Glm4,
        A::Granite,
        A::SmolLm3,
    ];
    // Granite's multipliers (logits ÷ 8, branches × 0.22) shrink its gradients: like its own
    // recipes, it trains at a larger learning rate.
    let sft = |arch: A, lora: bool| {
        let scale: f64 = if arch == A::Granite { 10.0 } else { 1.0 };
        let mut training = json!({
            "loss": {"type": "nll"}, "global_batch_size": 16, "micro_batch_size": 16,
            "optimizer": {"lr": 3e-3 * scale, "weight_decay": 0.0},
        });
        if lora {
            training["lora"] = json!({"enabled": true, "rank": 8, "alpha": 32});
            training["optimizer"]["lr"] = json!(1e-2 * scale.sqrt());
        }
        training
    };
    let mut problems = Vec::new();
    for arch in families {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_model_of(dir.path(), arch);
        let train = counting(&(0..16).map(|i| 20 + 5 * i).collect::<Vec<_>>(), 12, 2);
        let held_out = counting(&(0..8).map(|i| 22 + 5 * i).collect::<Vec<_>>(), 12, 2);
        for lora in [false, true] {
            let mut engine = common::engine(&model, sft(arch, lora));
            let before = held_out_nll(&mut engine, &held_out);
            for _ in 0..8 {
                engine.train(Batch::new(&train, &engine.config().loss).unwrap(), 1.0).unwrap();
            }
            let after = held_out_nll(&mut engine, &held_out);
            eprintln!("{arch:?} SFT (LoRA {lora}): held-out NLL {before:.3} -> {after:.3}");
            // Granite's LoRA adapters act through those multipliers alone (no embedding or head
            // trains), so they move its loss far less in eight steps; PEFT scores them the same
            // (keel-model's LoRA tests).
            let fall = if arch == A::Granite && lora { 0.02 } else { 0.2 };
            let fell = after < before - fall;
            if !fell {
                problems.push(format!("{arch:?} SFT (LoRA {lora}): held-out NLL {before} -> {after}"));
            }
        }
        let pairs = preferences(&(0..16).map(|i| 30 + 11 * i).collect::<Vec<_>>());
        let dpo = json!({
            "loss": {"type": "dpo", "reference_policy_kl_penalty": 0.1},
            "global_batch_size": 32, "micro_batch_size": 32, "optimizer": {"lr": 2e-3},
        });
        let mut engine = common::engine(&model, dpo);
        let mut losses = Vec::new();
        for _ in 0..6 {
            let trained = engine.train(Batch::new(&pairs, &engine.config().loss).unwrap(), 1.0).unwrap();
            losses.push(trained.steps[0].metrics["loss"]);
        }
        eprintln!("{arch:?} DPO losses: {losses:.3?}");
        let learned = losses[5] < losses[0] && losses[5] < std::f64::consts::LN_2;
        if !learned {
            problems.push(format!("{arch:?} DPO: losses {losses:?}"));
        }
        let rm = json!({
            "loss": {"type": "bradley_terry"}, "global_batch_size": 32, "micro_batch_size": 32,
            "optimizer": {"lr": 2e-3},
        });
        let mut engine = common::engine(&model, rm);
        for _ in 0..6 {
            engine.train(Batch::new(&pairs, &engine.config().loss).unwrap(), 1.0).unwrap();
        }
        let scores = engine.scores(&pairs.input_ids).unwrap();
        let ranked = scores.chunks(2).filter(|p| p[0] > p[1]).count() as f64 / (scores.len() / 2) as f64;
        eprintln!("{arch:?} RM: training pairs ranked correctly {ranked:.2}");
        if ranked < 0.75 {
            problems.push(format!("{arch:?} RM: {ranked} of the training pairs ranked correctly"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
