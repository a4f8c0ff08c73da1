//! A run waits for what it needs instead of failing: a queue-group request that finds nobody
//! serving the group is retried with backoff until a replica appears (within the patience),
//! without spending the retries meant for lost work; past the patience it fails, unless a
//! run watches it — then the run shows `waiting` and the call goes on until the group is
//! back or the run is cancelled.

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
    let subject = nats.subjects.generate("r1");
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
    let error = nats.call_group::<_, Value>(nats.subjects.generate("r1"), &json!({})).await.unwrap_err();
    assert!(matches!(error, CallError::Absent { .. }), "{error}");
    assert!(started.elapsed() >= Duration::from_secs(1), "it kept trying for its patience");
}

/// A run's calls report a wait past the grace period (the run shows `waiting` with the
/// reason), go on waiting for as long as the group is away, and end the wait when a replica
/// answers; a run cancelled meanwhile stops waiting.
#[tokio::test(flavor = "multi_thread")]
async fn past_the_grace_period_a_run_waits_until_a_replica_appears_or_it_is_cancelled() {
    use keel_orchestrator::driver::{StopFlag, Waits};
    let stop = StopFlag::default();
    let waits = std::sync::Arc::new(Waits::new(stop.clone()));
    let mut nats = nats(Duration::from_millis(300)).await;
    nats.patience = nats.patience.watched_by(waits.clone());
    let subject = nats.subjects.generate("r1");
    let call = {
        let (nats, subject) = (nats.clone(), subject.clone());
        tokio::spawn(async move { nats.call_group::<_, Value>(subject, &json!({})).await })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while waits.reason().is_none() {
        assert!(Instant::now() < deadline, "the wait was never reported");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reason = waits.reason().unwrap();
    assert!(reason.contains(&subject) && reason.contains("nobody serves it"), "{reason}");
    // Well past the grace period, still waiting.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!call.is_finished(), "the call gave up");
    let mut requests = nats.client.queue_subscribe(subject.clone(), "generator".into()).await.unwrap();
    nats.client.flush().await.unwrap();
    let message = requests.next().await.unwrap();
    nats.client.publish(message.reply.unwrap(), json!({"ok": {"answer": 42}}).to_string().into()).await.unwrap();
    assert_eq!(call.await.unwrap().unwrap()["answer"], 42);
    assert_eq!(waits.reason(), None, "the wait ended with the answer");
    drop(requests);

    let cancelled = {
        let nats = nats.clone();
        let subject = nats.subjects.reward_env_step();
        tokio::spawn(async move { nats.call_group::<_, Value>(subject, &json!({})).await })
    };
    while waits.reason().is_none() {
        assert!(Instant::now() < deadline + Duration::from_secs(20), "the second wait was never reported");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.set_cancelled();
    let error = tokio::time::timeout(Duration::from_secs(15), cancelled).await.unwrap().unwrap().unwrap_err();
    assert!(matches!(error, CallError::Absent { .. }), "{error}");
    assert_eq!(waits.reason(), None);
}
