//! A run waits for what it needs instead of failing: a queue-group request that finds nobody
//! serving the group is retried with backoff until a replica appears (within the patience),
//! without spending the retries meant for lost work; past the patience it fails.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use futures::StreamExt;
use keel_client::retry::Patience;
use keel_orchestrator::clients::{CallError, Nats};
use keel_protocol::Subjects;
use serde_json::{Value, json};

async fn nats(patience: Duration) -> Nats {
    let client = keel_service::nats::connect(&keel_service::nats::default_url()).await.unwrap();
    let bulk = keel_service::nats::Bulk::open(client.clone(), "keel-test-bulk").await.unwrap();
    Nats {
        client,
        subjects: Subjects::new(&format!("keeltest.deps{}", uuid::Uuid::new_v4().simple())).unwrap(),
        bulk,
        timeout: Duration::from_secs(5),
        retries: 0,
        patience: Patience::new(patience),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_group_nobody_serves_is_waited_for_until_a_replica_appears() {
    let nats = nats(Duration::from_secs(30)).await;
    let subject = nats.subjects.generate();
    let late = {
        let (client, subject) = (nats.client.clone(), subject.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let mut requests = client.queue_subscribe(subject, "generator".into()).await.unwrap();
            client.flush().await.unwrap();
            let message = requests.next().await.unwrap();
            let reply = json!({"ok": {"answer": 42}}).to_string();
            client.publish(message.reply.unwrap(), reply.into()).await.unwrap();
            client.flush().await.unwrap();
        })
    };
    let started = Instant::now();
    let reply: Value = nats.call_group(subject, &json!({"question": true})).await.unwrap();
    assert_eq!(reply["answer"], 42);
    assert!(started.elapsed() >= Duration::from_millis(1500), "it waited for the replica");
    late.await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn past_its_patience_a_request_to_an_absent_group_fails() {
    let nats = nats(Duration::from_secs(1)).await;
    let started = Instant::now();
    let error = nats.call_group::<_, Value>(nats.subjects.generate(), &json!({})).await.unwrap_err();
    assert!(matches!(error, CallError::Absent { .. }), "{error}");
    assert!(started.elapsed() >= Duration::from_secs(1), "it kept trying for its patience");
}
