//! Runs end to end: the five services as processes on the real NATS and Postgres, runs
//! submitted through the REST API. SFT then GRPO from the SFT checkpoint (metrics, samples,
//! checkpoints; the generator and trainer agree on logprobs); DPO's first loss is ln 2 and
//! falls, on held-out pairs too; a reward model's accuracy rises; an orchestrator killed mid-run is replaced and
//! the run finishes with every step recorded once; weights refitted in memory or through a
//! directory, and training and generation colocated or not, give the same run; LoRA SFT saves
//! PEFT adapters that GRPO continues from (refitting adapters only) and that export as a
//! merged model transformers scores as PEFT does. On-policy distillation of a `small`
//! student from a `medium` teacher brings the student's KL to the teacher down, resumes after
//! its orchestrator is killed, and refuses a teacher with another tokenizer. A mixture of
//! experts (Qwen3-MoE) trains with GRPO, at TP 1 and 2. Tiny Gemma 3, OLMo 2 and Phi-3 models
//! train with LoRA GRPO, the generator agreeing with the trainer, and their adapters load in PEFT.

#![allow(clippy::unwrap_used)]

mod stack;

use std::time::Duration;

use serde_json::json;
use stack::{Stack, grpo_spec, sft_spec};

const LIMIT: Duration = Duration::from_secs(600);

