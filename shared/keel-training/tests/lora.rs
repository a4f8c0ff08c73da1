//! LoRA in the training engine: only the adapters train and sit in the optimiser, SFT's loss
//! falls, DPO's reference is the base model with no second copy, refits export the adapters
//! only, and a checkpoint holds the adapters in PEFT's layout and resumes exactly.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;

use common::*;
use keel_model::packing::Packed;
use keel_protocol::trainer::Scorer;
use keel_training::Engine;
use keel_training::batch::Batch;
use serde_json::{Value, json};
use tch::{Kind, Tensor};

fn sft(lora: Value) -> Value {
    json!({
        "loss": {"type": "nll"}, "global_batch_size": 16, "micro_batch_size": 8,
        "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
        "lora": lora,
    })
}

fn base_weights(engine: &Engine) -> HashMap<String, Tensor> {
    engine.policy().var_store().variables().into_iter().map(|(n, t)| (n, t.copy())).collect()
}

#[test]
fn lora_sft_trains_only_the_adapters_and_its_loss_falls() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let mut engine = engine(&model, sft(json!({"enabled": true, "rank": 8, "alpha": 16})));
    let whole = engine.policy();
    let layers = whole.config().num_hidden_layers as usize;
    assert_eq!(whole.adapter_tensors().len(), 2 * 7 * layers, "A and B on all seven linears of every layer");
    let before_weights = base_weights(&engine);
    let train_starts: Vec<i64> = (0..64).map(|i| 20 + 5 * i).collect();
    let held_out = counting(&(0..16).map(|i| 22 + 5 * i).collect::<Vec<_>>(), 12, 2);
    let before = held_out_nll(&mut engine, &held_out);
    // The adapters start at B = 0: the policy is its base, which is also the reference.
    let policy = engine.logprobs(Scorer::Policy, &held_out.input_ids, 1.0).unwrap();
    let mut losses = Vec::new();
    for _ in 0..25 {
        let batch = Batch::new(&counting(&train_starts, 12, 2), &engine.config().loss).unwrap();
        losses.extend(engine.train(batch, 1.0).unwrap().steps.iter().map(|s| s.metrics["loss"]));
    }
    let after = held_out_nll(&mut engine, &held_out);
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    eprintln!(
        "LoRA SFT: training loss {first:.3} -> {last:.3}, held-out NLL {before:.3} -> {after:.3} after {} steps",
        engine.step()
    );
    // With the embeddings and the head frozen, rank-8 adapters learn counting more slowly
    // than full fine-tuning (which halves the held-out NLL in these steps), but steadily.
    assert!(
        last < 0.9 * first && after < 0.9 * before,
        "training loss {first} -> {last}, held-out {before} -> {after}"
    );

    let grads = engine.gradients().unwrap();
    assert!(grads.keys().all(|n| n.contains(".lora_A.") || n.contains(".lora_B.")), "{:?}", grads.keys());
    for (name, value) in base_weights(&engine) {
        assert!(value.equal(&before_weights[&name]), "base weight {name} changed");
    }
    // The base model scores as it did before training.
    let base = engine.policy().with_base(|m| {
        let _no_grad = tch::no_grad_guard();
        let (ids, lengths) = keel_training::batch::pad_ids(&held_out.input_ids).unwrap();
        m.token_logprobs(&ids, &lengths, 1.0).unwrap()
    });
    let (_, lengths) = keel_training::batch::pad_ids(&held_out.input_ids).unwrap();
    let base = keel_training::batch::unpad(&base.to_device(tch::Device::Cpu), &lengths).unwrap();
    assert_eq!(base, policy);

    // A refit exports the adapters only.
    let Packed::Memory(buckets) =
        engine.export(Kind::Float, 1 << 20, &keel_model::packing::PackTarget::Memory).unwrap()
    else {
        panic!("memory")
    };
    let names: Vec<String> = buckets.iter().flat_map(|b| b.entries.iter().map(|t| t.name.clone())).collect();
    assert_eq!(names.len(), 2 * 7 * layers);
    assert!(names.iter().all(|n| n.ends_with(".lora_A.weight") || n.ends_with(".lora_B.weight")), "{names:?}");
}

