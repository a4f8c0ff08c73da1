//! The fault suite: one GRPO run through the five services as processes, which reach NATS
//! and Postgres through proxies of the test's own (cutting a proxy is, to the services, the
//! server going away; the shared servers other tests use stay up). While the run trains,
//! each fault is made in turn — SIGKILL and restart of every service, the checkpoint store
//! down 10 s, the generator down 90 s (past the grace period: the run shows `waiting`), a
//! NATS restart, Postgres down 30 s, an orchestrator stopped (SIGSTOP) past its lease while
//! a second one takes the run over — and the run must end `succeeded` with `train/loss`
//! recorded at exactly steps 1..N and every checkpoint downloading with its checksums.
//! A table of faults, outages, the statuses seen and the time to recover is printed.

#![allow(clippy::unwrap_used)]

mod stack;

use std::time::{Duration, Instant};

use keel_client::checkpoint::CheckpointClient;
use keel_testkit::{Proxy, ServiceProcess};
use serde_json::{Value, json};
use stack::{Servers, Stack, grpo_spec};

const STEPS: u64 = 60;

#[derive(Debug, Clone, Copy)]
enum Fault {
    /// SIGKILL, then started again at once.
    Kill(&'static str),
    /// SIGKILL, started again after the outage.
    Down(&'static str, u64),
    KillOrchestrator,
    NatsRestart,
    PostgresDown(u64),
    /// SIGSTOP for this long while a second orchestrator runs, then SIGCONT.
    StallOrchestrator(u64),
}

impl Fault {
    fn name(self) -> String {
        match self {
            Self::Kill(service) => format!("SIGKILL + restart {service}"),
            Self::Down(service, s) => format!("{service} down {s} s"),
            Self::KillOrchestrator => "SIGKILL + restart orchestrator".into(),
            Self::NatsRestart => "NATS restart (3 s)".into(),
            Self::PostgresDown(s) => format!("Postgres down {s} s"),
            Self::StallOrchestrator(s) => format!("orchestrator stopped {s} s (lease 2 s)"),
        }
    }
}

/// The run as the API shows it, or None while the API cannot answer (Postgres is away).
async fn peek(stack: &Stack, id: &str) -> Option<Value> {
    let response = stack.http.get(format!("{}/v1/runs/{id}", stack.api())).send().await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    response.json().await.ok()
}

/// Every status the run is seen in while `wait` passes, polled each 200 ms.
async fn watch(stack: &Stack, id: &str, wait: Duration, seen: &mut Vec<String>) {
    let until = Instant::now() + wait;
    while Instant::now() < until {
        if let Some(run) = peek(stack, id).await {
            let status = run["status"].as_str().unwrap().to_string();
            assert!(!matches!(status.as_str(), "failed" | "cancelled" | "succeeded"), "the run ended mid-fault: {run}");
            if seen.last() != Some(&status) {
                seen.push(status);
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the run records a step after the fault (a step past the last one seen; a
/// resumed run first goes back to its checkpoint, which is not progress).
async fn recovered(stack: &Stack, id: &str, from: u64, seen: &mut Vec<String>) -> Duration {
    let started = Instant::now();
    let mut last = from;
    loop {
        assert!(started.elapsed() < Duration::from_secs(600), "the run did not recover in 10 minutes");
        if let Some(run) = peek(stack, id).await {
            let status = run["status"].as_str().unwrap().to_string();
            if seen.last() != Some(&status) {
                seen.push(status.clone());
            }
            let step = run["step"].as_u64().unwrap();
            if status == "succeeded" || step > last {
                return started.elapsed();
            }
            assert!(!matches!(status.as_str(), "failed" | "cancelled"), "the run ended: {run}");
            last = last.min(step);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The run's step once it has reached `at`.
async fn reach(stack: &Stack, id: &str, at: u64) -> u64 {
    loop {
        if let Some(run) = peek(stack, id).await {
            let step = run["step"].as_u64().unwrap();
            assert!(run["status"] != "succeeded", "the run finished before every fault was made: {run}");
            assert!(!matches!(run["status"].as_str(), Some("failed" | "cancelled")), "the run ended: {run}");
            if step >= at {
                return step;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_grpo_run_survives_every_fault_with_its_steps_contiguous() {
    let nats_addr = keel_service::nats::default_url().trim_start_matches("nats://").to_string();
    let nats = Proxy::start(nats_addr.parse().unwrap()).await.unwrap();
    let postgres = Proxy::start(keel_testkit::postgres_addr().parse().unwrap()).await.unwrap();
    let servers = Servers {
        nats_url: Some(format!("nats://{}", nats.addr)),
        postgres: Some(postgres.addr.to_string()),
        ..Servers::default()
    };
    let mut stack = Stack::start_on(
        &[
            // Each kill of a trainer or an orchestrator is an attempt (the run's own failure,
            // or a start after its driver vanished); this run is meant to survive them all.
            ("KEEL_ORCHESTRATOR__MAX_ATTEMPTS", "20"),
            ("KEEL_ORCHESTRATOR__DEPENDENCY_GRACE_SECONDS", "5"),
        ],
        &servers,
    );
    let mut spec = grpo_spec(&json!({"path": stack.model}));
    spec["max_num_steps"] = json!(STEPS);
    spec["data"]["train"]["size"] = json!(512);
    spec["checkpointing"] = json!({"save_period": 2});
    spec["validation"]["period"] = json!(0);
    let id = stack.submit(&spec).await;

    let faults = [
        Fault::Kill("trainer"),
        Fault::Kill("generator"),
        Fault::Kill("reward"),
        Fault::Kill("checkpoint"),
        Fault::KillOrchestrator,
        Fault::Down("checkpoint", 10),
        Fault::Down("generator", 90),
        Fault::NatsRestart,
        Fault::PostgresDown(30),
        Fault::StallOrchestrator(8),
    ];
    let mut table = Vec::new();
    let mut second_orchestrator: Option<ServiceProcess> = None;
    let mut at = 2;
    for fault in faults {
        let step = reach(&stack, &id, at).await;
        let mut seen = Vec::new();
        let started = Instant::now();
        match fault {
            Fault::Kill(service) => {
                stack.process(service).kill();
                stack.start_again(service);
            }
            Fault::Down(service, seconds) => {
                stack.process(service).kill();
                watch(&stack, &id, Duration::from_secs(seconds), &mut seen).await;
                stack.start_again(service);
            }
            Fault::KillOrchestrator => {
                stack.orchestrator.as_mut().unwrap().kill();
                stack.start_orchestrator();
            }
            Fault::NatsRestart => {
                nats.cut();
                tokio::time::sleep(Duration::from_secs(3)).await;
                nats.restore();
            }
            Fault::PostgresDown(seconds) => {
                postgres.cut();
                watch(&stack, &id, Duration::from_secs(seconds), &mut seen).await;
                postgres.restore();
            }
            Fault::StallOrchestrator(seconds) => {
                let env = stack.orchestrator_env();
                let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                second_orchestrator = Some(ServiceProcess::start("orchestrator", &env));
                let stalled = stack.orchestrator.as_ref().unwrap();
                stalled.signal("STOP");
                tokio::time::sleep(Duration::from_secs(seconds)).await;
                stalled.signal("CONT");
            }
        }
        let outage = started.elapsed();
        let recover = recovered(&stack, &id, step, &mut seen).await;
        eprintln!("fault done: {} at step {step}: {seen:?}, recovered in {:.1} s", fault.name(), recover.as_secs_f64());
        if let Fault::Down("generator", _) = fault {
            assert!(seen.iter().any(|s| s == "waiting"), "a 90 s outage past a 5 s grace shows `waiting`: {seen:?}");
        }
        table.push((fault.name(), step, outage, seen, recover));
        let now = peek(&stack, &id).await.and_then(|run| run["step"].as_u64()).unwrap_or(step);
        at = now + 2;
    }

    let run = stack.wait_succeeded(&id, Duration::from_secs(600)).await;
    assert_eq!(run["step"], STEPS);
    let losses = stack.series(&id, "train/loss").await;
    let steps: Vec<u64> = losses.iter().map(|(step, _)| *step).collect();
    assert_eq!(steps, (1..=STEPS).collect::<Vec<_>>(), "train/loss at exactly 1..{STEPS}");
    let checkpoints = CheckpointClient::new(&stack.checkpoint.url).list(&id).await.unwrap();
    let saved: Vec<u64> = checkpoints.iter().map(|c| c.step).collect();
    assert_eq!(saved, (1..=STEPS / 2).map(|k| 2 * k).collect::<Vec<_>>(), "a checkpoint every 2 steps");
    let scratch = tempfile::tempdir().unwrap();
    for checkpoint in &checkpoints {
        let out = scratch.path().join(checkpoint.id.to_string());
        CheckpointClient::new(&stack.checkpoint.url).download_dir(checkpoint.id, &out).await.unwrap();
    }

    eprintln!("\n| fault | at step | outage (s) | run status seen | time to recover (s) |");
    eprintln!("|---|---|---|---|---|");
    for (name, step, outage, seen, recover) in &table {
        eprintln!(
            "| {name} | {step} | {:.1} | {} | {:.1} |",
            outage.as_secs_f64(),
            seen.join(" → "),
            recover.as_secs_f64()
        );
    }
    eprintln!("\nrun succeeded: {STEPS} steps, train/loss at 1..{STEPS}, {} checkpoints verified", checkpoints.len());
    drop(second_orchestrator);
}
