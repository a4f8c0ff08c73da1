//! LoRA adapters: they start as the base model, switch off to give the base back, merge to
//! the same logprobs, refit a serving model in place (whole and tensor-parallel), and save in
//! PEFT's layout, which `peft` loads on top of the base with the same logprobs.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;

use common::{keel_logprobs, load_f32};
use keel_model::lora::{ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, AdapterDir, is_adapter_dir, targeted_weights};
use keel_model::{CausalLm, SaveOptions};
use keel_protocol::training::LoraConfig;
use keel_testkit::{max_abs_diff, peft_logprobs, reference, sequences};
use tch::{Device, Kind, Tensor};

const LENGTHS: [usize; 3] = [19, 7, 1];

fn lora(targets: &[&str]) -> LoraConfig {
    LoraConfig {
        enabled: true,
        rank: 4,
        alpha: 8.0,
        target_modules: targets.iter().map(|t| t.to_string()).collect(),
        ..LoraConfig::default()
    }
}

/// Gives every B of `model`'s adapters random values (they start at zero), so the adapters
/// change what the model computes.
fn perturb(model: &CausalLm) -> HashMap<String, Tensor> {
    tch::manual_seed(11);
    let tensors: HashMap<String, Tensor> = model
        .adapter_tensors()
        .into_iter()
        .map(|(name, t)| {
            let value = if name.ends_with("lora_B.weight") { t.randn_like() * 0.3 } else { t.copy() };
            (name, value)
        })
        .collect();
    model.load_adapter_tensors(&tensors).unwrap();
    tensors
}

fn make_base(dir: &std::path::Path) -> std::path::PathBuf {
    let base = dir.join("base");
    reference(&["make-model", "qwen3-qk-norm", base.to_str().unwrap()]);
    base
}

/// A new base model in `dir` and that model loaded with adapters of `config` added.
fn adapted(dir: &std::path::Path, config: &LoraConfig) -> (std::path::PathBuf, CausalLm) {
    let base = make_base(dir);
    let mut model = load_f32(&base);
    model.add_adapters(config).unwrap();
    (base, model)
}

#[test]
fn adapters_start_as_the_base_switch_off_and_merge_to_the_same_logprobs() {
    let dir = tempfile::tempdir().unwrap();
    let base_dir = make_base(dir.path());
    let mut model = load_f32(&base_dir);
    let seqs = sequences(&LENGTHS, model.config().vocab_size, 3);
    let base = keel_logprobs(&model, &seqs, 1.0);

    model.add_adapters(&LoraConfig { enabled: true, ..LoraConfig::default() }).unwrap();
    assert_eq!(model.adapter_tensors().len(), 2 * 7 * model.config().num_hidden_layers as usize);
    assert_eq!(max_abs_diff(&keel_logprobs(&model, &seqs, 1.0), &base), 0.0, "B starts at zero");
    perturb(&model);
    let adapted = keel_logprobs(&model, &seqs, 1.0);
    assert!(max_abs_diff(&adapted, &base) > 1e-3, "the adapters change the model");
    assert_eq!(max_abs_diff(&model.with_base(|m| keel_logprobs(m, &seqs, 1.0)), &base), 0.0);
    assert_eq!(max_abs_diff(&keel_logprobs(&model, &seqs, 1.0), &adapted), 0.0, "back on after with_base");

    // Only the adapters train: the base is frozen, the adapters are not.
    model.freeze().expect("frozen");
    assert!(model.var_store().variables().values().all(|t| !t.requires_grad()));
    assert!(model.adapter_tensors().iter().all(|(_, t)| t.requires_grad()));

    // Saved in PEFT's layout, loaded back as a model: the base with the adapters merged.
    let adapter_dir = dir.path().join("adapter");
    model.save_adapters(&adapter_dir, &base_dir).unwrap();
    assert!(is_adapter_dir(&adapter_dir) && !is_adapter_dir(&base_dir));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(adapter_dir.join(ADAPTER_CONFIG_FILE)).unwrap()).unwrap();
    assert_eq!((config["peft_type"].as_str(), config["r"].as_i64()), (Some("LORA"), Some(8)));
    let names: Vec<String> =
        Tensor::read_safetensors(adapter_dir.join(ADAPTER_WEIGHTS_FILE)).unwrap().into_iter().map(|(n, _)| n).collect();
    assert!(names.contains(&"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight".to_string()), "{names:?}");
    let merged = load_f32(&adapter_dir);
    assert!(merged.lora().is_none(), "loading an adapter directory merges the adapters");
    let diff = max_abs_diff(&keel_logprobs(&merged, &seqs, 1.0), &adapted);
    eprintln!("merged vs unmerged adapters: max logprob difference {diff:e}");
    assert!(diff <= 1e-5, "merged vs adapters: {diff:e}");
    let read = AdapterDir::read(&adapter_dir).unwrap();
    assert_eq!(read.base, base_dir);
    let unmerged = read.load(Device::Cpu, Kind::Float).unwrap();
    assert_eq!(max_abs_diff(&keel_logprobs(&unmerged, &seqs, 1.0), &adapted), 0.0);

    // A merged save is a plain model directory.
    let mut to_merge = read.load(Device::Cpu, Kind::Float).unwrap();
    to_merge.merge_adapters().unwrap();
    to_merge.save(&dir.path().join("merged"), SaveOptions::default()).unwrap();
    let diff = max_abs_diff(&keel_logprobs(&load_f32(&dir.path().join("merged")), &seqs, 1.0), &adapted);
    assert!(diff <= 1e-5, "saved merged model: {diff:e}");
}

