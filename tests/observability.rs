//! Observability of one GRPO run through the five services as processes: every service
//! exports its spans to an OTLP receiver this test runs (decoding the protobuf), and each
//! GRPO step is one trace whose spans form a single tree across all five services; error
//! spans carry their error's type and message; every
//! service answers `/metrics` with what it served; and the orchestrator's dashboard, loaded
//! in headless Chromium, plots the run and lists its samples (a screenshot is saved).

#![allow(clippy::unwrap_used)]

mod stack;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::json;
use stack::Stack;
use stack::otlp::{Span, otlp_receiver};

const LIMIT: Duration = Duration::from_secs(600);
const SERVICES: [&str; 5] = ["keel-orchestrator", "keel-generator", "keel-reward", "keel-trainer", "keel-checkpoint"];

/// Two GRPO steps, each validated and checkpointed, recording 8 samples, logged to
/// TensorBoard and W&B offline files in `logs` and to the MLflow server at `mlflow`.
fn observed_spec(model: &Path, logs: &Path, mlflow: &str) -> serde_json::Value {
    let mut spec = stack::grpo_spec(&json!({"path": model}));
    spec["logger"] = json!({
        "tensorboard_enabled": true, "log_dir": logs,
        "mlflow_enabled": true, "mlflow": {"tracking_uri": mlflow, "experiment_name": "keel-observed"},
        "wandb_enabled": true, "wandb": {"project": "keel-observed", "tags": ["observed"]},
    });
    spec["name"] = json!("observed-grpo");
    spec["max_num_steps"] = json!(2);
    spec["grpo"]["samples_to_record"] = json!(8);
    spec["validation"] = json!({"period": 1, "num_samples": 1, "temperature": 1.0});
    spec["checkpointing"] = json!({"save_period": 1});
    spec
}

