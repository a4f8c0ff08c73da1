//! Runs hold generators of their own: two GRPO runs of two models of different shapes and
//! architectures, made by transformers, run at once on one stack, each on its own trainer and
//! generator, which load its model (one generator has a start-up model of its own, the other
//! none); each run's generator logprobs match its trainer's. When they end, the generators go
//! back to the pool: the one with a start-up model serves it again. A run whose model no
//! generator can load fails at load, with the loader's reason.

#![allow(clippy::unwrap_used)]

mod stack;

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use stack::{Stack, grpo_spec};

const LIMIT: Duration = Duration::from_secs(600);

/// A model made by transformers (`tests/reference/transformers_model.py`) with the
/// tokenizer of `src`.
fn transformers_model(src: &Path, dst: &Path, arch: &str, hidden: u32, layers: u32) {
    let script = keel_testkit::workspace_root().join("tests/reference/transformers_model.py");
    let status = std::process::Command::new(keel_testkit::python())
        .arg(script)
        .args([src, dst])
        .args(["--arch", arch, "--hidden", &hidden.to_string(), "--layers", &layers.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "transformers could not make the {arch} model");
}

/// The models a generator's OpenAI API serves (its `/v1/models`), or its error type.
async fn served(http: &reqwest::Client, url: &str) -> Result<Vec<String>, String> {
    let response = http.get(format!("{url}/v1/models")).send().await.unwrap();
    let body: serde_json::Value = response.json().await.unwrap();
    match body["data"].as_array() {
        Some(models) => Ok(models.iter().map(|m| m["id"].as_str().unwrap().to_string()).collect()),
        None => Err(body["error"]["type"].as_str().unwrap_or_default().to_string()),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn two_runs_of_two_models_share_a_stack_and_a_model_no_generator_loads_fails_at_load() {
    let stack = Stack::start_with(&[("KEEL_ORCHESTRATOR__MAX_ATTEMPTS", "1")]);
    let llama = stack.dir.path().join("llama");
    let qwen2 = stack.dir.path().join("qwen2");
    transformers_model(&stack.model, &llama, "llama", 64, 2);
    transformers_model(&stack.model, &qwen2, "qwen2", 96, 3);
    let trainer = stack.start_another("trainer", &[], &[]);
    let bare = stack.start_another("generator", &["KEEL_GENERATOR__MODEL", "KEEL_GENERATOR__GENERATOR_ID"], &[]);
    assert_eq!(served(&stack.http, &bare.url).await, Err("unavailable".into()), "no model before a run loads one");

    let first = stack.submit(&grpo_spec(&json!({"path": llama}))).await;
    let second = stack.submit(&grpo_spec(&json!({"path": qwen2}))).await;
    // Both hold a generator at once: each serves one of the runs, under the run's name.
    let running = |run: &serde_json::Value| run["status"] == "running" && run["step"].as_u64().unwrap_or(0) >= 1;
    stack.wait_for(&first, LIMIT, running).await;
    stack.wait_for(&second, LIMIT, running).await;
    let mut names =
        [served(&stack.http, &stack.generator.url).await.unwrap(), served(&stack.http, &bare.url).await.unwrap()]
            .concat();
    names.sort();
    let mut runs = vec![first.clone(), second.clone()];
    runs.sort();
    assert_eq!(names, runs, "each generator serves one run's model under the run's name");
    for id in [&first, &second] {
        let run = stack.wait_succeeded(id, LIMIT).await;
        assert_eq!(run["step"], 3, "{run}");
        let errors = stack.series(id, "train/token_mult_prob_error").await;
        assert_eq!(errors.len(), 3, "{errors:?}");
        for (step, error) in errors {
            assert!((0.99..1.05).contains(&error), "run {id} step {step}: token_mult_prob_error {error}");
        }
    }
    // Released, the generators are free again: one serves its start-up model, the other
    // nothing.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while served(&stack.http, &stack.generator.url).await != Ok(vec!["model".to_string()]) {
        assert!(std::time::Instant::now() < deadline, "the start-up model is not served again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(served(&stack.http, &bare.url).await, Err("unavailable".into()));

    // A model whose config does not hold together (four layers, two layer types): the
    // generators refuse it at load, and the run fails with why (an eval run: no trainer
    // loads it first).
    let broken = stack.dir.path().join("broken");
    transformers_model(&stack.model, &broken, "qwen2", 64, 2);
    let config_path = broken.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["num_hidden_layers"] = json!(4);
    std::fs::write(&config_path, config.to_string()).unwrap();
    let mut spec = grpo_spec(&json!({"path": broken}));
    spec["algorithm"] = json!("eval");
    for field in ["training", "grpo", "checkpointing"] {
        spec.as_object_mut().unwrap().remove(field);
    }
    let eval = stack.submit(&spec).await;
    let run = stack.wait_for(&eval, LIMIT, |run| run["status"] == "failed").await;
    let reason = run["reason"].as_str().unwrap();
    assert!(reason.contains("cannot load the run's model") && reason.contains("load_failed"), "{reason}");
    assert!(
        reason.contains("broken") && reason.contains("layers"),
        "the loader's reason names what is wrong: {reason}"
    );
    drop((trainer, bare));
}
