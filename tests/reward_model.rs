//! The `reward_model` environment end to end: a trainer process with a Bradley–Terry model
//! loaded for a run, and the reward service as a process scoring through it over NATS. The
//! rewards the reward service answers are the trainer's own scores for the same token ids.

#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::{Duration, Instant};

use keel_testkit::{ServiceProcess, binary, workspace_root};
use serde_json::{Value, json};

struct Nats {
    client: async_nats::Client,
    prefix: String,
}

impl Nats {
    /// Asks `<prefix>.<suffix>` until someone answers (a process subscribes after it starts).
    async fn ask(&self, suffix: &str, body: Value) -> Value {
        let subject = format!("{}.{suffix}", self.prefix);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let request = self.client.request(subject.clone(), body.to_string().into());
            match tokio::time::timeout(Duration::from_secs(30), request).await {
                Ok(Ok(message)) => return serde_json::from_slice(&message.payload).unwrap(),
                _ if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(100)).await,
                other => panic!("no answer on {subject}: {other:?}"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn reward_model_rewards_are_the_trainers_scores() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    let corpus = workspace_root().join("examples/tokenizer-corpus.txt");
    let init = Command::new(binary("keel"))
        .args(["model", "init", "--arch", "qwen3", "--preset", "tiny", "--train-tokenizer"])
        .arg(&corpus)
        .arg("--out")
        .arg(&model)
        .output()
        .unwrap();
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));

    let prefix = format!("e2e.{}", uuid::Uuid::new_v4().simple());
    let worker = "rm-worker";
    let _trainer = ServiceProcess::start(
        "trainer",
        &[("KEEL_TRAINER__SUBJECT_PREFIX", &prefix), ("KEEL_TRAINER__WORKER_ID", worker)],
    );
    let reward = ServiceProcess::start("reward", &[("KEEL_REWARD__SUBJECT_PREFIX", &prefix)]);
    let nats = Nats { client: async_nats::connect("127.0.0.1:4222").await.unwrap(), prefix };

    let run = json!({"run_id": "rm-run"});
    let claimed = nats.ask(&format!("trainer.{worker}.claim"), run.clone()).await;
    assert!(claimed.get("ok").is_some(), "{claimed}");
    let load = json!({
        "run_id": "rm-run",
        "policy": {"path": model},
        "training": {"loss": {"type": "bradley_terry"}, "global_batch_size": 2, "micro_batch_size": 2},
    });
    let loaded = nats.ask(&format!("trainer.{worker}.load"), load).await;
    assert_eq!(loaded["ok"]["has_value_head"], true, "{loaded}");

    let ids = [vec![5, 6, 7, 8], vec![9, 10], vec![11, 12, 13, 14, 15, 16]];
    let direct = nats
        .ask(&format!("trainer.{worker}.score"), json!({"run_id": "rm-run", "batch": {"inline": {"input_ids": ids}}}))
        .await;
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