/// The spans of the trace whose root is the `grpo step` span of `run`'s `step`, once every
/// service has exported its part (the batch exporters flush every 200 ms here).
async fn step_trace(spans: &Mutex<Vec<Span>>, run: &str, step: u64) -> Vec<Span> {
    let wanted = ["generator.generate", "reward.env_step", "trainer.logprobs", "trainer.train", "generator.refit"];
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let received = spans.lock().unwrap().clone();
        let root = received.iter().find(|s| {
            s.name == "grpo step"
                && s.attributes.get("run_id").map(String::as_str) == Some(run)
                && s.attributes.get("step") == Some(&step.to_string())
        });
        if let Some(root) = root {
            let trace: Vec<Span> = received.iter().filter(|s| s.trace == root.trace).cloned().collect();
            let services: BTreeSet<&str> = trace.iter().map(|s| s.service.as_str()).collect();
            let names: BTreeSet<&str> = trace.iter().map(|s| s.name.as_str()).collect();
            if SERVICES.iter().all(|s| services.contains(s)) && wanted.iter().all(|n| names.contains(n)) {
                return trace;
            }
            assert!(
                Instant::now() < deadline,
                "step {step}'s trace is incomplete after 30 s: services {services:?}, spans {names:?}"
            );
        } else {
            assert!(Instant::now() < deadline, "no `grpo step` span for run {run} step {step} in {received:#?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The chain of span names from `span` up to the root.
fn ancestry<'a>(trace: &'a [Span], span: &'a Span) -> Vec<&'a Span> {
    let by_id: BTreeMap<&str, &Span> = trace.iter().map(|s| (s.id.as_str(), s)).collect();
    let mut chain = vec![span];
    let mut current = span;
    while let Some(parent) = by_id.get(current.parent.as_str()) {
        chain.push(parent);
        current = parent;
        assert!(chain.len() <= trace.len(), "a parent cycle at {}", span.name);
    }
    chain
}

fn check_step_tree(trace: &[Span], run: &str, step: u64) {
    let summary: Vec<String> = trace.iter().map(|s| format!("{} [{}]", s.name, s.service)).collect();
    let ids: BTreeSet<&str> = trace.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids.len(), trace.len(), "span ids are unique: {summary:?}");
    let roots: Vec<&Span> = trace.iter().filter(|s| s.parent.is_empty() || s.parent == "0000000000000000").collect();
    assert_eq!(roots.len(), 1, "one root: {summary:?}");
    let root = roots[0];
    assert_eq!((root.name.as_str(), root.service.as_str()), ("grpo step", "keel-orchestrator"));
    assert_eq!(root.attributes.get("run_id").map(String::as_str), Some(run));
    assert!(root.attributes["sequences"].parse::<u64>().unwrap() >= 8, "{:?}", root.attributes);
    assert!(root.attributes["tokens"].parse::<u64>().unwrap() > 0, "{:?}", root.attributes);
    for span in trace {
        let chain = ancestry(trace, span);
        let top = chain.last().unwrap();
        assert_eq!(top.id, root.id, "{} [{}] does not reach the step span: {summary:?}", span.name, span.service);
    }
    // The parent links that cross a process boundary.
    let find = |name: &str| trace.iter().filter(move |s| s.name == name).collect::<Vec<_>>();
    let parent_of = |span: &Span| trace.iter().find(|s| s.id == span.parent).unwrap().clone();
    let names_above = |span: &Span| ancestry(trace, span).iter().map(|s| s.name.clone()).collect::<Vec<_>>();
    // (server span, its service, the phases it may run under)
    for (server, service, phases) in [
        ("generator.generate", "keel-generator", &["rollouts"][..]),
        ("reward.env_step", "keel-reward", &["rollouts"]),
        ("trainer.logprobs", "keel-trainer", &["policy_and_reference_logprobs"]),
        ("trainer.train", "keel-trainer", &["policy_training"]),
        ("trainer.export", "keel-trainer", &["weight_sync"]),
        ("trainer.save", "keel-trainer", &["checkpoint_save"]),
        ("generator.refit", "keel-generator", &["weight_sync"]),
    ] {
        let spans = find(server);
        assert!(!spans.is_empty(), "no {server} span: {summary:?}");
        let mut under_first = 0;
        for span in spans {
            assert_eq!(span.service, service);
            let parent = parent_of(span);
            assert_eq!(parent.service, "keel-orchestrator", "{server}'s parent is in the orchestrator");
            let above = names_above(span);
            assert!(phases.iter().any(|p| above.contains(&p.to_string())), "{server} under {phases:?}: {above:?}");
            under_first += usize::from(above.contains(&phases[0].to_string()));
        }
        assert!(under_first > 0, "some {server} span is under {}", phases[0]);
    }
    for span in find("trainer.train") {
        assert_eq!(span.attributes.get("run_id").map(String::as_str), Some(run), "{:?}", span.attributes);
    }
    let uploads: Vec<&Span> = trace.iter().filter(|s| s.service == "keel-checkpoint").collect();
    assert!(!uploads.is_empty(), "the checkpoint upload reached the checkpoint service: {summary:?}");
    for span in uploads {
        let above = names_above(span);
        assert!(above.contains(&"checkpoint_upload".to_string()), "{} under checkpoint_upload: {above:?}", span.name);
    }
    // Validation (every step here) is one span with its requests' summary, and none of their
    // own: no client span, and the services they reached made none.
    let validations = find("validation");
    assert_eq!(validations.len(), 1, "{summary:?}");
    let validation = validations[0];
    let requests: u64 = validation.attributes["requests"].parse().unwrap();
    assert!(requests >= 2, "a generate and a scoring request at least: {:?}", validation.attributes);
    assert_eq!(validation.attributes["failed_requests"], "0", "{:?}", validation.attributes);
    assert!(validation.attributes["request_seconds"].parse::<f64>().unwrap() > 0.0);
    for span in trace.iter().filter(|s| s.id != validation.id) {
        let above = names_above(span);
        assert!(
            !above.contains(&"validation".to_string()),
            "{} [{}] under validation: {above:?}",
            span.name,
            span.service
        );
    }
    let step_attr = root.attributes.get("step").cloned();
    assert_eq!(step_attr, Some(step.to_string()));
}

async fn metrics_text(http: &reqwest::Client, url: &str) -> String {
    let response = http.get(format!("{url}/metrics")).send().await.unwrap();
    assert_eq!(response.status(), 200, "{url}/metrics");
    let content_type = response.headers()["content-type"].to_str().unwrap().to_string();
    assert!(content_type.starts_with("text/plain"), "{url}/metrics: {content_type}");
    response.text().await.unwrap()
}

fn chromium() -> PathBuf {
    let found = ["/usr/bin/chromium", "/usr/bin/chromium-browser"].into_iter().map(PathBuf::from).find(|p| p.exists());
    found.expect("Debian's chromium is not installed: run scripts/setup")
}

/// Headless Chromium rendering a page for 15 s of virtual time (timers run at once; time
/// stands still while a request, an event stream included, is pending).
fn headless(profile: &Path) -> Command {
    let mut command = Command::new(chromium());
    command.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        "--hide-scrollbars",
        "--virtual-time-budget=15000",
    ]);
    command.arg(format!("--user-data-dir={}", profile.display()));
    command
}

