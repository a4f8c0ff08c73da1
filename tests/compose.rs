//! `docker compose up` of `compose.yaml` exactly as shipped, as a new user runs it: the image
//! built from `docker/Dockerfile`, every service healthy, the `demo` service's short SFT →
//! GRPO through the example agent → eval finished with exit 0, the API and dashboard
//! answering on :8080 with the token (and refusing without it), the services' spans received
//! by the OTLP endpoint compose names (one trace per GRPO step across the services, none for
//! health checks), and the runs still listed after `docker compose down` and `up` again. The
//! project's containers, networks and volumes are removed at the end, whatever happened; the
//! images are kept as the next build's cache.
//!
//! It needs a Docker engine with compose v2 and the images compose.yaml starts from
//! (`scripts/docker-engine` makes them where no registry is reachable), so it is ignored by
//! a plain `cargo test` and run by `scripts/test` in a step of its own, after that script:
//! `cargo nextest run -p keel-e2e --test compose --run-ignored only --no-capture`.

#![allow(clippy::unwrap_used)]

#[allow(dead_code)]
#[path = "stack/otlp.rs"]
mod otlp;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use otlp::Span;
use serde_json::Value;

const PROJECT: &str = "keel-compose-test";
const API: &str = "http://127.0.0.1:8080";
const SFT_STEPS: u64 = 30;
const GRPO_STEPS: u64 = 10;
/// The services that keep running, each with a health check.
const LONG_RUNNING: [&str; 9] =
    ["nats", "postgres", "jaeger", "checkpoint", "orchestrator", "trainer", "generator", "reward", "agent"];
const KEEL_SERVICES: [&str; 5] =
    ["keel-orchestrator", "keel-trainer", "keel-generator", "keel-reward", "keel-checkpoint"];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The `.env` this test gives compose, as a user makes it (`scripts/make-secrets`): in the
/// target directory, so that a developer's own `.env` is neither read nor changed.
fn env_file() -> PathBuf {
    let file = root().join("target/compose-test.env");
    let made = Command::new("bash").arg(root().join("scripts/make-secrets")).arg(&file).output().unwrap();
    assert!(made.status.success(), "scripts/make-secrets: {}", String::from_utf8_lossy(&made.stderr));
    file
}

/// The value `name` has in [`env_file`].
fn secret(name: &str) -> String {
    let text = std::fs::read_to_string(env_file()).unwrap();
    let prefix = format!("{name}=");
    text.lines().find_map(|l| l.strip_prefix(&prefix)).unwrap_or_else(|| panic!("no {name} in the .env")).to_string()
}

/// `docker compose -p PROJECT ARGS` on the repository's compose.yaml, with the demo short.
fn compose(args: &[&str]) -> Output {
    Command::new("docker")
        .current_dir(root())
        .args(["compose", "-p", PROJECT, "-f", "compose.yaml", "--env-file"])
        .arg(env_file())
        .args(args)
        .env("SFT_STEPS", SFT_STEPS.to_string())
        .env("GRPO_STEPS", GRPO_STEPS.to_string())
        .env("KEEL_DEMO_SEEDS", "1")
        // The agent demo's validation and test sets, short too.
        .env("VALIDATION_PROMPTS", "32")
        .env("TEST_PROMPTS", "32")
        .env_remove("KEEL_API_TOKEN")
        .env_remove("KEEL_REWARD_TOKEN")
        .output()
        .unwrap_or_else(|e| panic!("docker compose {}: {e}", args.join(" ")))
}

/// `compose(args)`, panicking with its output unless it succeeded; returns its stdout.
fn compose_ok(args: &[&str]) -> String {
    let output = compose(args);
    assert!(
        output.status.success(),
        "docker compose {} failed:\n{}\n{}",
        args.join(" "),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Removes the project's containers, networks and volumes when dropped.
struct Project;

impl Drop for Project {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let logs = compose(&["logs", "--no-color", "--tail", "60"]);
            eprintln!("the services' last log lines:\n{}", String::from_utf8_lossy(&logs.stdout));
        }
        let down = compose(&["down", "--volumes", "--remove-orphans", "--timeout", "20"]);
        if !down.status.success() {
            eprintln!("docker compose down: {}", String::from_utf8_lossy(&down.stderr));
        }
    }
}