#[test]
fn a_serving_model_refits_from_adapters_in_place_and_refuses_bad_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (base_dir, trained) = adapted(dir.path(), &lora(&["q_proj", "down_proj"]));
    let adapters = perturb(&trained);
    let seqs = sequences(&LENGTHS, trained.config().vocab_size, 5);
    let expected = keel_logprobs(&trained, &seqs, 1.0);

    let serving = load_f32(&base_dir);
    let base = targeted_weights(&serving.var_store().variables(), &adapters, Device::Cpu).unwrap();
    assert_eq!(base.len(), 2 * serving.config().num_hidden_layers as usize);
    serving.commit_weights(serving.stage_adapters(&base, &adapters, 2.0).unwrap()).unwrap();
    let diff = max_abs_diff(&keel_logprobs(&serving, &seqs, 1.0), &expected);
    assert!(diff <= 1e-5, "refit vs trained: {diff:e}");
    // Again with the same adapters: merged into the kept base, not on top of the last merge.
    serving.commit_weights(serving.stage_adapters(&base, &adapters, 2.0).unwrap()).unwrap();
    assert!(max_abs_diff(&keel_logprobs(&serving, &seqs, 1.0), &expected) <= 1e-5);

    let before = keel_logprobs(&serving, &seqs, 1.0);
    let copy = || -> HashMap<String, Tensor> { adapters.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect() };
    let mut missing = copy();
    missing.remove("model.layers.1.mlp.down_proj.lora_B.weight");
    let mut stray = copy();
    stray.insert(
        "model.layers.0.self_attn.k_proj.lora_A.weight".into(),
        Tensor::zeros([4, 64], (Kind::Float, Device::Cpu)),
    );
    for (bad, expected) in
        [(missing, "missing tensor `model.layers.1.mlp.down_proj.lora_B.weight`"), (stray, "k_proj.lora_A.weight")]
    {
        let err = serving.stage_adapters(&base, &bad, 2.0).unwrap_err().to_string();
        assert!(err.contains(expected), "{err}");
    }
    assert_eq!(max_abs_diff(&keel_logprobs(&serving, &seqs, 1.0), &before), 0.0, "a refused refit changes nothing");
}