/// The dashboard at `url` rendered in headless Chromium, once every fetch of its view has
/// been drawn without an error: its DOM.
fn dashboard_dom(profile: &Path, url: &str) -> String {
    let output = headless(profile).arg("--dump-dom").arg(url).output().unwrap();
    let dom = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(
        dom.contains("data-ready=\"true\""),
        "the dashboard did not finish loading {url}: {}\n{dom}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!dom.contains("data-error="), "the dashboard shows an error at {url}: {dom}");
    dom
}

/// The points drawn in the plot whose `data-plot` is `plot`.
fn plot_points(dom: &str, plot: &str) -> u64 {
    plot_attribute(dom, plot, "data-points").parse().unwrap()
}

/// The value of `attribute` on the element whose `data-plot` is `plot`.
fn plot_attribute(dom: &str, plot: &str, attribute: &str) -> String {
    let at = dom.find(&format!("data-plot=\"{plot}\"")).unwrap_or_else(|| panic!("no plot `{plot}` in the page"));
    let tag_start = dom[..at].rfind('<').unwrap();
    let tag_end = at + dom[at..].find('>').unwrap();
    let tag = &dom[tag_start..tag_end];
    let value = tag
        .split(&format!("{attribute}=\""))
        .nth(1)
        .unwrap_or_else(|| panic!("plot `{plot}` has no {attribute}: {tag}"));
    value.split('"').next().unwrap().to_string()
}

/// An MLflow tracking server from `.venv-mlflow` (made by scripts/setup) on a free port, its
/// store in `dir`; stopped when dropped.
struct MlflowServer {
    child: std::process::Child,
    url: String,
    http: reqwest::Client,
}

impl MlflowServer {
    async fn start(dir: &Path) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mlflow = keel_testkit::workspace_root().join(".venv-mlflow/bin/mlflow");
        assert!(mlflow.exists(), "{} is missing: run scripts/setup", mlflow.display());
        let log = std::fs::File::create(dir.join("mlflow-server.log")).unwrap();
        let store = format!("sqlite:///{}", dir.join("mlflow.db").display());
        // Its own process group: the server's workers are stopped with it.
        let child = Command::new(mlflow)
            .process_group(0)
            // No background job runner (a dozen worker processes this test does not use).
            .env("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
            .args(["server", "--host", "127.0.0.1", "--port", &port.to_string(), "--workers", "1"])
            .args(["--backend-store-uri", &store, "--default-artifact-root"])
            .arg(dir.join("mlflow-artifacts"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let server = Self { child, url: format!("http://127.0.0.1:{port}"), http: reqwest::Client::new() };
        let deadline = Instant::now() + Duration::from_secs(120);
        while !server.http.get(format!("{}/health", server.url)).send().await.is_ok_and(|r| r.status() == 200) {
            assert!(
                Instant::now() < deadline,
                "MLflow did not come up: see {}",
                dir.join("mlflow-server.log").display()
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        server
    }

    async fn api(&self, path: &str, body: Option<serde_json::Value>) -> serde_json::Value {
        let url = format!("{}/api/2.0/mlflow/{path}", self.url);
        let request = match body {
            Some(body) => self.http.post(url).json(&body),
            None => self.http.get(url),
        };
        request.send().await.unwrap().json().await.unwrap()
    }

    /// The id and status of the MLflow run tagged with Keel's `run`, once it has ended.
    async fn run_of(&self, run: &str) -> (String, String) {
        let experiment = self.api("experiments/get-by-name?experiment_name=keel-observed", None).await;
        let experiment =
            experiment["experiment"]["experiment_id"].as_str().expect("the experiment was made").to_string();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let filter = format!("tags.keel_run_id = '{run}'");
            let found = self.api("runs/search", Some(json!({"experiment_ids": [experiment], "filter": filter}))).await;
            let runs = found["runs"].as_array().cloned().unwrap_or_default();
            assert!(runs.len() <= 1, "one MLflow run per Keel run: {found}");
            if let Some(info) = runs.first().map(|r| &r["info"])
                && info["status"] != "RUNNING"
            {
                return (info["run_id"].as_str().unwrap().into(), info["status"].as_str().unwrap().into());
            }
            assert!(Instant::now() < deadline, "the MLflow run did not end: {found}");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    /// (step, value) of metric `key` in MLflow run `run`, by step.
    async fn history(&self, run: &str, key: &str) -> Vec<(u64, f64)> {
        let reply = self.api(&format!("metrics/get-history?run_id={run}&metric_key={key}"), None).await;
        let mut points: Vec<(u64, f64)> = reply["metrics"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|m| (m["step"].as_u64().unwrap(), m["value"].as_f64().unwrap()))
            .collect();
        points.sort_by_key(|p| p.0);
        points
    }
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        // The whole group at once: a graceful stop waits for its workers.
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_grpo_run_is_traced_measured_and_shown() {
    let (otlp, spans) = otlp_receiver().await;
    let logs = tempfile::tempdir().unwrap();
    let mlflow = MlflowServer::start(logs.path()).await;
    // The server is on 127.0.0.1: the operator names it as one runs may log to.
    let trusted = format!("[\"{}\"]", mlflow.url);
    let stack = Stack::start_with(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp),
        ("OTEL_BSP_SCHEDULE_DELAY", "200"),
        ("KEEL_ORCHESTRATOR__MLFLOW_TRACKING_URIS", &trusted),
    ]);
    let run = stack.submit(&observed_spec(&stack.model, logs.path(), &mlflow.url)).await;
    stack.wait_succeeded(&run, LIMIT).await;

    // MLflow has the run, finished, with every recorded metric at its steps (`pass@k` as
    // `pass_at_k`, which MLflow's names allow).
    let (mlflow_run, status) = mlflow.run_of(&run).await;
    assert_eq!(status, "FINISHED");
    for (name, key) in [
        ("train/loss", "train/loss"),
        ("validation/accuracy", "validation/accuracy"),
        ("validation/pass@1", "validation/pass_at_1"),
        ("timing/train/total_step_time", "timing/train/total_step_time"),
    ] {
        let recorded = stack.series(&run, name).await;
        assert!(!recorded.is_empty(), "{name} was recorded");
        let logged = mlflow.history(&mlflow_run, key).await;
        assert_eq!(logged.len(), recorded.len(), "{name}: {logged:?} vs {recorded:?}");
        for ((step, value), (recorded_step, recorded_value)) in logged.iter().zip(&recorded) {
            assert_eq!(step, recorded_step, "{name}");
            assert!((value - recorded_value).abs() <= 1e-9 * recorded_value.abs().max(1.0), "{name} at {step}");
        }
    }

    // TensorBoard's own reader finds every recorded metric, at the steps and values recorded.
    let events = logs.path().join(&run).join("tensorboard");
    let output = Command::new(keel_testkit::python())
        .arg(keel_testkit::workspace_root().join("tests/reference/tensorboard_scalars.py"))
        .arg(&events)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let scalars: BTreeMap<String, Vec<(u64, f64)>> = serde_json::from_slice(&output.stdout).unwrap();
    for name in ["train/loss", "train/reward", "validation/accuracy", "timing/train/total_step_time"] {
        let recorded = stack.series(&run, name).await;
        let logged = scalars.get(name).unwrap_or_else(|| panic!("no {name} in {:?}", scalars.keys()));
        assert_eq!(logged.len(), recorded.len(), "{name}: {logged:?} vs {recorded:?}");
        for ((step, value), (recorded_step, recorded_value)) in logged.iter().zip(&recorded) {
            assert_eq!(step, recorded_step, "{name}");
            let tolerance = 1e-6 * recorded_value.abs().max(1.0);
            assert!((value - recorded_value).abs() <= tolerance, "{name} at step {step}: {value} vs {recorded_value}");
        }
    }
    assert_eq!(scalars["validation/accuracy"][0].0, 0, "validation's baseline is step 0");

    // W&B's offline files, each record parsed with W&B's own protobuf definitions (the
    // framing's reader is first checked on a real offline run that wandb makes): the run
    // with its spec as config, a row per step holding every recorded metric, the exit.
    let offline = std::fs::read_dir(logs.path().join(&run).join("wandb"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("offline-run-"))
        .expect("an offline-run directory");
    let file = std::fs::read_dir(&offline)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "wandb"))
        .expect("a run-<id>.wandb file");
    let real = tempfile::tempdir().unwrap();
    let wandb_python = keel_testkit::workspace_root().join(".venv-wandb/bin/python");
    assert!(wandb_python.exists(), "{} is missing: run scripts/setup", wandb_python.display());
    let output = Command::new(wandb_python)
        .arg(keel_testkit::workspace_root().join("tests/reference/wandb_records.py"))
        .arg(&file)
        .arg("--real")
        .arg(real.path())
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let read: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(read["exit_code"], 0, "{read}");
    assert_eq!(read["run"]["project"], "keel-observed");
    assert_eq!(read["run"]["display_name"], "observed-grpo");
    assert_eq!(read["run"]["tags"], json!(["observed"]));
    assert_eq!(read["run"]["config"]["algorithm"]["value"], "grpo");
    let rows = read["history"].as_array().unwrap();
    let steps: Vec<u64> = rows.iter().map(|r| r[0].as_u64().unwrap()).collect();
    assert_eq!(steps, [0, 1, 2], "one row per step, validation's baseline first");
    for name in
        ["train/loss", "train/reward", "validation/accuracy", "validation/pass@1", "timing/train/total_step_time"]
    {
        let recorded = stack.series(&run, name).await;
        let logged: Vec<(u64, f64)> =
            rows.iter().filter_map(|r| r[1][name].as_f64().map(|v| (r[0].as_u64().unwrap(), v))).collect();
        assert_eq!(logged.len(), recorded.len(), "{name}: {logged:?} vs {recorded:?}");
        for ((step, value), (recorded_step, recorded_value)) in logged.iter().zip(&recorded) {
            assert_eq!(step, recorded_step, "{name}");
            assert!((value - recorded_value).abs() <= 1e-12 * recorded_value.abs().max(1.0), "{name} at {step}");
        }
    }

    // Traces: each step is its own tree across the five services.
    let first = step_trace(&spans, &run, 1).await;
    check_step_tree(&first, &run, 1);
    let second = step_trace(&spans, &run, 2).await;
    check_step_tree(&second, &run, 2);
    assert_ne!(first[0].trace, second[0].trace, "each step is its own trace");

    // Error spans say why: a claim the generator refuses (malformed), and every other error
    // span.
    let nats = async_nats::connect(keel_service::nats::default_url()).await.unwrap();
    let subject = keel_protocol::Subjects::new(&stack.prefix).unwrap().generator_claim();
    let reply = nats.request(subject, "{}".into()).await.unwrap();
    assert!(reply.payload.starts_with(b"{\"error\""), "{:?}", reply.payload);
    let deadline = Instant::now() + Duration::from_secs(30);
    let refused = loop {
        let received = spans.lock().unwrap().clone();
        let found = received.into_iter().find(|s| s.service == "keel-generator" && s.status.1.contains("malformed"));
        match found {
            Some(span) => break span,
            None if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(200)).await,
            None => panic!("no generator span for the malformed request"),
        }
    };
    assert_eq!((refused.name.as_str(), refused.status.0), ("generator.claim", 2), "{refused:?}");
    assert!(refused.status.1.starts_with("invalid_request: "), "{refused:?}");
    assert_eq!(refused.attributes.get("error.type").map(String::as_str), Some("invalid_request"), "{refused:?}");
    for span in spans.lock().unwrap().iter().filter(|s| s.status.0 == 2) {
        assert!(!span.status.1.is_empty(), "an error span without its error: {span:?}");
    }

    // Metrics: every service answers /metrics with what it served.
    let api = stack.api();
    let urls = [
        ("orchestrator", api.clone()),
        ("generator", stack.generator.url.clone()),
        ("reward", stack.reward.url.clone()),
        ("trainer", stack.trainer.url.clone()),
        ("checkpoint", stack.checkpoint.url.clone()),
    ];
    let mut texts = BTreeMap::new();
    for (service, url) in &urls {
        texts.insert(*service, metrics_text(&stack.http, url).await);
    }
    let expect = |service: &str, needle: &str| {
        assert!(texts[service].contains(needle), "{service}'s /metrics lacks `{needle}`:\n{}", texts[service]);
    };
    expect("orchestrator", "keel_runs{status=\"succeeded\"} 1");
    expect("orchestrator", "keel_step_phase_seconds_count{algorithm=\"grpo\",phase=\"generation\"} 2");
    expect(
        "orchestrator",
        "keel_http_request_duration_seconds_count{method=\"POST\",route=\"/v1/runs\",status=\"201\"} 1",
    );
    expect("generator", "keel_nats_request_duration_seconds_count{operation=\"generator.generate\",outcome=\"ok\"}");
    expect("generator", "keel_generator_");
    expect("reward", "keel_nats_request_duration_seconds_count{operation=\"reward.env_step\",outcome=\"ok\"}");
    expect("trainer", "keel_nats_request_duration_seconds_count{operation=\"trainer.train\",outcome=\"ok\"} 2");
    expect("trainer", "keel_trainer_claimed 0");
    expect("checkpoint", "keel_http_request_duration_seconds_count{method=\"POST\"");

    // The metrics reference names every metric this GRPO run recorded and every metric
    // family the services expose (docs/src/reference/metrics.md).
    let reference =
        std::fs::read_to_string(keel_testkit::workspace_root().join("docs/src/reference/metrics.md")).unwrap();
    let recorded = stack.get(&format!("/v1/runs/{run}/metrics")).await;
    let mut names: BTreeSet<String> = recorded["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|series| series["name"].as_str().unwrap().to_string())
        .collect();
    assert!(names.contains("train/loss") && names.contains("timing/train/total_step_time"), "{names:?}");
    for text in texts.values() {
        names.extend(
            text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).map(|l| l.split(' ').next().unwrap().to_string()),
        );
    }
    // `validation/pass@1` is documented as `validation/pass@<k>`.
    let documented = |name: &str| {
        reference.contains(&format!("`{name}`"))
            || name.split_once('@').is_some_and(|(head, k)| {
                k.chars().all(|c| c.is_ascii_digit()) && reference.contains(&format!("`{head}@<k>`"))
            })
    };
    let missing: Vec<&String> = names.iter().filter(|name| !documented(name)).collect();
    assert!(missing.is_empty(), "docs/src/reference/metrics.md does not name {missing:?}");

    // Health checks and scrapes make no spans (a compose stack's health checks would bury
    // the steps): after probes of every service, a traced request's span arrives and no
    // probe's or scrape's span came before it.
    for (_, url) in &urls {
        let health = stack.http.get(format!("{url}/healthz")).send().await.unwrap();
        assert!(health.status().is_success(), "{url}/healthz");
    }
    let listed = stack.http.get(format!("{api}/v1/runs?limit=1")).send().await.unwrap();
    assert!(listed.status().is_success());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !spans.lock().unwrap().iter().any(|s| s.name == "GET /v1/runs") {
        assert!(Instant::now() < deadline, "the span of GET /v1/runs did not arrive");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let probes: Vec<String> = spans
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.name.ends_with(" /healthz") || s.name.ends_with(" /metrics"))
        .map(|s| format!("{} {}", s.service, s.name))
        .collect();
    assert!(probes.is_empty(), "health checks and scrapes made spans: {probes:?}");

    // The dashboard, in headless Chromium: the run's plots have points, samples are listed.
    let page = format!("{api}/dashboard#/runs/{run}");
    let profile = tempfile::tempdir().unwrap();
    let dom = dashboard_dom(profile.path(), &page);
    for (plot, least) in [("reward", 2), ("loss", 2), ("validation", 3), ("step_time", 2)] {
        let points = plot_points(&dom, plot);
        assert!(points >= least, "plot `{plot}` has {points} points, wanted at least {least}");
    }
    let rows = dom.matches("class=\"sample-row\"").count();
    assert!(rows >= 8, "the sample browser shows {rows} rows");
    assert!(dom.contains("data-role=\"assistant\""), "a sample's turns are shown with their roles: {dom}");
    assert!(dom.contains(" generated"), "a sample's token counts are shown: {dom}");
    let runs_dom = dashboard_dom(profile.path(), &format!("{api}/dashboard"));
    assert!(runs_dom.contains(&format!("data-run-id=\"{run}\"")), "the runs list shows the run: {runs_dom}");
    assert!(runs_dom.contains("class=\"pick\""), "each run can be picked for comparison: {runs_dom}");
    assert!(runs_dom.contains("data-score=\"validation/accuracy\""), "the list shows validation accuracy: {runs_dom}");

    // The run page: its spec, duration, KL coefficient, and its checkpoints with a download
    // link that serves the checkpoint's files as a tar archive.
    assert!(dom.contains("data-spec=") && dom.contains("\"algorithm\": \"grpo\""), "the spec is shown");
    assert!(dom.contains("data-duration=\""), "the header has the run's duration");
    assert_eq!(plot_attribute(&dom, "kl", "data-kl"), "on", "β = 0.01");
    assert!(dom.contains("β = 0.01"), "the KL card says β");
    let download = dom
        .split("data-download=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("no checkpoint download link: {dom}"))
        .replace("&amp;", "&");
    assert!(dom.matches("class=\"checkpoint-row\"").count() >= 1, "checkpoints are listed");
    let archive = stack.http.get(format!("{api}{download}")).send().await.unwrap();
    assert_eq!(archive.status(), 200, "{download}");
    assert_eq!(archive.headers()["content-type"], "application/x-tar");
    assert!(archive.headers()["content-disposition"].to_str().unwrap().contains("observed-grpo-step"));
    let tar = archive.bytes().await.unwrap();
    assert!(tar.len() > 1024 && &tar[257..262] == b"ustar", "the download is a tar archive");
    let unknown = stack.http.get(format!("{api}/v1/runs/{run}/checkpoints/{}/archive", uuid::Uuid::new_v4())).send();
    assert_eq!(unknown.await.unwrap().status(), 404, "a checkpoint of no run is not found");

    // Plot settings from the address: wall time on x, smoothing (raw points still counted),
    // log scale; tokens on x.
    let shaped = format!("{api}/dashboard#/runs/{run}?x=time&smooth=0.6&log=1");
    let shaped_dom = dashboard_dom(profile.path(), &shaped);
    for plot in ["reward", "loss", "validation"] {
        assert_eq!(plot_attribute(&shaped_dom, plot, "data-x"), "time", "{plot}");
        assert_eq!(plot_attribute(&shaped_dom, plot, "data-smoothing"), "0.6", "{plot}");
        assert_eq!(plot_attribute(&shaped_dom, plot, "data-log"), "true", "{plot}");
    }
    assert_eq!(plot_attribute(&shaped_dom, "step_time", "data-log"), "false", "stacked plots stay linear");
    assert!(plot_points(&shaped_dom, "loss") >= 2, "the raw points are drawn under the smoothed line");
    let tokens = format!("{api}/dashboard#/runs/{run}?x=tokens");
    assert_eq!(plot_attribute(&dashboard_dom(profile.path(), &tokens), "reward", "data-x"), "tokens");

    // A second run without a KL penalty, followed live over its event stream, then both
    // runs overlaid.
    let mut plain = stack::grpo_spec(&json!({"path": stack.model}));
    plain["name"] = json!("kl-off");
    plain["training"]["loss"]["reference_policy_kl_penalty"] = json!(0.0);
    plain["max_num_steps"] = json!(4);
    let second = stack.submit(&plain).await;
    let live =
        headless(profile.path()).arg("--dump-dom").arg(format!("{api}/dashboard#/runs/{second}")).output().unwrap();
    let live_dom = String::from_utf8_lossy(&live.stdout).to_string();
    stack.wait_succeeded(&second, LIMIT).await;
    assert!(live_dom.contains("data-sse-opened=\"true\""), "the live run's page follows its event stream: {live_dom}");
    let heard = live_dom.split("data-sse-events=\"").nth(1).and_then(|r| r.split('"').next()).unwrap_or("0");
    assert!(heard.parse::<u64>().unwrap() >= 1, "step events were drawn as they came: {live_dom}");
    let off_dom = dashboard_dom(profile.path(), &format!("{api}/dashboard#/runs/{second}"));
    assert_eq!(plot_attribute(&off_dom, "kl", "data-kl"), "off", "β = 0");
    assert!(off_dom.contains("KL penalty off"), "the KL card says the penalty is off");
    let compare = format!("{api}/dashboard#/compare/{run},{second}?smooth=0.5");
    let compare_dom = dashboard_dom(profile.path(), &compare);
    for plot in ["reward", "loss", "validation"] {
        assert_eq!(plot_attribute(&compare_dom, plot, "data-runs"), "2", "{plot} overlays both runs");
    }
    let rewards = stack.series(&run, "train/reward").await.len() + stack.series(&second, "train/reward").await.len();
    assert_eq!(plot_points(&compare_dom, "reward") as usize, rewards, "both runs' rewards are drawn");

    let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard");
    std::fs::create_dir_all(&shots).unwrap();
    let shot = shots.join(format!("run-{run}.png"));
    let status = headless(profile.path())
        .arg(format!("--screenshot={}", shot.display()))
        .arg("--window-size=1400,2000")
        .arg(&page)
        .status()
        .unwrap();
    assert!(status.success());
    let png = std::fs::read(&shot).unwrap();
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "screenshot {} is not a page", shot.display());
    println!("dashboard screenshot: {}", shot.display());
    // Screenshots of the new views: smoothing and the overlay change what is drawn.
    for (name, url) in [("smoothed", &shaped), ("compare", &compare)] {
        let other = shots.join(format!("{name}-{run}.png"));
        let status = headless(profile.path())
            .arg(format!("--screenshot={}", other.display()))
            .arg("--window-size=1400,2000")
            .arg(url)
            .status()
            .unwrap();
        assert!(status.success());
        let drawn = std::fs::read(&other).unwrap();
        assert!(drawn.starts_with(b"\x89PNG") && drawn.len() > 10_000, "screenshot {} is not a page", other.display());
        assert_ne!(drawn, png, "the {name} view draws something else than the plain run page");
        println!("dashboard screenshot: {}", other.display());
    }
}