/// Each container of the project (stopped ones too): service name → (state, health, exit code).
fn containers() -> BTreeMap<String, (String, String, i64)> {
    let listed = compose_ok(&["ps", "--all", "--format", "json"]);
    // compose prints one JSON object a line (older releases: one array).
    let rows: Vec<Value> = if listed.trim_start().starts_with('[') {
        serde_json::from_str(&listed).unwrap()
    } else {
        listed.lines().filter(|l| !l.trim().is_empty()).map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    rows.iter()
        .map(|row| {
            let text = |key: &str| row[key].as_str().unwrap_or_default().to_string();
            (text("Service"), (text("State"), text("Health"), row["ExitCode"].as_i64().unwrap_or(-1)))
        })
        .collect()
}

/// Waits until every long-running service is healthy and `model-init` exited 0; prints when
/// each became healthy.
fn wait_healthy(started: Instant) {
    let deadline = started + Duration::from_secs(300);
    let mut healthy = BTreeSet::new();
    loop {
        let now = containers();
        if let Some((state, _, code)) = now.get("model-init") {
            assert!(!(state == "exited" && *code != 0), "model-init exited with {code}");
        }
        for service in LONG_RUNNING {
            if let Some((state, health, _)) = now.get(service) {
                assert_ne!(state, "exited", "{service} exited: {now:?}");
                if health == "healthy" && healthy.insert(service) {
                    println!("compose: {service} healthy after {:.0} s", started.elapsed().as_secs_f64());
                }
            }
        }
        let model_made = now.get("model-init").is_some_and(|(state, _, code)| state == "exited" && *code == 0);
        if healthy.len() == LONG_RUNNING.len() && model_made {
            return;
        }
        assert!(Instant::now() < deadline, "not every service is healthy after 300 s: {now:?}");
        std::thread::sleep(Duration::from_secs(2));
    }
}

/// Waits for the demo container to finish; returns its exit code and its output.
fn wait_demo(started: Instant) -> (i64, String) {
    let deadline = started + Duration::from_secs(1200);
    loop {
        if let Some((state, _, code)) = containers().get("demo")
            && state == "exited"
        {
            let logs = compose_ok(&["logs", "--no-color", "--no-log-prefix", "demo"]);
            return (*code, logs);
        }
        assert!(Instant::now() < deadline, "the demo has not finished after 1200 s");
        std::thread::sleep(Duration::from_secs(3));
    }
}

async fn get(http: &reqwest::Client, path: &str, token: Option<&str>) -> (u16, String) {
    let mut request = http.get(format!("{API}{path}"));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

/// The runs the API lists, as (id, name, status).
async fn runs(http: &reqwest::Client) -> Vec<(String, String, String)> {
    let (status, body) = get(http, "/v1/runs?limit=200", Some(&secret("KEEL_API_TOKEN"))).await;
    assert_eq!(status, 200, "GET /v1/runs with the token: {body}");
    let listed: Value = serde_json::from_str(&body).unwrap();
    let mut runs: Vec<(String, String, String)> = listed["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let text = |key: &str| r[key].as_str().unwrap_or_default().to_string();
            (text("id"), text("name"), text("status"))
        })
        .collect();
    runs.sort();
    runs
}

/// Every span the OTLP endpoint (the `jaeger` service) has received so far, copied out of
/// its container into `into`.
fn received_spans(into: &Path) -> Vec<Span> {
    let _ = std::fs::remove_dir_all(into);
    compose_ok(&["cp", "jaeger:/data", &into.display().to_string()]);
    let mut spans = Vec::new();
    for entry in std::fs::read_dir(into).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.ends_with(".part") {
            continue;
        }
        assert!(name.ends_with(".x-protobuf"), "an OTLP body that is not protobuf: {name}");
        spans.extend(otlp::decode(&std::fs::read(&path).unwrap()));
    }
    spans
}

