//! The specs under `examples/` submitted as the documentation shows them: `keel run submit
//! FILE` with its `${VAR}`s in the environment and `--set` overrides, against the five
//! services as processes, each run to success; `keel run validate`, the dry run, which
//! lists every problem of a broken spec and creates nothing; and what users bring: a
//! Parquet dataset whose rows carry their environment's metadata, a model by its Hub id.

#![allow(clippy::unwrap_used)]

mod stack;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use stack::Stack;

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

/// `keel ARGS` against the stack's API with `env` added; the whole output.
fn keel(stack: &Stack, args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(keel_testkit::binary("keel"))
        .args(args)
        .env("KEEL_API_URL", stack.api())
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

/// `keel run submit ...`'s run id, after checking it succeeded.
fn submitted(stack: &Stack, args: &[&str], env: &[(&str, &str)]) -> String {
    let output = keel(stack, &[&["run", "submit"], args].concat(), env);
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(output.status.success(), "keel run submit {args:?}: {stdout}{}", String::from_utf8_lossy(&output.stderr));
    stdout.lines().next().unwrap_or_default().to_string()
}

async fn runs(stack: &Stack) -> usize {
    stack.get("/v1/runs?limit=200").await["runs"].as_array().unwrap().len()
}

/// The arithmetic demo's three specs as files, filled in from the environment and shortened
/// with `--set`: SFT, GRPO from its checkpoint, eval of GRPO's.
#[tokio::test]
async fn the_arithmetic_specs_run_as_written() {
    let stack = Stack::start();
    let dir = examples().join("arithmetic");
    let model = stack.model.display().to_string();
    let (sft, grpo, eval) = (dir.join("sft.yaml"), dir.join("grpo.yaml"), dir.join("eval.yaml"));
    let short = ["--set", "data.train.max_operand=9", "--set", "max_total_sequence_length=48"];

    let sft_run = submitted(
        &stack,
        &[
            &[sft.to_str().unwrap()],
            &short[..],
            &["--set", "training.global_batch_size=8", "--set", "training.micro_batch_size=8"],
        ]
        .concat(),
        &[("MODEL_DIR", &model), ("SFT_STEPS", "12")],
    );
    let run = stack.wait_succeeded(&sft_run, Duration::from_secs(300)).await;
    assert_eq!(run["spec"]["max_num_steps"], 12, "SFT_STEPS reached the spec as a number: {run}");
    assert_eq!(run["spec"]["model"]["path"], model.as_str(), "{run}");
    let checkpoints = stack.get(&format!("/v1/runs/{sft_run}/checkpoints")).await;
    let sft_checkpoint = checkpoints.as_array().unwrap().last().unwrap()["id"].as_str().unwrap().to_string();

    let grpo_run = submitted(
        &stack,
        &[
            &[grpo.to_str().unwrap()],
            &short[..],
            &[
                "--set",
                "data.validation.max_operand=9",
                "--set",
                "grpo.num_prompts_per_step=4",
                "--set",
                "training.global_batch_size=32",
                "--set",
                "training.micro_batch_size=16",
                "--set",
                "validation.period=2",
                "--set",
                "checkpointing.save_period=2",
            ],
        ]
        .concat(),
        &[("SFT_CHECKPOINT", &sft_checkpoint), ("GRPO_STEPS", "2"), ("SEED", "5")],
    );
    let run = stack.wait_succeeded(&grpo_run, Duration::from_secs(300)).await;
    assert_eq!((run["spec"]["seed"].as_u64(), run["spec"]["max_num_steps"].as_u64()), (Some(5), Some(2)), "{run}");
    let checkpoints = stack.get(&format!("/v1/runs/{grpo_run}/checkpoints")).await;
    let grpo_checkpoint = checkpoints.as_array().unwrap().last().unwrap()["id"].as_str().unwrap().to_string();

    let eval_run = submitted(
        &stack,
        &[eval.to_str().unwrap(), "--set", "data.train.max_operand=9", "--watch"],
        &[("EVAL_CHECKPOINT", &grpo_checkpoint)],
    );
    let run = stack.get(&format!("/v1/runs/{eval_run}")).await;
    assert_eq!(run["status"], "succeeded", "{run}");
    assert!(run["latest_metrics"]["eval/accuracy"].is_number(), "{run}");
}

/// An unset variable is named before anything is sent; `validate` prints the spec as it would
/// run, or every problem, and neither creates a run.
#[tokio::test]
async fn validate_is_a_dry_run_and_unset_variables_are_named() {
    let stack = Stack::start();
    let sft = examples().join("arithmetic/sft.yaml");
    let sft = sft.to_str().unwrap();
    let model = stack.model.display().to_string();

    let output = keel(&stack, &["run", "submit", sft], &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("spec.model.path: ${MODEL_DIR} is not set"), "{stderr}");

    let output = keel(&stack, &["run", "validate", sft, "--set", "max_num_steps=7"], &[("MODEL_DIR", &model)]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    let resolved: serde_json::Value = serde_yaml_ng::from_str(&stdout).unwrap();
    assert_eq!(resolved["max_num_steps"], 7, "{stdout}");
    assert_eq!(resolved["model"]["path"], model.as_str(), "{stdout}");
    assert!(resolved["training"]["optimizer"]["betas"].is_array(), "defaults are filled in: {stdout}");

    let output = keel(
        &stack,
        &["run", "validate", sft, "--set", "training.micro_batch_size=64", "--set", "model.path=/no/such/model"],
        &[("MODEL_DIR", &model)],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    for problem in ["training.micro_batch_size: ", "model.path: "] {
        assert!(stderr.contains(&format!("\n  {problem}")), "every problem on a line of its own: {stderr}");
    }
    assert_eq!(runs(&stack).await, 0, "validating creates nothing");
}

/// GRPO on code from a Hugging Face dataset directory of Parquet files (written by pyarrow)
/// whose rows carry their own `tests` (one row's inside a `metadata` struct): each sample
/// reaches the sandbox with its row's tests, which the code environment's report counts.
#[tokio::test]
async fn each_rows_tests_reach_the_code_sandbox() {
    let stack = Stack::start();
    let dataset = stack.dir.path().join("code-dataset");
    let file = dataset.join("data/train-00000-of-00001.parquet");
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    let rows = serde_json::json!([
        {"question": "Print the sum of the two numbers on stdin.",
         "tests": [{"stdin": "1 2\n", "stdout": "3"}, {"stdin": "5 5\n", "stdout": "10"}]},
        {"question": "Define f() returning 7.",
         "metadata": {"tests": [{"stdin": "", "stdout": "7"}, {"stdin": "", "stdout": "8"}, {"stdin": "", "stdout": "9"}]}},
    ]);
    let script = "import json, sys, pyarrow as pa, pyarrow.parquet as pq\n\
                      rows = json.loads(sys.argv[2]); keys = sorted({k for r in rows for k in r})\n\
                  pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), sys.argv[1])";
    let status = Command::new(keel_testkit::python())
        .args(["-c", script, file.to_str().unwrap(), &rows.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "pyarrow could not write {}", file.display());

    let mut spec = stack::grpo_spec(&serde_json::json!({"path": stack.model}));
    spec["data"] = serde_json::json!({"train": {"kind": "parquet", "path": dataset, "split": "train", "keys": {"prompt": "question"}}});
    spec["environments"] = serde_json::json!({"default": {"name": "code", "cpu_seconds": 2, "wall_seconds": 5}});
    spec["validation"] = serde_json::json!({"period": 0});
    spec["checkpointing"] = serde_json::json!({"enabled": false});
    spec["max_num_steps"] = serde_json::json!(1);
    let run = stack.submit(&spec).await;
    stack.wait_succeeded(&run, Duration::from_secs(300)).await;
    let samples = stack.get(&format!("/v1/runs/{run}/samples?split=train&limit=100")).await;
    let samples = samples["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 8, "two prompts, four samples each");
    for sample in samples {
        let wanted = if sample["prompt"].as_str().unwrap().contains("sum") { 2 } else { 3 };
        assert_eq!(sample["info"]["total"], wanted, "the row's own tests were run: {sample}");
        let outcomes = sample["info"]["tests"].as_array().unwrap();
        assert_eq!(outcomes.len(), wanted, "each test ran in the sandbox: {sample}");
    }
}

/// `model.name` finds a model by its Hub id in the Hugging Face cache (`HF_HUB_CACHE`), laid
/// out as `hf download` leaves it, offline; a model the cache lacks is refused at submit
/// with the command that fetches it.
#[tokio::test]
async fn a_model_named_by_its_hub_id_is_found_in_the_cache() {
    let cache = tempfile::tempdir().unwrap();
    let stack = Stack::start_with(&[("HF_HUB_CACHE", cache.path().to_str().unwrap())]);
    let repo = cache.path().join("models--keel-test--Tiny-0.1B");
    let snapshot = repo.join("snapshots/0123abcd");
    std::fs::create_dir_all(&snapshot).unwrap();
    for entry in std::fs::read_dir(&stack.model).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), snapshot.join(entry.file_name())).unwrap();
    }
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123abcd").unwrap();

    let spec = stack::sft_spec(&serde_json::json!({"name": "keel-test/Tiny-0.1B"}), 2, 2);
    let run = stack.submit(&spec).await;
    stack.wait_succeeded(&run, Duration::from_secs(300)).await;

    let missing = stack::sft_spec(&serde_json::json!({"name": "keel-test/Absent"}), 2, 2);
    let response = stack.http.post(format!("{}/v1/runs", stack.api())).json(&missing).send().await.unwrap();
    assert_eq!(response.status(), 422);
    let body: serde_json::Value = response.json().await.unwrap();
    let problem = &body["error"]["problems"][0];
    assert_eq!(problem["field"], "model.name", "{body}");
    assert!(problem["message"].as_str().unwrap().contains("hf download keel-test/Absent"), "{body}");
}

/// One example of each journey as the README shows it: `MODEL_DIR=… keel run submit
/// examples/<journey>/<spec>.yaml`, `STEPS` short, the spec's data files beside it uploaded
/// by the CLI. What each must show beyond succeeding.
struct Journey {
    spec: &'static str,
    /// A metric the run must record.
    metric: &'static str,
}

const JOURNEYS: [Journey; 11] = [
    Journey { spec: "chat-sft/sft.yaml", metric: "validation/loss" },
    Journey { spec: "lora/sft.yaml", metric: "train/loss" },
    Journey { spec: "dpo/dpo.yaml", metric: "validation/accuracy" },
    Journey { spec: "reward-model/rm.yaml", metric: "validation/accuracy" },
    Journey { spec: "math-grpo/grpo.yaml", metric: "validation/accuracy" },
    Journey { spec: "async-grpo/grpo.yaml", metric: "async/trainer_idle_seconds" },
    Journey { spec: "ppo/ppo.yaml", metric: "train/value_loss" },
    Journey { spec: "eval/eval.yaml", metric: "eval/accuracy" },
    Journey { spec: "code-grpo/grpo.yaml", metric: "train/reward" },
    Journey { spec: "sliding-puzzle/grpo.yaml", metric: "train/turns_per_sample" },
    Journey { spec: "reward-service/grpo.yaml", metric: "train/rewards/on_topic" },
];

/// Every spec under `examples/`, relative to it.
fn example_specs() -> Vec<String> {
    let mut found = Vec::new();
    for dir in std::fs::read_dir(examples()).unwrap() {
        let dir = dir.unwrap().path();
        if !dir.is_dir() {
            continue;
        }
        for file in std::fs::read_dir(&dir).unwrap() {
            let file = file.unwrap().path();
            if file.extension().is_some_and(|e| e == "yaml") {
                found.push(file.strip_prefix(examples()).unwrap().display().to_string());
            }
        }
    }
    found.sort();
    found
}

/// Every journey's example runs as written against one stack; every spec under `examples/`
/// is one of them (or the arithmetic demo's, run above). The reward service example's plugin
/// is the Python program beside it, reading each record's `topic` from its metadata.
#[tokio::test]
async fn every_example_runs_as_the_readme_shows_it() {
    let mut listed: Vec<String> = JOURNEYS.iter().map(|j| j.spec.to_string()).collect();
    listed.extend(["arithmetic/eval.yaml", "arithmetic/grpo.yaml", "arithmetic/sft.yaml"].map(String::from));
    // Run by tests/agents.rs, with the agent beside it (the agent demo's through scripts/demo-run).
    listed.extend(
        ["agent/grpo.yaml", "agent-demo/eval.yaml", "agent-demo/grpo.yaml", "agent-demo/sft.yaml"].map(String::from),
    );
    listed.sort();
    assert_eq!(example_specs(), listed, "every spec under examples/ is run by a test");

    let stack = Stack::start_with(&[("KEEL_REWARD__HTTP_ALLOW_PRIVATE_ADDRESSES", "true")]);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let plugin = Command::new("python3")
        .arg(examples().join("reward-service/server.py"))
        .args(["--port", &port.to_string()])
        .spawn()
        .unwrap();
    // Stopped however the test ends.
    struct Stopped(std::process::Child);
    impl Drop for Stopped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _plugin = Stopped(plugin);
    let reward_url = format!("http://127.0.0.1:{port}/score");
    let model = stack.model.display().to_string();
    for journey in &JOURNEYS {
        let spec = examples().join(journey.spec);
        let env = [("MODEL_DIR", model.as_str()), ("STEPS", "2"), ("REWARD_URL", reward_url.as_str())];
        let id = submitted(&stack, &[spec.to_str().unwrap()], &env);
        let run = stack.wait_succeeded(&id, Duration::from_secs(300)).await;
        let points = stack.series(&id, journey.metric).await;
        assert!(!points.is_empty(), "{}: no {} in {run}", journey.spec, journey.metric);
        eprintln!("{}: succeeded, {} = {:?}", journey.spec, journey.metric, points.last().unwrap());
        if journey.spec.starts_with("sliding-puzzle") {
            // Each game was made from its record's metadata (`size: 2`): every board the
            // environment shows is 2×2 (rows of tiles, `_` the blank).
            let samples = stack.get(&format!("/v1/runs/{id}/samples?split=train&limit=100")).await;
            let mut boards = 0;
            for sample in samples["samples"].as_array().unwrap() {
                for turn in sample["turns"].as_array().unwrap().iter().filter(|t| t["role"] == "user") {
                    let rows: Vec<usize> = turn["content"]
                        .as_str()
                        .unwrap()
                        .lines()
                        .map(|line| line.split_whitespace().collect::<Vec<_>>())
                        .filter(|cells| {
                            !cells.is_empty() && cells.iter().all(|c| *c == "_" || c.parse::<u32>().is_ok())
                        })
                        .map(|cells| cells.len())
                        .collect();
                    assert_eq!(rows, [2, 2], "a 2x2 board: {turn}");
                    boards += 1;
                }
            }
            assert!(boards > 0, "the environment showed boards: {samples}");
        }
        if journey.spec.starts_with("reward-service") {
            // The plugin read each record's `topic` from the sample's metadata (its `info`
            // says which) and the topic is the one its prompt names.
            let samples = stack.get(&format!("/v1/runs/{id}/samples?split=train&limit=100")).await;
            let samples = samples["samples"].as_array().unwrap();
            assert!(!samples.is_empty());
            for sample in samples {
                let topic = sample["info"]["topic"].as_str().unwrap_or_default();
                assert!(!topic.is_empty() && sample["prompt"].as_str().unwrap().contains(topic), "{sample}");
            }
        }
    }
}

/// `keel stack up` starts the local stack without the demo and leaves it running; a shell
/// that has none of its settings (only where its state is) lists runs with `keel run list`,
/// its URL and token read from the stack's settings file; `keel stack down` stops it.
/// (The services come from this build: `keel` passes its own directory as `KEEL_BIN`.)
#[tokio::test]
async fn keel_stack_up_then_keel_run_list_in_a_new_shell() {
    let database = keel_testkit::TestDatabase::new("keel_stack");
    let state = tempfile::tempdir().unwrap();
    let free = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    // Five ports in a row for the services, away from the defaults.
    let base = 20000 + (std::process::id() % 2000) as u16 * 5;
    let nats_port = free().to_string();
    let base_text = base.to_string();
    let stack_env = [
        ("KEEL_STATE", state.path().to_str().unwrap()),
        ("KEEL_STACK_PORTS_FROM", base_text.as_str()),
        ("KEEL_STACK_NATS_PORT", nats_port.as_str()),
        ("KEEL_DATABASE_URL", database.url.as_str()),
    ];
    let keel_in = |args: &[&str], env: &[(&str, &str)]| {
        Command::new(keel_testkit::binary("keel"))
            .args(args)
            .current_dir(keel_testkit::workspace_root())
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", std::env::var("HOME").unwrap_or_default())
            .envs(env.iter().copied())
            .output()
            .unwrap()
    };
    let up = keel_in(&["stack", "up"], &stack_env);
    let said = format!("{}{}", String::from_utf8_lossy(&up.stdout), String::from_utf8_lossy(&up.stderr));
    // Stopped however the test ends.
    struct Down<'a>(Box<dyn Fn() + 'a>);
    impl Drop for Down<'_> {
        fn drop(&mut self) {
            (self.0)();
        }
    }
    let _down = Down(Box::new(|| drop(keel_in(&["stack", "down"], &stack_env))));
    assert!(up.status.success(), "keel stack up: {said}");
    assert!(said.contains("the stack is up"), "{said}");

    // A new shell: nothing but where the stack's state is.
    let list = keel_in(&["run", "list"], &[("KEEL_STATE", state.path().to_str().unwrap())]);
    let out = String::from_utf8_lossy(&list.stdout);
    assert!(list.status.success(), "keel run list: {out}{}", String::from_utf8_lossy(&list.stderr));
    assert!(out.starts_with("ID "), "{out}");
    let status = keel_in(&["stack", "status"], &stack_env);
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stdout));

    let down = keel_in(&["stack", "down"], &stack_env);
    assert!(String::from_utf8_lossy(&down.stdout).contains("the stack is down"));
    assert!(!state.path().join("stack.env").exists(), "the stack is gone, and so is its settings file");
    let status = keel_in(&["stack", "status"], &stack_env);
    assert!(!status.status.success(), "{}", String::from_utf8_lossy(&status.stdout));
}
