//! Agent environments end to end: the five services as processes and the example agent
//! (`examples/agent/agent.py`, the official `openai` client with a calculator tool) as the
//! user would run it; the example spec trains through it as written, and agents that fail,
//! time out, go past a limit or leave their conversation drop only their own samples, each
//! with its reason in the run's samples.

#![allow(clippy::unwrap_used)]

mod stack;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use stack::Stack;

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

/// The example agent on a free port, stopped however the test ends.
struct Agent {
    child: Child,
    url: String,
}

impl Agent {
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let python = std::env::var("KEEL_PYTHON").unwrap_or_else(|_| "python3".into());
        let child = Command::new(python)
            .arg(examples().join("agent/agent.py"))
            .args(["--port", &port.to_string(), "--faults", "--max-turns", "2"])
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "the agent did not start listening");
            std::thread::sleep(Duration::from_millis(100));
        }
        Self { child, url: format!("http://127.0.0.1:{port}/") }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn stack(more: &[(&str, &str)]) -> Stack {
    let env = [("KEEL_REWARD__HTTP_ALLOW_PRIVATE_ADDRESSES", "true"), ("KEEL_GENERATOR__TOOL_CALL_PARSER", "hermes")];
    Stack::start_with(&[&env[..], more].concat())
}

async fn samples(stack: &Stack, id: &str) -> Vec<Value> {
    stack.get(&format!("/v1/runs/{id}/samples?split=train&limit=200")).await["samples"].as_array().unwrap().clone()
}