#[test]
fn lora_dpo_scores_its_reference_with_the_base_model_and_learns() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let training = json!({
        "loss": {"type": "dpo", "reference_policy_kl_penalty": 0.1},
        "global_batch_size": 32, "micro_batch_size": 16, "optimizer": {"lr": 5e-3},
        "lora": {"enabled": true, "rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]},
    });
    let mut engine = engine(&model, training);
    let full = common::engine(&model, json!({"loss": {"type": "nll"}, "global_batch_size": 2, "micro_batch_size": 2}));
    let held_out = preferences(&(0..20).map(|i| 33 + 17 * i).collect::<Vec<_>>());
    let train = preferences(&(0..32).map(|i| 30 + 11 * i).collect::<Vec<_>>());
    let mut first = None;
    for _ in 0..20 {
        let trained = engine.train(Batch::new(&train, &engine.config().loss).unwrap(), 1.0).unwrap();
        first.get_or_insert(trained.steps[0].metrics["loss"]);
    }
    assert!((first.unwrap() - std::f64::consts::LN_2).abs() < 1e-6, "the first step starts at the reference");
    let mut full = full;
    let base = full.logprobs(Scorer::Policy, &held_out.input_ids, 1.0).unwrap();
    // The same model's logprobs; the two engines' microbatches lay the shared prompts out in
    // different trees, so only float rounding may differ.
    let reference = engine.logprobs(Scorer::Reference, &held_out.input_ids, 1.0).unwrap();
    let largest = reference.iter().flatten().zip(base.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(largest < 1e-5, "the reference differs from the base model's logprobs by {largest}");
    assert_ne!(engine.logprobs(Scorer::Policy, &held_out.input_ids, 1.0).unwrap(), base);
    let last = engine.evaluate(Batch::new(&held_out, &engine.config().loss).unwrap(), 1.0).unwrap();
    eprintln!("LoRA DPO held-out metrics after 20 steps: {:?}", last.metrics);
    assert!(last.metrics["loss"] < std::f64::consts::LN_2, "{:?}", last.metrics);
}

#[test]
fn a_lora_checkpoint_holds_peft_adapters_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let training = sft(json!({"enabled": true, "rank": 4, "alpha": 8, "dropout": 0.1}));
    let batch = counting(&(0..16).map(|i| 30 + 9 * i).collect::<Vec<_>>(), 10, 2);
    let mut first = engine(&model, training.clone());
    for _ in 0..2 {
        first.train(Batch::new(&batch, &first.config().loss).unwrap(), 1.0).unwrap();
    }
    let saved = dir.path().join("step-2");
    let files = first.save(&saved, json!({"consumed_samples": 32})).unwrap();
    for file in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        assert!(files.contains(&file.to_string()), "{file} missing from {files:?}");
    }
    for file in ["config.json", "model.safetensors"] {
        assert!(!files.contains(&file.to_string()), "{file} in a LoRA checkpoint: {files:?}");
    }
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(saved.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(
        config["base_model_name_or_path"].as_str(),
        Some(std::path::absolute(&model).unwrap().to_str().unwrap())
    );
    assert_eq!((config["r"].as_i64(), config["lora_alpha"].as_f64()), (Some(4), Some(8.0)));

    let mut resumed = engine(&saved, training.clone());
    assert_eq!(resumed.step(), 2);
    let held_out = counting(&[300, 310], 10, 2);
    assert_eq!(
        resumed.logprobs(Scorer::Policy, &held_out.input_ids, 1.0).unwrap(),
        first.logprobs(Scorer::Policy, &held_out.input_ids, 1.0).unwrap(),
    );
    // Dropout draws from torch's generator: the same seed before each step keeps the two in step.
    tch::manual_seed(3);
    first.train(Batch::new(&batch, &first.config().loss).unwrap(), 1.0).unwrap();
    tch::manual_seed(3);
    resumed.train(Batch::new(&batch, &resumed.config().loss).unwrap(), 1.0).unwrap();
    let (a, b) = (first.policy().adapter_tensors(), resumed.policy().adapter_tensors());
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        let diff = (x - y).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{name} differs by {diff} after the resumed step");
    }
    // The reference of the resumed run is still the base model.
    assert_eq!(
        resumed.logprobs(Scorer::Reference, &held_out.input_ids, 1.0).ok(),
        None,
        "nll needs no reference, so none is loaded"
    );

    // Other settings than the checkpoint's adapters are refused by name.
    let mut other = training;
    other["lora"]["rank"] = json!(8);
    let request = load_request(&saved, other);
    let err = Engine::load(&request, "cpu").unwrap_err().to_string();
    assert!(err.contains("training.lora"), "{err}");
}
