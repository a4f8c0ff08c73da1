//! Every service binary starts from its configuration, answers `GET /healthz`, refuses a
//! bad configuration with one line, and stops cleanly on SIGTERM.

#![allow(clippy::unwrap_used)]

use std::process::Command;

use keel_testkit::{ServiceProcess, binary};

const SERVICES: [&str; 5] = ["orchestrator", "trainer", "generator", "reward", "checkpoint"];

#[tokio::test]
async fn all_services_answer_healthz_and_stop_on_sigterm() {
    let client = reqwest::Client::new();
    let running: Vec<(&str, ServiceProcess)> = SERVICES.iter().map(|s| (*s, ServiceProcess::start(s, &[]))).collect();
    for (service, process) in &running {
        let response = client.get(format!("{}/healthz", process.url)).send().await.expect("GET /healthz");
        assert_eq!(response.status(), 200, "{service}");
        let body: serde_json::Value = response.json().await.expect("JSON body");
        assert_eq!(body["status"], "ok");
        assert_eq!(body["service"], *service);

        let missing = client.get(format!("{}/v0/nothing", process.url)).send().await.expect("GET unknown route");
        assert_eq!(missing.status(), 404);
        let body: serde_json::Value = missing.json().await.expect("JSON error body");
        assert_eq!(body["error"]["type"], "not_found");
    }
    for (service, process) in running {
        let status = process.terminate();
        assert!(status.success(), "keel-{service} exited with {status} on SIGTERM");
    }
}

#[test]
fn bad_configuration_stops_a_service_with_one_line() {
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a [&'a str], &'a str);
    let cases: [Case<'_>; 3] = [
        ("trainer", &[("KEEL_TRAINER__LISTEN", "not-an-address")], &[], "listen"),
        ("generator", &[("KEEL_GENERATOR__MODLE", "x")], &[], "modle"),
        ("reward", &[], &["--config", "/nonexistent/reward.yaml"], "/nonexistent/reward.yaml"),
    ];
    for (service, env, args, needle) in cases {
        let out = Command::new(binary(&format!("keel-{service}")))
            .envs(env.iter().copied())
            .args(args)
            .output()
            .expect("run service");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "keel-{service}: {stderr}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "one line expected: {stderr}");
        assert!(
            lines[0].starts_with(&format!("keel-{service}: ")) && lines[0].to_lowercase().contains(needle),
            "{stderr}"
        );
    }
}

/// A service listening beyond loopback with a token that has been published as an example
/// (a value Keel's Compose file once shipped) refuses to start, naming the setting; on
/// loopback, or with a token of the user's own, it starts.
#[test]
fn a_published_token_beyond_loopback_stops_the_service() {
    let token_env = [
        ("orchestrator", "KEEL_API_TOKEN", "keel-local-api-token", "api_token"),
        ("trainer", "KEEL_TRAINER_TOKEN", "keel-local-trainer-token", "api_token"),
        ("generator", "KEEL_GENERATOR_API_KEY", "keel-local-generator-key", "api_key"),
        ("reward", "KEEL_REWARD_TOKEN", "keel-local-reward-token", "api_token"),
        ("checkpoint", "KEEL_CHECKPOINT_TOKEN", "keel-local-checkpoint-token", "api_token"),
    ];
    for (service, var, published, field) in token_env {
        let check = |listen: &str, token: &str| {
            Command::new(binary(&format!("keel-{service}")))
                .arg("--check-config")
                .env(format!("KEEL_{}__LISTEN", service.to_uppercase()), listen)
                .env(var, token)
                .output()
                .expect("run service")
        };
        let out = check("0.0.0.0:8080", published);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "keel-{service} starts on 0.0.0.0 with {published}: {stderr}");
        assert!(stderr.contains(field) && stderr.contains("scripts/make-secrets"), "keel-{service}: {stderr}");
        assert!(check("127.0.0.1:8080", published).status.success(), "keel-{service} on loopback");
        assert!(check("0.0.0.0:8080", "Kq9d2f7a1c0e4b8d6").status.success(), "keel-{service} with its own token");
    }
}

/// SIGTERM stops the orchestrator while a client holds a run's event stream open (a stream
/// never ends by itself, and a graceful stop used to wait for it for ever): the stream is
/// closed after the stated grace and the process exits 0. The bound here is a hang check,
/// far above the grace.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_stops_the_orchestrator_with_an_event_stream_open() {
    use futures::StreamExt;
    let database = keel_testkit::TestDatabase::new("keel_sigterm");
    let process = ServiceProcess::start("orchestrator", &[("KEEL_ORCHESTRATOR__DATABASE_URL", &database.url)]);
    let http = reqwest::Client::new();
    let model = tempfile::tempdir().unwrap();
    std::fs::write(model.path().join("config.json"), "{}").unwrap();
    let spec = serde_json::json!({"algorithm": "eval", "model": {"path": model.path()},
                                  "data": {"train": {"kind": "arithmetic", "size": 4}},
                                  "environments": {"default": {"name": "math"}}});
    let created = http.post(format!("{}/v1/runs", process.url)).json(&spec).send().await.unwrap();
    assert_eq!(created.status(), 201, "{}", created.text().await.unwrap());
    let run: serde_json::Value = created.json().await.unwrap();
    let events =
        http.get(format!("{}/v1/runs/{}/events", process.url, run["id"].as_str().unwrap())).send().await.unwrap();
    assert_eq!(events.status(), 200);
    let mut stream = events.bytes_stream();
    assert!(stream.next().await.is_some(), "the stream sends the run's status first");

    let (done, exited) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(process.terminate());
    });
    let status = exited
        .recv_timeout(std::time::Duration::from_secs(keel_service::http::SHUTDOWN_GRACE.as_secs() + 50))
        .expect("keel-orchestrator still runs after SIGTERM with an event stream open");
    assert!(status.success(), "keel-orchestrator exited with {status}");
    // The stream ended with the process (it was not left hanging on the client's side).
    while let Some(chunk) = stream.next().await {
        if chunk.is_err() {
            break;
        }
    }
}

/// A NATS server (with JetStream) of the test's own on a free port, killed when dropped.
struct OwnNats {
    child: std::process::Child,
    url: String,
    /// JetStream's store, removed when dropped.
    _store: tempfile::TempDir,
}

impl OwnNats {
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let store = tempfile::tempdir().unwrap();
        let binary = ["/usr/sbin/nats-server", "/usr/bin/nats-server"]
            .into_iter()
            .find(|p| std::path::Path::new(p).is_file())
            .unwrap_or("nats-server");
        let child = Command::new(binary)
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(store.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start nats-server (Debian's nats-server package, as set-up installs)");
        let url = format!("nats://127.0.0.1:{port}");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(std::time::Instant::now() < deadline, "nats-server did not start");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Self { child, url, _store: store }
    }
}

impl Drop for OwnNats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The reward service, connected to a NATS that has since gone away, still stops on
/// SIGTERM (it waited for ever to unsubscribe and flush).
#[test]
fn services_stop_on_sigterm_after_nats_went_away() {
    let nats = OwnNats::start();
    let env = [("KEEL_NATS_URL", nats.url.as_str())];
    let running: Vec<(&str, ServiceProcess)> =
        ["reward"].iter().map(|s| (*s, ServiceProcess::start(s, &env))).collect();
    drop(nats);
    for (service, process) in running {
        let status = process.terminate();
        assert!(status.success(), "keel-{service} exited with {status} on SIGTERM without NATS");
    }
}