#[test]
fn peft_loads_keel_adapters_with_the_same_logprobs() {
    let dir = tempfile::tempdir().unwrap();
    let (base_dir, model) = adapted(dir.path(), &LoraConfig { use_rslora: true, ..lora(&[]) });
    perturb(&model);
    let adapter_dir = dir.path().join("adapter");
    model.save_adapters(&adapter_dir, &base_dir).unwrap();
    let seqs = sequences(&LENGTHS, model.config().vocab_size, 7);
    let expected = peft_logprobs(&base_dir, &adapter_dir, &seqs, dir.path());
    let diff = max_abs_diff(&keel_logprobs(&model, &seqs, 1.0), &expected);
    eprintln!("rsLoRA adapters on all seven linears: max |keel - peft| = {diff:e}");
    assert!(diff <= 1e-5, "max |keel - peft| = {diff:e}");
}

#[test]
fn adapter_configs_keel_cannot_apply_are_refused_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let (base_dir, model) = adapted(dir.path(), &lora(&["v_proj"]));
    let adapter_dir = dir.path().join("adapter");
    model.save_adapters(&adapter_dir, &base_dir).unwrap();
    let path = adapter_dir.join(ADAPTER_CONFIG_FILE);
    let original: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for (key, value, expected) in [
        ("use_dora", serde_json::json!(true), "use_dora"),
        ("rank_pattern", serde_json::json!({"q_proj": 2}), "rank_pattern"),
        ("target_modules", serde_json::json!(".*proj"), "target_modules"),
        ("target_modules", serde_json::json!(["lm_head"]), "lm_head"),
        ("base_model_name_or_path", serde_json::Value::Null, "base_model_name_or_path"),
    ] {
        let mut edited = original.clone();
        edited[key] = value;
        std::fs::write(&path, edited.to_string()).unwrap();
        let err = CausalLm::load(&adapter_dir, Device::Cpu, Kind::Float).unwrap_err().to_string();
        assert!(err.contains(expected), "{key}: {err}");
    }
}

/// On a mixture of experts the MLP targets adapt every expert's linears (under the
/// checkpoint's names: Qwen3-MoE's `gate_proj`, Mixtral's `w1`), the dense layers' MLP as
/// usual; saved and loaded back merged, they score what the adapted model scores.
#[test]
fn adapters_on_every_expert_merge_to_the_same_logprobs() {
    for (variant, expert_linear) in [
        ("qwen3-moe", "model.layers.0.mlp.experts.5.up_proj"),
        ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w1"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let base_dir = dir.path().join("base");
        reference(&["make-model", variant, base_dir.to_str().unwrap()]);
        let mut model = load_f32(&base_dir);
        let seqs = sequences(&LENGTHS, model.config().vocab_size, 4);
        let base = keel_logprobs(&model, &seqs, 1.0);
        model.add_adapters(&lora(&["q_proj", "gate_proj", "up_proj", "down_proj"])).unwrap();
        let cfg = model.config();
        let moe = cfg.moe.clone().unwrap();
        let sparse = moe.sparse_layers.iter().filter(|s| **s).count() as i64;
        let linears = cfg.num_hidden_layers + 3 * (sparse * moe.experts + cfg.num_hidden_layers - sparse);
        assert_eq!(model.adapter_tensors().len() as i64, 2 * linears, "{variant}");
        let names: Vec<String> = model.adapter_tensors().into_iter().map(|(n, _)| n).collect();
        assert!(names.contains(&format!("{expert_linear}.lora_A.weight")), "{variant}: {names:?}");
        perturb(&model);
        let adapted = keel_logprobs(&model, &seqs, 1.0);
        assert!(max_abs_diff(&adapted, &base) > 1e-3, "{variant}: the adapters change the model");
        let adapter_dir = dir.path().join("adapter");
        model.save_adapters(&adapter_dir, &base_dir).unwrap();
        let diff = max_abs_diff(&keel_logprobs(&load_f32(&adapter_dir), &seqs, 1.0), &adapted);
        assert!(diff <= 1e-5, "{variant}: merged vs adapters: {diff:e}");
    }
}