/// `keel run submit examples/agent/grpo.yaml`, as its comment says, for two steps: the run
/// succeeds, its rewards and turns are recorded, and each sample's turns are the model's. The
/// agent passes on the trace context it is sent: its calls to the generator are in the trace
/// of the step they belong to.
#[tokio::test]
async fn the_example_agent_trains_as_written() {
    let (otlp, spans) = stack::otlp::otlp_receiver().await;
    let stack = stack(&[("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp), ("OTEL_BSP_SCHEDULE_DELAY", "200")]);
    let agent = Agent::start();
    let output = Command::new(keel_testkit::binary("keel"))
        .args(["run", "submit", examples().join("agent/grpo.yaml").to_str().unwrap()])
        .env("KEEL_API_URL", stack.api())
        .envs([("MODEL_DIR", stack.model.to_str().unwrap()), ("STEPS", "2"), ("AGENT_URL", agent.url.as_str())])
        .output()
        .unwrap();
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    let id = stdout.lines().next().unwrap().to_string();
    let run = stack.wait_succeeded(&id, Duration::from_secs(600)).await;
    for metric in ["train/reward", "train/turns_per_sample", "train/rewards/correct", "train/rewards/used_calculator"] {
        assert_eq!(stack.series(&id, metric).await.len(), 2, "{metric} at both steps: {run}");
    }
    let recorded = samples(&stack, &id).await;
    assert!(!recorded.is_empty(), "{run}");
    for sample in &recorded {
        assert_eq!(sample["error"], Value::Null, "{sample}");
        assert_eq!(sample["dropped"], false, "{sample}");
        assert!(sample["info"]["calls"].as_u64().unwrap() >= 1, "the agent reported its calls: {sample}");
        assert_eq!(sample["turns"][0]["role"], "assistant", "{sample}");
        assert!(sample["prompt"].as_str().unwrap().contains("calculator"), "the agent's own prompt: {sample}");
        assert!(sample["num_generated_tokens"].as_u64().unwrap() >= 1, "{sample}");
    }
    // The same through async GRPO: rollouts of the next step overlap training, each sample's
    // session opened on weights recent enough for its step.
    let output = Command::new(keel_testkit::binary("keel"))
        .args(["run", "submit", examples().join("agent/grpo.yaml").to_str().unwrap()])
        .args(["--set", "grpo.async_grpo.enabled=true", "--set", "name=agent-grpo-async"])
        .env("KEEL_API_URL", stack.api())
        .envs([("MODEL_DIR", stack.model.to_str().unwrap()), ("STEPS", "3"), ("AGENT_URL", agent.url.as_str())])
        .output()
        .unwrap();
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    let async_id = stdout.lines().next().unwrap().to_string();
    let run = stack.wait_succeeded(&async_id, Duration::from_secs(600)).await;
    assert_eq!(stack.series(&async_id, "train/reward").await.len(), 3, "{run}");
    for sample in samples(&stack, &async_id).await {
        assert_eq!(sample["error"], Value::Null, "{sample}");
    }
    // Every chat call the generator served is in a trace the orchestrator's step began.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let spans = spans.lock().unwrap().clone();
        let chats: Vec<_> =
            spans.iter().filter(|s| s.service == "keel-generator" && s.name.contains("/v1/chat/completions")).collect();
        let orphans: Vec<_> = chats
            .iter()
            .filter(|chat| !spans.iter().any(|s| s.trace == chat.trace && s.service == "keel-orchestrator"))
            .collect();
        if !chats.is_empty() && orphans.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "{} chat spans, {} outside a step's trace", chats.len(), orphans.len());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The demo's client part on the agent task, as scripts/demo runs it (`KEEL_DEMO_TASK=agent
/// scripts/demo-run` with the agent beside the stack), shortened through its specs' variables:
/// it writes the SFT conversations (`keel run submit` uploads them), runs SFT, GRPO through
/// the agent and the eval of both models on the test split, and prints the test score of each.
#[tokio::test]
async fn the_agent_demo_runs_as_scripted() {
    let stack = stack(&[]);
    let agent = Agent::start();
    let out = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/demo-run");
    let output = Command::new(script)
        .env("KEEL_API_URL", stack.api())
        .env("KEEL", keel_testkit::binary("keel"))
        .env("KEEL_PYTHON", keel_testkit::python())
        .env("KEEL_DEMO_OUT", out.path())
        .envs([
            ("KEEL_DEMO_TASK", "agent"),
            ("MODEL_DIR", stack.model.to_str().unwrap()),
            ("AGENT_URL", agent.url.as_str()),
            ("SFT_STEPS", "12"),
            ("GRPO_STEPS", "2"),
            ("VALIDATION_PROMPTS", "6"),
            ("TEST_PROMPTS", "6"),
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("test reward_mean (greedy, scored once): SFT model"), "{stdout}");
    assert!(stdout.contains("seed 1: best checkpoint by smoothed validation at step"), "{stdout}");
    assert!(stderr.contains("called the calculator in"), "{stderr}");
    let conversations = std::fs::read_to_string(out.path().join("agent-sft.jsonl")).unwrap();
    assert_eq!(conversations.lines().count(), 8000);
    let runs = stack.get("/v1/runs?limit=200").await;
    let mut names: Vec<(String, String)> = runs["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["name"].as_str().unwrap().to_string(), r["status"].as_str().unwrap().to_string()))
        .collect();
    names.sort();
    let succeeded = |name: &str| (name.to_string(), "succeeded".to_string());
    assert_eq!(
        names,
        [
            succeeded("agent-demo-eval"),
            succeeded("agent-demo-eval"),
            succeeded("agent-demo-grpo"),
            succeeded("agent-demo-sft")
        ],
        "{runs}"
    );
}

/// One step over a record that behaves and four that do not: the agent answers 500, sleeps
/// past the timeout, calls past `max_calls`, or starts a second conversation. The step
/// succeeds; the good record's samples are trained on and every other sample is dropped with
/// its reason.
#[tokio::test]
async fn a_failing_agent_drops_only_its_own_samples() {
    let stack = stack(&[]);
    let agent = Agent::start();
    let data = stack.dir.path().join("faults.jsonl");
    let records =
        [("42", None), ("1", Some("error")), ("2", Some("timeout")), ("3", Some("limit")), ("4", Some("fork"))];
    let lines: Vec<String> = records
        .iter()
        .map(|(answer, fault)| {
            json!({"prompt": format!("What is {answer} * 1?"), "answer": answer, "fault": fault}).to_string()
        })
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let spec = json!({
        "name": "agent-faults",
        "algorithm": "grpo",
        "model": {"path": stack.model},
        "data": {"train": {"kind": "jsonl", "path": data}},
        "environments": {"default": {"name": "agent", "url": agent.url, "max_calls": 2, "timeout_ms": 15000}},
        "training": {
            "loss": {"type": "clipped_pg", "reference_policy_kl_penalty": 0.0},
            "optimizer": {"lr": 0.0001, "weight_decay": 0.0},
            "global_batch_size": 10,
            "micro_batch_size": 5,
        },
        "grpo": {"num_prompts_per_step": 5, "num_generations_per_prompt": 2, "samples_to_record": 10},
        "generation": {"max_new_tokens": 48, "temperature": 1.0},
        "max_total_sequence_length": 256,
        "max_num_steps": 1,
    });
    let id = stack.submit(&spec).await;
    let run = stack.wait_succeeded(&id, Duration::from_secs(600)).await;
    let recorded = samples(&stack, &id).await;
    assert_eq!(recorded.len(), 10, "{run}");
    let reasons = [("1", "http_status"), ("2", "timeout"), ("3", "agent_limit"), ("4", "agent_not_one_conversation")];
    for sample in &recorded {
        let truth = sample["ground_truth"].as_str().unwrap();
        match reasons.iter().find(|(answer, _)| *answer == truth) {
            Some((_, reason)) => {
                let error = sample["error"].as_str().unwrap_or_else(|| panic!("no error: {sample}"));
                assert!(error.starts_with(reason), "{reason}: {sample}");
                assert_eq!(sample["dropped"], true, "{sample}");
            }
            None => {
                assert_eq!(sample["error"], Value::Null, "{sample}");
                assert_eq!(sample["dropped"], false, "{sample}");
                assert!(sample["num_generated_tokens"].as_u64().unwrap() >= 1, "{sample}");
            }
        }
    }
    let turns = stack.series(&id, "train/turns_per_sample").await;
    assert_eq!(turns.len(), 1, "the step was recorded: {run}");
}
