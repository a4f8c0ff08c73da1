//! The `reward_model` environment end to end: a trainer process with a Bradley–Terry model
//! loaded for a run, and the reward service as a process scoring through it over NATS. The
//! rewards the reward service answers are the trainer's own scores for the same token ids.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use keel_protocol::Subjects;
use keel_protocol::subjects::TrainerOp;
use keel_testkit::{ServiceProcess, keel_model_init};
use serde_json::{Value, json};

/// Asks `subject` until someone answers: the worker subscribes after it starts listening, and
/// a claim is safe to repeat (the same run renews it).
async fn ask_until_answered(client: &async_nats::Client, subject: String, body: Value) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match client.request(subject.clone(), body.to_string().into()).await {
            Ok(message) => return serde_json::from_slice(&message.payload).unwrap(),
            Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => panic!("no answer on {subject}: {e}"),
        }
    }
}

/// Asks once (for requests that must not be repeated), with room for a slow model load.
async fn ask(client: &async_nats::Client, subject: String, body: Value) -> Value {
    let request = client.request(subject.clone(), body.to_string().into());
    let message = tokio::time::timeout(Duration::from_secs(120), request).await.unwrap().unwrap();
    serde_json::from_slice(&message.payload).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn reward_model_rewards_are_the_trainers_scores() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    keel_model_init(&model);

    let prefix = format!("e2e.{}", uuid::Uuid::new_v4().simple());
    let worker = "rm-worker";
    let _trainer = ServiceProcess::start(
        "trainer",
        &[("KEEL_TRAINER__SUBJECT_PREFIX", &prefix), ("KEEL_TRAINER__WORKER_ID", worker)],
    );
    let reward = ServiceProcess::start("reward", &[("KEEL_REWARD__SUBJECT_PREFIX", &prefix)]);
    let client = keel_service::nats::connect(&keel_service::nats::default_url()).await.unwrap();
    let subjects = Subjects::new(&prefix).unwrap();
    let op = |op| subjects.trainer(worker, op);

    let claimed = ask_until_answered(&client, op(TrainerOp::Claim), json!({"run_id": "rm-run"})).await;
    assert!(claimed.get("ok").is_some(), "{claimed}");
    let load = json!({
        "run_id": "rm-run",
        "policy": {"path": model},
        "training": {"loss": {"type": "bradley_terry"}, "global_batch_size": 2, "micro_batch_size": 2},
    });
    let loaded = ask(&client, op(TrainerOp::Load), load).await;
    assert_eq!(loaded["ok"]["has_value_head"], true, "{loaded}");

    let ids = [vec![5, 6, 7, 8], vec![9, 10], vec![11, 12, 13, 14, 15, 16]];
    let score = json!({"run_id": "rm-run", "batch": {"inline": {"input_ids": ids}}});
    let direct = ask(&client, op(TrainerOp::Score), score).await;
    let expected: Vec<f64> = direct["ok"]["scores"].as_array().unwrap().iter().map(|s| s.as_f64().unwrap()).collect();

    let samples: Vec<Value> = ids
        .iter()
        .map(|ids| json!({"prompt": "p", "completion": "c", "token_ids": ids}))
        .chain([json!({"completion": "no ids"})])
        .collect();
    let body = json!({"env": {"name": "reward_model", "worker_id": worker, "run_id": "rm-run"}, "samples": samples});
    let response = reqwest::Client::new().post(format!("{}/v1/score", reward.url)).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let reply: Value = response.json().await.unwrap();
    let results = reply["results"].as_array().unwrap();
    for (i, want) in expected.iter().enumerate() {
        let got = results[i]["reward"].as_f64().unwrap();
        assert!((got - want).abs() < 1e-6, "sample {i}: {got} vs the trainer's {want}");
    }
    assert_eq!(results[3]["error"]["type"], "invalid_sample", "{reply}");
    assert!(results[3]["error"]["message"].as_str().unwrap().contains("token_ids"));

    // A run that does not hold the worker gets the trainer's refusal on every sample.
    let body =
        json!({"env": {"name": "reward_model", "worker_id": worker, "run_id": "other-run"}, "samples": [samples[0]]});
    let reply: Value = reqwest::Client::new()
        .post(format!("{}/v1/score", reward.url))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(reply["results"][0]["error"]["type"], "trainer", "{reply}");
    assert!(reply["results"][0]["error"]["message"].as_str().unwrap().contains("wrong_run"), "{reply}");
}
