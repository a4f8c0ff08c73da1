//! Keel's clients wait out a service that is briefly gone: the checkpoint store started
//! seconds after a call begins still answers it, and without patience the same call fails
//! at once with a clear error.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use keel_client::checkpoint::CheckpointClient;
use keel_client::retry::Patience;
use keel_testkit::{ServiceProcess, TestDatabase};

#[tokio::test(flavor = "multi_thread")]
async fn a_checkpoint_store_that_comes_up_late_is_waited_for() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}");
    let impatient = CheckpointClient::new(&url).list("r1").await.unwrap_err().to_string();
    assert!(impatient.contains("cannot reach the service"), "{impatient}");

    let client = CheckpointClient::new(&url).with_patience(Patience::new(Duration::from_secs(60)));
    let started = Instant::now();
    let call = tokio::spawn(async move { client.list("r1").await });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let dir = tempfile::tempdir().unwrap();
    let database = TestDatabase::new("keel_e2e_deps");
    let listen = format!("127.0.0.1:{port}");
    let _store = ServiceProcess::start(
        "checkpoint",
        &[
            ("KEEL_CHECKPOINT__LISTEN", listen.as_str()),
            ("KEEL_CHECKPOINT__DATABASE_URL", &database.url),
            ("KEEL_CHECKPOINT__STORAGE__KIND", "local"),
            ("KEEL_CHECKPOINT__STORAGE__ROOT", dir.path().to_str().unwrap()),
            ("KEEL_CHECKPOINT__NATS_URL", ""),
        ],
    );
    let listed = call.await.unwrap().unwrap();
    assert!(listed.is_empty());
    assert!(started.elapsed() >= Duration::from_millis(1500), "the call waited for the store");
}

/// With a token, the checkpoint store answers only requests that carry it (deleting a
/// checkpoint or leasing one included); `/healthz` stays open for health checks.
#[tokio::test(flavor = "multi_thread")]
async fn a_checkpoint_store_with_a_token_refuses_requests_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let database = TestDatabase::new("keel_e2e_token");
    let store = ServiceProcess::start(
        "checkpoint",
        &[
            ("KEEL_CHECKPOINT__DATABASE_URL", &database.url),
            ("KEEL_CHECKPOINT__STORAGE__KIND", "local"),
            ("KEEL_CHECKPOINT__STORAGE__ROOT", dir.path().to_str().unwrap()),
            ("KEEL_CHECKPOINT__NATS_URL", ""),
            ("KEEL_CHECKPOINT__API_TOKEN", "t0ken"),
        ],
    );
    let error = CheckpointClient::new(&store.url).list("r1").await.unwrap_err().to_string();
    assert!(error.contains("401") && error.contains("Bearer"), "{error}");
    let wrong = CheckpointClient::new(&store.url).with_token(Some("guess")).list("r1").await.unwrap_err().to_string();
    assert!(wrong.contains("401"), "{wrong}");
    assert!(CheckpointClient::new(&store.url).with_token(Some("t0ken")).list("r1").await.unwrap().is_empty());
    let http = reqwest::Client::new();
    let id = uuid::Uuid::new_v4();
    let delete = http.delete(format!("{}/v1/checkpoints/{id}", store.url)).send().await.unwrap();
    assert_eq!(delete.status(), 401);
    let lease = http
        .post(format!("{}/v1/checkpoints/{id}/leases", store.url))
        .json(&serde_json::json!({"holder": "me", "seconds": 604800}))
        .send()
        .await
        .unwrap();
    assert_eq!(lease.status(), 401);
    assert_eq!(http.get(format!("{}/healthz", store.url)).send().await.unwrap().status(), 200);
}