/// The traces whose root is a `grpo step` span of `run`, by step, once each has spans of at
/// least four services (the batch exporters send every few seconds).
fn step_traces(run: &str, scratch: &Path) -> (Vec<Span>, BTreeMap<u64, BTreeSet<String>>) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let spans = received_spans(scratch);
        let mut steps: BTreeMap<u64, BTreeSet<String>> = BTreeMap::new();
        for root in spans
            .iter()
            .filter(|s| s.name == "grpo step" && s.attributes.get("run_id").map(String::as_str) == Some(run))
        {
            let step: u64 = root.attributes["step"].parse().unwrap();
            let services = spans.iter().filter(|s| s.trace == root.trace).map(|s| s.service.clone()).collect();
            assert!(steps.insert(step, services).is_none(), "two traces for step {step}");
        }
        let complete = steps.len() as u64 == GRPO_STEPS && steps.values().all(|services| services.len() >= 4);
        if complete || Instant::now() > deadline {
            return (spans, steps);
        }
        std::thread::sleep(Duration::from_secs(2));
    }
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs a Docker engine and the base images: scripts/test runs it after scripts/docker-engine"]
async fn compose_up_runs_the_demo_traces_it_and_keeps_its_runs() {
    let docker = Command::new("docker").args(["compose", "version"]).output();
    assert!(
        docker.is_ok_and(|o| o.status.success()),
        "no Docker engine with compose v2: run scripts/docker-engine first"
    );
    let _ = compose(&["down", "--volumes", "--remove-orphans"]);
    let _project = Project;
    let scratch = tempfile::tempdir().unwrap();

    let started = Instant::now();
    compose_ok(&["build"]);
    println!("compose: image keel:latest built from docker/Dockerfile in {:.0} s", started.elapsed().as_secs_f64());

    let up = Instant::now();
    compose_ok(&["up", "--detach"]);
    wait_healthy(up);
    println!("compose: every service healthy {:.0} s after up", up.elapsed().as_secs_f64());

    let (code, logs) = wait_demo(up);
    let tail: Vec<&str> = logs.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect();
    println!(
        "compose: the demo ({SFT_STEPS} SFT, {GRPO_STEPS} GRPO steps) exited {code} after {:.0} s; its last lines:",
        up.elapsed().as_secs_f64()
    );
    println!("{}", tail.join("\n"));
    assert_eq!(code, 0, "the demo failed:\n{logs}");
    assert!(logs.contains("test gain"), "the demo printed no result:\n{logs}");

    // The API and the dashboard on the published port, with the token and only with it.
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    assert_eq!(get(&http, "/v1/runs", None).await.0, 401, "the API refuses a request without the token");
    assert_eq!(get(&http, "/dashboard", None).await.0, 401, "the dashboard refuses a browser without the token");
    let token = secret("KEEL_API_TOKEN");
    let opened = http.get(format!("{API}/dashboard?token={token}")).send().await.unwrap();
    assert_eq!(opened.status(), 303, "the dashboard opened with ?token= keeps it in a cookie");
    let cookie = opened.headers()["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_string();
    let page = http.get(format!("{API}/dashboard")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(page.status(), 200, "the dashboard with its cookie");
    let page = page.text().await.unwrap();
    assert!(page.to_lowercase().contains("<!doctype html>"), "{page}");

    // The code environment's sandbox works inside the reward container: a program that
    // passes its test scores 1 through the reward service's API, which is not published (it
    // is asked from inside its container).
    let body = serde_json::json!({
        "env": {"name": "code"},
        "samples": [{"prompt": "Print the sum of 2 and 3.", "completion": "```python\nprint(2 + 3)\n```",
                     "metadata": {"tests": [{"stdin": "", "stdout": "5"}]}}]
    });
    let authorization = format!("authorization: Bearer {}", secret("KEEL_REWARD_TOKEN"));
    let scored = compose_ok(&[
        "exec",
        "-T",
        "reward",
        "curl",
        "-sS",
        "-H",
        &authorization,
        "-H",
        "content-type: application/json",
        "-d",
        &body.to_string(),
        "http://127.0.0.1:8082/v1/score",
    ]);
    let scored: Value = serde_json::from_str(&scored).unwrap_or_else(|e| panic!("{e}: {scored}"));
    assert_eq!(scored["results"][0]["reward"], 1.0, "a passing program scores 1 in the sandbox: {scored}");
    // Only the API/dashboard, the generator and the Jaeger UI are published, on 127.0.0.1.
    // (`ps --format json` is one array or one object per line, by compose version.)
    let listed = compose_ok(&["ps", "--format", "json"]);
    let containers: Vec<Value> = match serde_json::from_str::<Value>(listed.trim()) {
        Ok(Value::Array(all)) => all,
        _ => listed.lines().filter(|l| !l.trim().is_empty()).map(|l| serde_json::from_str(l).unwrap()).collect(),
    };
    let mut published = BTreeSet::new();
    for container in &containers {
        let service = container["Service"].as_str().unwrap_or_default();
        for port in container["Publishers"].as_array().into_iter().flatten().filter(|p| p["PublishedPort"] != 0) {
            assert_eq!(port["URL"], "127.0.0.1", "{service} is published beyond loopback: {port}");
            published.insert(service.to_string());
        }
    }
    let expected: BTreeSet<String> = ["generator", "jaeger", "orchestrator"].map(String::from).into();
    assert_eq!(published, expected, "what compose publishes: {containers:?}");
    let before = runs(&http).await;
    let grpo: Vec<&(String, String, String)> = before.iter().filter(|r| r.1 == "agent-demo-grpo").collect();
    assert_eq!(grpo.len(), 1, "one GRPO run: {before:?}");
    for (id, name, status) in &before {
        assert_eq!(status, "succeeded", "run {id} ({name})");
    }
    for name in ["agent-demo-sft", "agent-demo-eval"] {
        assert!(before.iter().any(|r| r.1 == name), "no {name} run in {before:?}");
    }

    // Spans: every service's reached the OTLP endpoint compose names; each GRPO step is one
    // trace across the services; health checks (every 5 s from every container) made none.
    let (spans, steps) = step_traces(&grpo[0].0, &scratch.path().join("otlp"));
    let mut by_service: BTreeMap<&str, usize> = BTreeMap::new();
    for span in &spans {
        *by_service.entry(span.service.as_str()).or_default() += 1;
    }
    let traces: BTreeSet<&str> = spans.iter().map(|s| s.trace.as_str()).collect();
    println!("compose: {} spans in {} traces received by the OTLP endpoint: {by_service:?}", spans.len(), traces.len());
    for (step, services) in &steps {
        println!("compose: GRPO step {step}'s trace spans {services:?}");
    }
    for service in KEEL_SERVICES {
        assert!(by_service.get(service).is_some_and(|n| *n > 0), "no span from {service}: {by_service:?}");
    }
    assert_eq!(steps.keys().copied().collect::<Vec<_>>(), (1..=GRPO_STEPS).collect::<Vec<_>>(), "a trace per step");
    for (step, services) in &steps {
        assert!(services.len() >= 4, "step {step}'s trace reaches {services:?} only");
    }
    let probes: Vec<&Span> =
        spans.iter().filter(|s| s.name.ends_with(" /healthz") || s.name.ends_with(" /metrics")).collect();
    assert!(probes.is_empty(), "health checks made spans: {:?}", probes.iter().map(|s| &s.name).collect::<Vec<_>>());

    // `docker compose down` and `up` again: the runs are still there, the demo does not run
    // a second time (its marker is in the work volume).
    let restarted = Instant::now();
    compose_ok(&["down", "--timeout", "20"]);
    compose_ok(&["up", "--detach"]);
    wait_healthy(restarted);
    let after = runs(&http).await;
    println!(
        "compose: after down and up ({:.0} s) the API lists the same {} runs",
        restarted.elapsed().as_secs_f64(),
        after.len()
    );
    assert_eq!(after, before, "the runs after down and up");
    let (code, logs) = wait_demo(restarted);
    assert_eq!(code, 0, "{logs}");
    assert!(logs.contains("the demo ran already"), "the demo ran again after up:\n{logs}");
    println!("compose: the whole test took {:.0} s", started.elapsed().as_secs_f64());
}