/// Phi-3's fused `qkv_proj` and `gate_up_proj` and GLM-4's `gate_up_proj`: Keel's adapters of
/// their parts save as PEFT's adapter of the fused module (rank and alpha per part count in
/// `rank_pattern`/`alpha_pattern`), which PEFT loads on the transformers model with Keel's
/// logprobs, and which Keel reads back exactly (Granite's and Gemma 2's plain adapters too);
/// adapting some parts of a fused projection but not all is refused, and so is a fused adapter
/// whose parts mix.
#[test]
fn fused_projections_save_as_peft_adapters_of_the_fused_module() {
    let dir = tempfile::tempdir().unwrap();
    let made = dir.path().join("made");
    reference(&["make-models", made.to_str().unwrap(), "phi3-longrope-short", "glm4", "granite", "gemma2"]);
    let cases = [
        ("phi3-longrope-short", lora(&[]), vec!["qkv_proj", "gate_up_proj"]),
        (
            "glm4",
            LoraConfig { use_rslora: true, ..lora(&["qkv_proj", "o_proj", "gate_up_proj"]) },
            vec!["gate_up_proj"],
        ),
        // Families without fused tensors, whose multipliers and soft-caps the adapters pass through.
        ("granite", lora(&[]), vec![]),
        ("gemma2", lora(&[]), vec![]),
    ];
    let seqs = sequences(&LENGTHS, 211, 3);
    let mut ours = Vec::new();
    for (variant, config, fused) in cases {
        let base = made.join(variant);
        let mut model = load_f32(&base);
        model.add_adapters(&config).unwrap();
        perturb(&model);
        let adapted = keel_logprobs(&model, &seqs, 1.0);
        let adapter_dir = dir.path().join(format!("{variant}-adapter"));
        model.save_adapters(&adapter_dir, &base).unwrap();
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(adapter_dir.join(ADAPTER_CONFIG_FILE)).unwrap()).unwrap();
        for name in &fused {
            assert!(written["target_modules"].as_array().unwrap().iter().any(|t| t == name), "{variant}: {written}");
            assert!(written["rank_pattern"][name].as_i64().unwrap() > 4, "{variant}: {written}");
        }
        let read = AdapterDir::read(&adapter_dir).unwrap().load(Device::Cpu, Kind::Float).unwrap();
        assert_eq!(max_abs_diff(&keel_logprobs(&read, &seqs, 1.0), &adapted), 0.0, "{variant}: read back");
        ours.push((variant, base, adapter_dir, adapted));
    }
    // PEFT scores every adapter in one Python process.
    let jobs: Vec<_> = ours.iter().map(|(_, base, adapters, _)| (base.as_path(), Some(adapters.as_path()))).collect();
    let peft = keel_testkit::reference_logprobs_many(&jobs, &seqs, dir.path());
    for ((variant, _, _, adapted), theirs) in ours.iter().zip(&peft) {
        let diff = max_abs_diff(theirs, adapted);
        eprintln!("{variant}: PEFT on transformers vs Keel's adapters: max logprob difference {diff:e}");
        assert!(diff <= 1e-4, "{variant}: PEFT vs Keel: {diff:e}");
    }

    let mut phi = load_f32(&made.join("phi3-longrope-short"));
    let err = phi.add_adapters(&lora(&["q_proj", "v_proj"])).unwrap_err().to_string();
    assert!(err.contains("target_modules") && err.contains("qkv_proj"), "{err}");

    // A fused adapter whose B mixes the parts (not one block per part) is refused by name.
    let adapter_dir = dir.path().join("phi3-longrope-short-adapter");
    let weights = adapter_dir.join(ADAPTER_WEIGHTS_FILE);
    let mixed: Vec<(String, Tensor)> = Tensor::read_safetensors(&weights)
        .unwrap()
        .into_iter()
        .map(|(n, t)| if n.ends_with("qkv_proj.lora_B.weight") { (n, t.ones_like()) } else { (n, t) })
        .collect();
    Tensor::write_safetensors(&mixed, &weights).unwrap();
    let err = AdapterDir::read(&adapter_dir).unwrap().load(Device::Cpu, Kind::Float).unwrap_err().to_string();
    assert!(err.contains("qkv_proj.lora_B.weight") && err.contains("mixes the parts"), "{err}");
}
