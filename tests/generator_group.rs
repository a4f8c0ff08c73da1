//! A generator whose two tensor-parallel ranks are processes of their own (a generator
//! group), against one generator process with the whole model: the same greedy completions
//! and logprobs, and the same echoed prompt logprobs. A rank killed ends the group: the leader exits with an error instead of
//! hanging; started again once every rank is back, the group serves the same completions.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use keel_testkit::{ServiceProcess, keel_model_init};
use serde_json::{Value, json};

/// Rank `rank` of the generator group under `prefix` (the leader serves `model`).
fn start_rank(prefix: &str, rank: usize, model: &str) -> ServiceProcess {
    let rank_text = rank.to_string();
    let mut env = vec![
        ("KEEL_GENERATOR__SUBJECT_PREFIX", prefix),
        ("KEEL_GENERATOR__GROUP__NAME", "pair"),
        ("KEEL_GENERATOR__GROUP__RANK", rank_text.as_str()),
        ("KEEL_GENERATOR__GROUP__SIZE", "2"),
        ("KEEL_GENERATOR__GROUP__TIMEOUT_SECONDS", "30"),
    ];
    if rank == 0 {
        env.push(("KEEL_GENERATOR__MODEL", model));
    }
    ServiceProcess::start("generator", &env)
}

/// Greedy completions of a few prompts at once (the ranks batch them): their tokens and
/// logprobs.
async fn complete(http: &reqwest::Client, server: &ServiceProcess) -> Vec<(Vec<i64>, Vec<f64>)> {
    let prompts = ["The sum of", "A model that", "In the beginning the ranks"];
    let requests = prompts.iter().map(|prompt| {
        let body = json!({"model": "model", "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": true, "return_token_ids": true, "logprobs": 0});
        http.post(format!("{}/v1/completions", server.url)).json(&body).send()
    });
    let mut out = Vec::new();
    for response in futures::future::join_all(requests).await {
        let body: Value = response.unwrap().error_for_status().unwrap().json().await.unwrap();
        let choice = &body["choices"][0];
        let tokens: Vec<i64> = serde_json::from_value(choice["token_ids"].clone()).unwrap();
        let logprobs: Vec<f64> = serde_json::from_value(choice["logprobs"]["token_logprobs"].clone()).unwrap();
        assert_eq!(tokens.len(), 16, "{body}");
        out.push((tokens, logprobs));
    }
    // A prompt scored by echo (lm-eval's loglikelihood request): every rank runs the pass.
    let body = json!({"model": "model", "prompt": prompts[2], "max_tokens": 0, "echo": true, "logprobs": 1});
    let response = http.post(format!("{}/v1/completions", server.url)).json(&body).send().await.unwrap();
    let body: Value = response.error_for_status().unwrap().json().await.unwrap();
    let scored = body["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap()[1..].to_vec();
    out.push((Vec::new(), serde_json::from_value(Value::Array(scored)).unwrap()));
    out
}

fn assert_same(got: &[(Vec<i64>, Vec<f64>)], want: &[(Vec<i64>, Vec<f64>)], what: &str) {
    for ((tokens, logprobs), (want_tokens, want_logprobs)) in got.iter().zip(want) {
        assert_eq!(tokens, want_tokens, "{what}: the group's greedy tokens");
        let diff = logprobs.iter().zip(want_logprobs).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(diff <= 1e-4, "{what}: logprobs differ by {diff:e}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_generator_group_of_two_processes_serves_like_one_and_a_killed_rank_ends_it() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    keel_model_init(&model);
    let model = model.to_str().unwrap();
    let prefix = format!("e2e.{}", uuid::Uuid::new_v4().simple());
    let http = reqwest::Client::new();

    let alone = ServiceProcess::start(
        "generator",
        &[("KEEL_GENERATOR__SUBJECT_PREFIX", &format!("{prefix}.alone")), ("KEEL_GENERATOR__MODEL", model)],
    );
    let want = complete(&http, &alone).await;
    drop(alone);

    // The follower first: the leader listens only once every rank has loaded.
    let mut follower = start_rank(&prefix, 1, "");
    let mut leader = start_rank(&prefix, 0, model);
    assert_same(&complete(&http, &leader).await, &want, "TP 2 over two processes");
    let health: Value = http.get(format!("{}/healthz", follower.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(health["status"], "ok", "{health}");

    // The follower dies: the idle leader finds out (it pings every 5 s) and exits with an
    // error, to be started again; nothing hangs.
    follower.kill();
    let exited = leader.wait_exit(Duration::from_secs(60)).expect("the leader exits when a rank dies");
    assert!(!exited.success(), "the leader exits with an error: {exited}");

    // Both again: the group forms and serves the same completions.
    let follower = start_rank(&prefix, 1, "");
    let leader = start_rank(&prefix, 0, model);
    assert_same(&complete(&http, &leader).await, &want, "the group formed again");
    drop((leader, follower));
}