#[tokio::test(flavor = "multi_thread")]
async fn sft_then_grpo_records_metrics_samples_and_checkpoints() {
    let stack = Stack::start();
    let sft = stack.submit(&sft_spec(&json!({"path": stack.model}), 6, 3)).await;
    let run = stack.wait_succeeded(&sft, LIMIT).await;
    assert_eq!(run["step"], 6, "{run}");
    let loss = stack.series(&sft, "train/loss").await;
    assert_eq!(loss.iter().map(|p| p.0).collect::<Vec<_>>(), (1..=6).collect::<Vec<_>>());
    assert!(loss[5].1 < loss[0].1, "SFT loss fell: {loss:?}");
    let checkpoints = stack.get(&format!("/v1/runs/{sft}/checkpoints")).await;
    let steps: Vec<u64> = checkpoints.as_array().unwrap().iter().map(|c| c["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [3, 6], "{checkpoints}");
    let last = checkpoints[1]["id"].as_str().unwrap();

    let mut grpo_spec = grpo_spec(&json!({"checkpoint": last}));
    let grpo = stack.submit(&grpo_spec).await;
    let run = stack.wait_succeeded(&grpo, LIMIT).await;
    assert_eq!(run["step"], 3, "{run}");
    for name in [
        "timing/train/generation",
        "timing/train/reward_calculation",
        "timing/train/policy_and_reference_logprobs",
        "timing/train/policy_training",
        "timing/train/weight_sync",
        "timing/train/total_step_time",
        "train/reward",
        "train/loss",
        "train/kl_penalty",
    ] {
        let points = stack.series(&grpo, name).await;
        assert_eq!(points.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2, 3], "{name}: {points:?}");
    }
    for (step, error) in stack.series(&grpo, "train/token_mult_prob_error").await {
        assert!((0.99..1.05).contains(&error), "step {step}: token_mult_prob_error {error}");
    }
    for (step, ratio) in stack.series(&grpo, "train/probs_ratio_clamped").await {
        assert!((0.8..=1.2).contains(&ratio), "step {step}: probs_ratio_clamped {ratio}");
    }
    let accuracy = stack.series(&grpo, "validation/accuracy").await;
    assert_eq!(accuracy.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 2, 3], "validation at start, period and end");
    let samples = stack.get(&format!("/v1/runs/{grpo}/samples?split=train&limit=100")).await;
    let samples = samples["samples"].as_array().unwrap();
    assert!(samples.len() >= 3, "{samples:?}");
    assert!(samples.iter().all(|s| s["prompt"].as_str().unwrap().contains("What is")), "{samples:?}");
    assert!(samples.iter().all(|s| s["ground_truth"].is_string()));
    // Retention keeps the best by validation accuracy and the latest.
    let checkpoints = stack.get(&format!("/v1/runs/{grpo}/checkpoints")).await;
    let steps: Vec<u64> = checkpoints.as_array().unwrap().iter().map(|c| c["step"].as_u64().unwrap()).collect();
    assert!(steps.contains(&3) && !steps.is_empty() && steps.len() <= 2, "{checkpoints}");
    let events = stack.http.get(format!("{}/v1/runs/{grpo}/events", stack.api())).send().await.unwrap();
    let text = events.text().await.unwrap();
    assert!(text.contains("event: step") && text.contains("\"succeeded\""), "{text}");
    cli_reads_the_run(&stack, &grpo, &steps);

    // The REINFORCE++ estimator, from the base model, without validation, with the trainer
    // splitting the policy and reference over two tensor-parallel ranks in each of two
    // data-parallel replicas.
    grpo_spec["grpo"]["advantage_estimator"] = json!("reinforce_plus_plus");
    grpo_spec["tensor_parallel_size"] = json!(2);
    grpo_spec["data_parallel_size"] = json!(2);
    grpo_spec["model"] = json!({"path": stack.model});
    grpo_spec["max_num_steps"] = json!(1);
    grpo_spec["data"]["validation"] = serde_json::Value::Null;
    let reinforce = stack.submit(&grpo_spec).await;
    stack.wait_succeeded(&reinforce, LIMIT).await;
    assert_eq!(stack.series(&reinforce, "train/loss").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn dpo_starts_at_ln2_and_falls_and_reward_model_accuracy_rises() {
    let stack = Stack::start();
    let pairs = |algorithm: &str, loss: serde_json::Value, lr: f64, steps: u64| {
        json!({
            "algorithm": algorithm,
            "model": {"path": stack.model},
            "data": {
                "train": {"kind": "arithmetic", "size": 32, "max_operand": 9, "seed": 4},
                "validation": {"kind": "arithmetic", "size": 8, "max_operand": 9, "seed": 9, "split": "held_out"},
            },
            "training": {
                "loss": loss,
                "optimizer": {"lr": lr, "weight_decay": 0.0},
                "global_batch_size": 16,
                "micro_batch_size": 8,
            },
            "max_total_sequence_length": 64,
            "max_num_steps": steps,
            "max_num_epochs": 20,
            "validation": {"period": 2},
            "checkpointing": {"enabled": false},
        })
    };
    let dpo = stack.submit(&pairs("dpo", json!({"type": "dpo", "reference_policy_kl_penalty": 0.5}), 0.002, 6)).await;
    let rm = stack.submit(&pairs("rm", json!({"type": "bradley_terry"}), 0.003, 16)).await;
    stack.wait_succeeded(&dpo, LIMIT).await;
    let loss = stack.series(&dpo, "train/loss").await;
    assert!((loss[0].1 - std::f64::consts::LN_2).abs() < 1e-3, "first DPO loss {} is not ln 2", loss[0].1);
    assert!(loss.last().unwrap().1 < loss[0].1 - 0.01, "DPO loss did not fall: {loss:?}");
    // Validation on held-out pairs without an update: at the start (the policy is the
    // reference: ln 2, margins 0) and every second step, after which the policy has moved.
    let validation = stack.series(&dpo, "validation/loss").await;
    assert_eq!(validation.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 2, 4, 6], "{validation:?}");
    assert!((validation[0].1 - std::f64::consts::LN_2).abs() < 1e-3, "{validation:?}");
    assert!((validation[3].1 - validation[0].1).abs() > 1e-4, "held-out loss never moved: {validation:?}");
    assert_eq!(stack.series(&dpo, "validation/accuracy").await.len(), 4);
    let margins = stack.series(&dpo, "validation/rewards_margin_mean").await;
    assert!(margins[0].1.abs() < 1e-3 && margins[3].1 != margins[0].1, "{margins:?}");
    stack.wait_succeeded(&rm, LIMIT).await;
    let accuracy: Vec<f64> = stack.series(&rm, "train/accuracy").await.into_iter().map(|p| p.1).collect();
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let (first, last) = (mean(&accuracy[..4]), mean(&accuracy[accuracy.len() - 4..]));
    assert!(last > first, "reward-model accuracy did not rise: {accuracy:?}");
    let held_out = stack.series(&rm, "validation/accuracy").await;
    assert_eq!(held_out.len(), 9, "steps 0, 2, ..., 16: {held_out:?}");
    assert_eq!(stack.series(&rm, "validation/loss").await.len(), 9);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_orchestrator_is_replaced_and_no_step_is_repeated_or_skipped() {
    let mut stack = Stack::start();
    let mut spec = sft_spec(&json!({"path": stack.model}), 60, 7);
    spec["max_num_epochs"] = json!(10);
    let id = stack.submit(&spec).await;
    stack.wait_for(&id, LIMIT, |run| run["step"].as_u64().unwrap_or(0) >= 4).await;
    drop(stack.orchestrator.take());
    stack.start_orchestrator();
    let run = stack.wait_succeeded(&id, LIMIT).await;
    assert_eq!(run["step"], 60, "{run}");
    let steps: Vec<u64> = stack.series(&id, "train/loss").await.into_iter().map(|p| p.0).collect();
    assert_eq!(steps, (1..=60).collect::<Vec<_>>(), "every step recorded once");
    let events = stack.http.get(format!("{}/v1/runs/{id}/events", stack.api())).send().await.unwrap();
    let text = events.text().await.unwrap();
    assert!(text.contains("resumed after its orchestrator stopped"), "{text}");
}

/// A mixture of experts through the services: GRPO on a `tiny` Qwen3-MoE (8 experts, 2 per
/// token) whose generator computes the trainer's logprobs, with the router's load-balancing
/// loss trained and recorded; then a step with the trainer's policy and reference split over
/// two tensor-parallel ranks (every expert split between them), and a step colocated.
#[tokio::test(flavor = "multi_thread")]
async fn grpo_trains_a_mixture_of_experts_model() {
    let stack = Stack::start();
    let model = stack.dir.path().join("moe");
    keel_testkit::keel_model_init_arch(&model, "qwen3_moe", "tiny", 3);
    let mut spec = grpo_spec(&json!({"path": model}));
    let run = stack.submit(&spec).await;
    stack.wait_succeeded(&run, LIMIT).await;
    let errors = stack.series(&run, "train/token_mult_prob_error").await;
    assert_eq!(errors.len(), 3, "{errors:?}");
    for (step, error) in errors {
        assert!((0.99..1.05).contains(&error), "step {step}: token_mult_prob_error {error}");
    }
    // k = 2 when the routing is balanced; more when it is not.
    let aux = stack.series(&run, "train/router_aux_loss").await;
    assert_eq!(aux.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2, 3], "{aux:?}");
    assert!(aux.iter().all(|p| (1.9..8.0).contains(&p.1)), "{aux:?}");

    spec["tensor_parallel_size"] = json!(2);
    spec["max_num_steps"] = json!(1);
    spec["data"]["validation"] = serde_json::Value::Null;
    let split = stack.submit(&spec).await;
    stack.wait_succeeded(&split, LIMIT).await;
    let (error, aux_split) = (
        stack.series(&split, "train/token_mult_prob_error").await,
        stack.series(&split, "train/router_aux_loss").await,
    );
    assert!((0.99..1.05).contains(&error[0].1), "TP 2: token_mult_prob_error {error:?}");
    assert!((aux_split[0].1 - aux[0].1).abs() < 1e-4, "TP 2's first step routes as TP 1's: {aux_split:?} vs {aux:?}");

    // Colocated: the generator sleeps (its weights offloaded) while the trainer trains, then
    // wakes to the refitted experts.
    spec["tensor_parallel_size"] = json!(1);
    spec["generation"]["colocated"] = json!({"enabled": true, "generator_offload_weights": true});
    let colocated = stack.submit(&spec).await;
    stack.wait_succeeded(&colocated, LIMIT).await;
    let error = stack.series(&colocated, "train/token_mult_prob_error").await;
    assert!((0.99..1.05).contains(&error[0].1), "colocated: token_mult_prob_error {error:?}");
}

/// Tiny Gemma 3, OLMo 2 and Phi-3 models (`keel model init`, each in its family's chat format)
/// train with LoRA GRPO through the five services: at every step the generator's logprobs are
/// the trainer's, and the adapters the run saves (Phi-3's as PEFT's adapters of its fused
/// `qkv_proj` and `gate_up_proj`) load in PEFT on the transformers model and score as the
/// merged model Keel exports does.
#[tokio::test(flavor = "multi_thread")]
async fn gemma3_olmo2_and_phi3_train_with_lora_grpo_and_their_adapters_load_in_peft() {
    let stack = Stack::start();
    let scratch = tempfile::tempdir().unwrap();
    for arch in ["gemma3", "olmo2", "phi3"] {
        let model = stack.dir.path().join(arch);
        keel_testkit::keel_model_init_arch(&model, arch, "tiny", 3);
        let mut spec = grpo_spec(&json!({"path": model}));
        spec["training"]["lora"] = json!({"enabled": true, "rank": 4, "alpha": 8});
        spec["training"]["optimizer"]["lr"] = json!(0.005);
        spec["max_num_steps"] = json!(2);
        // A reward a random model's samples differ in (some hold a digit), so the groups'
        // advantages, and the adapters' updates, are not zero.
        spec["environments"] = json!({"default": {"name": "regex", "pattern": "[0-9]"}});
        let run = stack.submit(&spec).await;
        stack.wait_succeeded(&run, LIMIT).await;
        let errors = stack.series(&run, "train/token_mult_prob_error").await;
        assert_eq!(errors.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2], "{arch}: {errors:?}");
        eprintln!("{arch}: train/token_mult_prob_error {errors:?}");
        for (step, error) in errors {
            assert!((0.99..1.05).contains(&error), "{arch}, step {step}: token_mult_prob_error {error}");
        }
        let checkpoints = stack.get(&format!("/v1/runs/{run}/checkpoints")).await;
        let adapters = checkpoints[0]["id"].as_str().unwrap().to_string();
        let (merged, downloaded) = (scratch.path().join(format!("{arch}-merged")), scratch.path().join(arch));
        for args in [
            vec!["checkpoint", "export", &adapters, "--merged", "--out", merged.to_str().unwrap()],
            vec!["checkpoint", "download", &adapters, "--out", downloaded.to_str().unwrap()],
        ] {
            let output = std::process::Command::new(keel_testkit::binary("keel"))
                .args(&args)
                .env("KEEL_CHECKPOINT_URL", &stack.checkpoint.url)
                .output()
                .unwrap();
            assert!(output.status.success(), "keel {args:?}: {}", String::from_utf8_lossy(&output.stderr));
        }
        let seqs = keel_testkit::sequences(&[17, 9], 200, 4);
        let merged_logprobs = keel_testkit::reference_logprobs(&merged, &seqs, 1.0, scratch.path());
        let base = keel_testkit::reference_logprobs(&model, &seqs, 1.0, scratch.path());
        let trained = keel_testkit::max_abs_diff(&merged_logprobs, &base);
        assert!(trained > 1e-5, "{arch}: the adapters changed nothing ({trained:e} from the base)");
        let peft = keel_testkit::peft_logprobs(&model, &downloaded, &seqs, scratch.path());
        let diff = keel_testkit::max_abs_diff(&merged_logprobs, &peft);
        eprintln!("{arch}: merged export vs adapters in PEFT: {diff:e}; merged vs base: {trained:e}");
        assert!(diff <= 1e-4, "{arch}: merged model vs PEFT adapters: {diff:e}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_run_stops_and_frees_its_trainer() {
    let stack = Stack::start();
    let mut long = sft_spec(&json!({"path": stack.model}), 10_000, 1000);
    long["max_num_epochs"] = json!(1000);
    let long = stack.submit(&long).await;
    stack.wait_for(&long, LIMIT, |run| run["step"].as_u64().unwrap_or(0) >= 1).await;
    // The only trainer is taken: a second run waits in the queue.
    let next = stack.submit(&sft_spec(&json!({"path": stack.model}), 2, 2)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(stack.get(&format!("/v1/runs/{next}")).await["status"], "queued");
    let response = stack.http.post(format!("{}/v1/runs/{long}/cancel", stack.api())).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let run = stack.wait_for(&long, Duration::from_secs(30), |run| run["status"] == "cancelled").await;
    assert_eq!(run["reason"], "cancelled by request");
    stack.wait_succeeded(&next, LIMIT).await;
}

/// Colocated mode on the CPU: each step the generator sleeps (its KV pool freed) while the
/// trainer trains, the trainer moves its optimiser state out and back, and the generator
/// wakes after the refit; the run's numbers are those of a run without it.
#[tokio::test(flavor = "multi_thread")]
async fn a_colocated_grpo_run_records_the_same_metrics_as_a_separate_one() {
    let stack = Stack::start();
    let mut series = Vec::new();
    for colocated in [false, true] {
        let mut spec = grpo_spec(&json!({"path": stack.model}));
        spec["generation"]["colocated"] = json!({"enabled": colocated, "generator_offload_weights": colocated});
        spec["max_num_steps"] = json!(3);
        spec["checkpointing"] = json!({"enabled": false});
        let id = stack.submit(&spec).await;
        stack.wait_succeeded(&id, LIMIT).await;
        series.push((stack.series(&id, "train/loss").await, stack.series(&id, "train/reward").await));
        for phase in ["generator_sleep", "trainer_onload", "trainer_offload", "generator_wake"] {
            let recorded = stack.series(&id, &format!("timing/train/{phase}")).await;
            let expected = if colocated { 3 } else { 0 };
            assert_eq!(recorded.len(), expected, "timing/train/{phase} with colocated {colocated}: {recorded:?}");
        }
    }
    let (separate, colocated) = (&series[0], &series[1]);
    assert_eq!(separate.0.len(), 3);
    for ((a, b), name) in [(&separate.0, &colocated.0), (&separate.1, &colocated.1)].into_iter().zip(["loss", "reward"])
    {
        for ((step, x), (_, y)) in a.iter().zip(b.iter()) {
            assert!((x - y).abs() <= 1e-6, "train/{name} at step {step}: {x} separate, {y} colocated");
        }
    }
    // The generator slept once a step and is awake again.
    let text = stack.http.get(format!("{}/metrics", stack.generator.url)).send().await.unwrap().text().await.unwrap();
    // (Labelled with the served model's name: the run's model slept.)
    let series = |name: &str| -> Vec<&str> {
        text.lines().filter(|l| l.starts_with(&format!("{name}{{"))).filter_map(|l| l.rsplit(' ').next()).collect()
    };
    assert!(series("keel_generator_sleeps_total").contains(&"3"), "{text}");
    let asleep = series("keel_generator_asleep");
    assert!(!asleep.is_empty() && asleep.iter().all(|v| *v == "0"), "{text}");
}

/// Weights reach the generators in memory (the default) or through the run's directory (the
/// fallback): the same seeded GRPO run records the same losses and rewards either way, step
/// after step — the generators served the same weights.
#[tokio::test(flavor = "multi_thread")]
async fn grpo_records_the_same_metrics_with_weights_in_memory_or_through_a_directory() {
    let stack = Stack::start();
    let mut series = Vec::new();
    for transfer in ["memory", "directory"] {
        let mut spec = grpo_spec(&json!({"path": stack.model}));
        spec["generation"]["weight_transfer"] = json!(transfer);
        spec["max_num_steps"] = json!(4);
        spec["checkpointing"] = json!({"enabled": false});
        let id = stack.submit(&spec).await;
        stack.wait_succeeded(&id, LIMIT).await;
        series.push((stack.series(&id, "train/loss").await, stack.series(&id, "train/reward").await));
        // Each step's weight sync waited for the generator to report the version loaded.
        let refits = stack.series(&id, "timing/train/generator_refit").await;
        assert_eq!(refits.len(), 4, "a generator refit time per step with {transfer}: {refits:?}");
        let syncs = stack.series(&id, "timing/train/weight_sync").await;
        for ((step, refit), (_, sync)) in refits.iter().zip(&syncs) {
            assert!(*refit > 0.0 && refit <= sync, "step {step}: refit {refit} s within weight sync {sync} s");
        }
    }
    let (memory, directory) = (&series[0], &series[1]);
    assert_eq!(memory.0.len(), 4);
    for ((a, b), name) in [(&memory.0, &directory.0), (&memory.1, &directory.1)].into_iter().zip(["loss", "reward"]) {
        for ((step, x), (_, y)) in a.iter().zip(b.iter()) {
            assert!((x - y).abs() <= 1e-6, "train/{name} at step {step}: {x} in memory, {y} through a directory");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn lora_sft_then_lora_grpo_refits_adapters_and_exports_a_merged_model() {
    let stack = Stack::start();
    let lora = json!({"enabled": true, "rank": 8, "alpha": 16});
    let mut sft = sft_spec(&json!({"path": stack.model}), 4, 4);
    sft["training"]["lora"] = lora.clone();
    sft["training"]["optimizer"]["lr"] = json!(0.01);
    let sft = stack.submit(&sft).await;
    stack.wait_succeeded(&sft, LIMIT).await;
    let loss = stack.series(&sft, "train/loss").await;
    assert!(loss[3].1 < loss[0].1, "LoRA SFT loss fell: {loss:?}");
    let checkpoints = stack.get(&format!("/v1/runs/{sft}/checkpoints")).await;
    let checkpoint = &checkpoints[0];
    let files: Vec<&str> =
        checkpoint["files"].as_array().unwrap().iter().map(|f| f["path"].as_str().unwrap()).collect();
    assert!(files.contains(&"adapter_model.safetensors") && files.contains(&"adapter_config.json"), "{files:?}");
    assert!(!files.iter().any(|f| f.starts_with("model")), "adapters only: {files:?}");
    let adapters = checkpoint["id"].as_str().unwrap().to_string();

    // GRPO puts new adapters on the SFT model (base with the SFT adapters merged), which is also
    // its reference; each step refits the adapters only. In memory and through a directory of
    // adapters, the run is the same, and the generator's logprobs are the trainer's.
    let mut series = Vec::new();
    for transfer in ["memory", "directory"] {
        let mut spec = grpo_spec(&json!({"checkpoint": adapters}));
        spec["training"]["lora"] = lora.clone();
        spec["training"]["optimizer"]["lr"] = json!(0.005);
        spec["generation"]["weight_transfer"] = json!(transfer);
        spec["data"]["validation"] = serde_json::Value::Null;
        spec["checkpointing"] = json!({"enabled": false});
        let id = stack.submit(&spec).await;
        stack.wait_succeeded(&id, LIMIT).await;
        for (step, error) in stack.series(&id, "train/token_mult_prob_error").await {
            assert!((0.999..1.001).contains(&error), "{transfer}, step {step}: token_mult_prob_error {error}");
        }
        let kl = stack.series(&id, "train/kl_penalty").await;
        assert!(kl[0].1.abs() < 1e-6, "{transfer}: the first step's policy is its reference: {kl:?}");
        series.push((stack.series(&id, "train/loss").await, stack.series(&id, "train/reward").await));
    }
    let (memory, directory) = (&series[0], &series[1]);
    assert_eq!(memory.0.len(), 3);
    for ((a, b), name) in [(&memory.0, &directory.0), (&memory.1, &directory.1)].into_iter().zip(["loss", "reward"]) {
        for ((step, x), (_, y)) in a.iter().zip(b.iter()) {
            assert!((x - y).abs() <= 1e-6, "train/{name} at step {step}: {x} in memory, {y} through a directory");
        }
    }

    // The SFT checkpoint as a merged model scores in transformers as the adapters do in PEFT.
    let scratch = tempfile::tempdir().unwrap();
    let (merged, downloaded) = (scratch.path().join("merged"), scratch.path().join("adapters"));
    let keel = |args: &[&str]| {
        let output = std::process::Command::new(keel_testkit::binary("keel"))
            .args(args)
            .env("KEEL_CHECKPOINT_URL", &stack.checkpoint.url)
            .output()
            .unwrap();
        assert!(output.status.success(), "keel {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    };
    keel(&["checkpoint", "export", &adapters, "--merged", "--out", merged.to_str().unwrap()]);
    keel(&["checkpoint", "download", &adapters, "--out", downloaded.to_str().unwrap()]);
    assert!(merged.join("config.json").is_file() && merged.join("tokenizer.json").is_file());
    let seqs = keel_testkit::sequences(&[17, 9], 200, 4);
    let merged_logprobs = keel_testkit::reference_logprobs(&merged, &seqs, 1.0, scratch.path());
    let peft = keel_testkit::peft_logprobs(&stack.model, &downloaded, &seqs, scratch.path());
    let diff = keel_testkit::max_abs_diff(&merged_logprobs, &peft);
    eprintln!("exported merged model (transformers) vs PEFT adapters on the base: max logprob difference {diff:e}");
    assert!(diff <= 1e-5, "merged model vs PEFT adapters: {diff:e}");
}

/// `keel run` and `keel checkpoint` on a finished GRPO run whose checkpoints are at `steps`:
/// a readable summary (and the raw document with `--json`), a list with a header, one short
/// line per checkpoint with the chosen metric, `watch` in plain lines when its output is not a
/// terminal, and a reader that closes the pipe ends the command quietly.
fn cli_reads_the_run(stack: &Stack, run: &str, steps: &[u64]) {
    use std::process::{Command, Stdio};
    let keel = |args: &[&str]| {
        let output = Command::new(keel_testkit::binary("keel"))
            .args(args)
            .env("KEEL_API_URL", stack.api())
            .env("KEEL_CHECKPOINT_URL", &stack.checkpoint.url)
            .output()
            .unwrap();
        let stdout = String::from_utf8(output.stdout).unwrap();
        assert!(output.status.success(), "keel {args:?}: {stdout}{}", String::from_utf8_lossy(&output.stderr));
        stdout
    };
    let summary = keel(&["run", "show", run]);
    assert!(summary.contains("status     succeeded\n"), "{summary}");
    assert!(summary.contains(&format!("checkpoints {}\n", steps.len())), "{summary}");
    assert!(summary.contains("  train/loss  ") && summary.contains("elapsed    "), "{summary}");
    let document: serde_json::Value = serde_json::from_str(&keel(&["run", "show", run, "--json"])).unwrap();
    assert_eq!(document["id"], run);
    let list = keel(&["run", "list"]);
    assert!(list.starts_with("ID ") && list.contains(run), "{list}");
    let checkpoints = keel(&["checkpoint", "list", "--run", run, "--metric", "validation/accuracy"]);
    let lines: Vec<&str> = checkpoints.lines().collect();
    assert_eq!(lines.len(), steps.len(), "{checkpoints}");
    for (line, step) in lines.iter().zip(steps) {
        assert!(line.contains(&format!("step {step:>6}")) && line.ends_with(|c: char| c.is_ascii_digit()), "{line}");
        assert!(line.contains("  validation/accuracy=") && !line.contains("train/"), "{line}");
    }
    let watched = keel(&["run", "watch", run]);
    assert!(!watched.contains('\r') && watched.lines().count() == 1 && watched.contains("succeeded"), "{watched}");
    // The reader goes away before anything is written.
    let mut child = Command::new(keel_testkit::binary("keel"))
        .args(["run", "show", run])
        .env("KEEL_API_URL", stack.api())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success() && output.stderr.is_empty(), "{output:?}");
}

/// 16 samples and one optimiser step per GRPO step, no KL penalty, validation only at the
/// start (what [`resumed_like_uninterrupted`] runs).
fn one_update_per_step(spec: &mut serde_json::Value) {
    spec["training"]["loss"]["reference_policy_kl_penalty"] = json!(0.0);
    spec["training"]["global_batch_size"] = json!(16);
    spec["training"]["micro_batch_size"] = json!(16);
    spec["grpo"]["num_prompts_per_step"] = json!(4);
    spec["validation"]["period"] = json!(100);
}

/// Runs `spec` for ten GRPO steps (16 samples and one optimiser step each, no KL penalty, a
/// checkpoint every 3 steps), killing its orchestrator after step 4 and starting another: the
/// run resumes, records every step once, and its `metric` series equals that of the same spec
/// run again uninterrupted. Returns the resumed run's id and its series.
async fn resumed_like_uninterrupted(
    stack: &mut Stack,
    spec: &serde_json::Value,
    metric: &str,
) -> (String, Vec<(u64, f64)>) {
    let mut spec = spec.clone();
    one_update_per_step(&mut spec);
    spec["max_num_steps"] = json!(10);
    spec["checkpointing"] = json!({"save_period": 3});
    let id = stack.submit(&spec).await;
    stack.wait_for(&id, LIMIT, |run| run["step"].as_u64().unwrap_or(0) >= 4).await;
    drop(stack.orchestrator.take());
    stack.start_orchestrator();
    let run = stack.wait_succeeded(&id, LIMIT).await;
    let events = stack.http.get(format!("{}/v1/runs/{id}/events", stack.api())).send().await.unwrap();
    let text = events.text().await.unwrap();
    assert!(text.contains("resumed after its orchestrator stopped"), "{text}");
    let series = stack.series(&id, metric).await;
    let steps: Vec<u64> = series.iter().map(|p| p.0).collect();
    assert_eq!(steps, (1..=10).collect::<Vec<_>>(), "every step once, across the resume: {run}");
    eprintln!("{metric} by step: {series:?}");
    let again = stack.submit(&spec).await;
    stack.wait_succeeded(&again, LIMIT).await;
    let straight = stack.series(&again, metric).await;
    eprintln!("uninterrupted: {straight:?}");
    for ((step, resumed), (_, uninterrupted)) in series.iter().zip(&straight) {
        assert!((resumed - uninterrupted).abs() < 1e-6, "step {step}: {resumed} resumed, {uninterrupted} straight");
    }
    (id, series)
}

/// PPO through the services: the critic (the policy's model with a value head of zeros)
/// trains alone for two steps, then beside the policy, on a reward whose mean it can learn
/// (the answer holds a digit); its value loss falls against what predicting 0 would cost, and
/// its values follow the reward as the policy improves. Killed after its first checkpoint, the
/// orchestrator's replacement resumes with the critic the checkpoint saved, records every
/// step once, and gives the value-loss series of the same run uninterrupted; split over two
/// tensor-parallel ranks, its first steps are the whole critic's.
#[tokio::test(flavor = "multi_thread")]
async fn ppo_trains_a_critic_that_learns_the_returns_and_resumes_with_it() {
    let mut stack = Stack::start();
    let model = stack.dir.path().join("policy");
    keel_testkit::keel_model_init_preset(&model, "small", 1);
    let mut spec = grpo_spec(&json!({"path": model}));
    spec["ppo"] = json!({"critic_warmup_steps": 2, "optimizer": {"lr": 0.002, "weight_decay": 0.0}, "lambda": 1.0});
    spec["environments"] = json!({"default": {"name": "regex", "pattern": "[0-9]"}});
    spec["training"]["optimizer"]["lr"] = json!(0.001);
    let (id, loss) = resumed_like_uninterrupted(&mut stack, &spec, "train/value_loss").await;
    // The policy waited for the critic's two warm-up steps.
    let policy = stack.series(&id, "train/loss").await;
    assert_eq!(policy.iter().map(|p| p.0).collect::<Vec<_>>(), (3..=10).collect::<Vec<_>>(), "{policy:?}");
    // The policy learns to answer with digits within these ten steps, so the returns the
    // critic chases move: its loss is measured against what predicting 0 would cost on the
    // same batch, ½·E[R²] = ½·(mean reward) for rewards of 0 or 1 (every token's return is its
    // sample's reward at γ = λ = 1). At step 1 the head of zeros predicts exactly 0.
    let (values, reward) = (stack.series(&id, "train/values_mean").await, stack.series(&id, "train/reward").await);
    assert_eq!(values[0].1, 0.0, "the value head starts at zero");
    let ratio = |range: std::ops::Range<usize>| {
        let (lost, zero): (f64, f64) =
            range.map(|i| (loss[i].1, 0.5 * reward[i].1)).fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
        lost / zero
    };
    let (first, last) = (ratio(0..1), ratio(7..10));
    eprintln!("value loss against predicting 0: {first:.3} at step 1, {last:.3} over steps 8 to 10");
    assert!(
        first > 0.7 && last < 0.5 * first,
        "the critic learned the returns: value loss {loss:?}, reward {reward:?}"
    );
    let gap = |range: std::ops::Range<usize>| range.map(|i| (values[i].1 - reward[i].1).abs()).sum::<f64>();
    assert!(gap(7..10) < 0.5 * reward[7..10].iter().map(|p| p.1).sum::<f64>(), "values follow the reward: {values:?}");

    // The policy and the critic split over two tensor-parallel ranks: the critic's first
    // steps give the same value loss as the whole critic's.
    spec["tensor_parallel_size"] = json!(2);
    one_update_per_step(&mut spec);
    spec["max_num_steps"] = json!(3);
    spec["checkpointing"] = json!({"enabled": false});
    let split = stack.submit(&spec).await;
    stack.wait_succeeded(&split, LIMIT).await;
    let split_loss = stack.series(&split, "train/value_loss").await;
    assert_eq!(split_loss.len(), 3, "{split_loss:?}");
    for (whole, split) in loss.iter().zip(&split_loss) {
        assert!((whole.1 - split.1).abs() <= 1e-3 * whole.1.abs().max(1e-3), "TP 2: {split_loss:?} vs {loss:?}");
    }
}

/// GRPO with a `distillation` teacher: a `small` student (random weights) learns a `medium`
/// teacher's distribution on its own samples, so the mean per-token KL from student to teacher
/// falls over the steps; killed after its first checkpoint, the orchestrator's replacement
/// resumes with the teacher loaded again, records every step once, and gives the series of
/// the same run uninterrupted. A teacher whose tokenizer is not the student's is refused with
/// the reason.
#[tokio::test(flavor = "multi_thread")]
async fn distillation_brings_the_students_kl_to_the_teacher_down() {
    let mut stack = Stack::start();
    let (student, teacher) = (stack.dir.path().join("student"), stack.dir.path().join("teacher"));
    keel_testkit::keel_model_init_preset(&student, "small", 1);
    keel_testkit::keel_model_init_preset(&teacher, "medium", 2);
    let mut spec = grpo_spec(&json!({"path": student}));
    spec["distillation"] = json!({"teacher": {"path": teacher}});
    // The teacher takes the reference's place: no KL penalty (for the refused run below too).
    spec["training"]["loss"]["reference_policy_kl_penalty"] = json!(0.0);
    spec["training"]["optimizer"]["lr"] = json!(0.002);
    let (_, kl) = resumed_like_uninterrupted(&mut stack, &spec, "train/teacher_kl").await;
    let mean = |points: &[(u64, f64)]| points.iter().map(|p| p.1).sum::<f64>() / points.len() as f64;
    let (first, last) = (mean(&kl[..3]), mean(&kl[7..]));
    assert!(first > 0.0 && last < 0.8 * first, "the KL to the teacher fell: {kl:?}");

    // A teacher whose tokenizer gives two tokens each other's ids.
    let other = stack.dir.path().join("other-tokenizer");
    std::fs::create_dir_all(&other).unwrap();
    for file in std::fs::read_dir(&teacher).unwrap() {
        let file = file.unwrap().path();
        std::fs::copy(&file, other.join(file.file_name().unwrap())).unwrap();
    }
    let mut tokenizer: serde_json::Value =
        serde_json::from_slice(&std::fs::read(other.join("tokenizer.json")).unwrap()).unwrap();
    let vocab = tokenizer["model"]["vocab"].as_object_mut().unwrap();
    let (a, b) = (vocab["a"].clone(), vocab["b"].clone());
    (vocab["a"], vocab["b"]) = (b, a);
    std::fs::write(other.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    spec["distillation"] = json!({"teacher": {"path": other}});
    spec["max_num_steps"] = json!(1);
    let refused = stack.submit(&spec).await;
    let run = stack.wait_for(&refused, LIMIT, |run| run["status"] == "failed").await;
    assert!(run["reason"].as_str().unwrap().contains("another tokenizer"), "{run}");
}
