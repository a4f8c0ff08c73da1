//! Rollouts end to end, through the five services as processes: a multi-turn GRPO run on
//! `sliding_puzzle` (observations masked out of the loss, truncation at the maximum length,
//! every turn recorded with its role) and a GRPO run scored by a user's HTTP reward plugin
//! (its named rewards as metrics and on the samples, its `info` stored, validation reported
//! as the mean reward since the plugin's rewards are not right-or-wrong).

#![allow(clippy::unwrap_used)]

mod stack;

use std::time::Duration;

use axum::Json;
use axum::routing::post;
use serde_json::{Value, json};
use stack::{Stack, grpo_spec};

const LIMIT: Duration = Duration::from_secs(600);

#[tokio::test(flavor = "multi_thread")]
async fn multi_turn_rollouts_and_reward_plugins_reach_the_run() {
    let stack = Stack::start_with(&[("KEEL_REWARD__HTTP_ALLOW_PRIVATE_ADDRESSES", "true")]);
    let plugin = start_plugin().await;

    // The puzzle: up to 3 turns, long observations, a sequence limit that cuts most samples.
    // A turn that runs out of new tokens ends its sample, so the first turn stops at a space
    // (the run's stop string, which a random model soon writes); from the second on, the
    // puzzle's own stop string (`</action>`, which it will not write) replaces it.
    let (max_turns, max_new, max_len) = (3u64, 8u64, 160u64);
    let mut puzzle = grpo_spec(&json!({"path": stack.model}));
    puzzle["environments"] = json!({"default": {"name": "sliding_puzzle", "max_moves": 50}});
    puzzle["grpo"]["max_rollout_turns"] = json!(max_turns);
    puzzle["grpo"]["turn_level_advantages"] = json!(true);
    puzzle["grpo"]["samples_to_record"] = json!(8);
    puzzle["generation"]["max_new_tokens"] = json!(max_new);
    puzzle["generation"]["stop"] = json!([" "]);
    puzzle["max_total_sequence_length"] = json!(max_len);
    puzzle["max_num_steps"] = json!(2);
    puzzle["data"]["validation"] = Value::Null;
    puzzle["checkpointing"] = json!({"enabled": false});
    let puzzle = stack.submit(&puzzle).await;

    let mut scored = grpo_spec(&json!({"path": stack.model}));
    scored["environments"] = json!({"default": {"name": "http", "url": plugin}});
    scored["max_num_steps"] = json!(2);
    scored["checkpointing"] = json!({"enabled": false});
    let scored = stack.submit(&scored).await;

    stack.wait_succeeded(&puzzle, LIMIT).await;
    let turns = stack.series(&puzzle, "train/turns_per_sample").await;
    assert!(turns.iter().any(|(_, t)| *t > 1.0), "no sample took a second turn: {turns:?}");
    let truncation = stack.series(&puzzle, "train/truncation_rate").await;
    assert!(truncation.iter().any(|(_, r)| *r > 0.0), "no sample reached the limit: {truncation:?}");
    let samples = stack.get(&format!("/v1/runs/{puzzle}/samples?split=train&limit=100")).await;
    let samples = samples["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 16, "8 samples recorded at each of 2 steps");
    let mut observed = 0;
    for s in samples {
        let turns = s["turns"].as_array().unwrap();
        let roles: Vec<&str> = turns.iter().map(|t| t["role"].as_str().unwrap()).collect();
        let assistant = roles.iter().filter(|r| **r == "assistant").count() as u64;
        // Every turn is recorded, the model's and the environment's in turn.
        assert!(roles.iter().enumerate().all(|(i, r)| *r == if i % 2 == 0 { "assistant" } else { "user" }), "{s}");
        assert!((1..=max_turns).contains(&assistant), "{s}");
        // The puzzle saw every assistant turn (its `info` counts the moves).
        assert_eq!(s["info"]["moves"].as_u64(), Some(assistant), "{s}");
        let (prompt, generated, all) = (
            s["num_prompt_tokens"].as_u64().unwrap(),
            s["num_generated_tokens"].as_u64().unwrap(),
            s["num_tokens"].as_u64().unwrap(),
        );
        assert!(all <= max_len, "{s}");
        assert!(generated <= max_new * assistant, "{s}");
        if roles.contains(&"user") {
            // Observation tokens are in the sequence but not among the generated (trained) ones.
            assert!(generated < all - prompt, "observation tokens counted as generated: {s}");
            observed += 1;
        } else if s["truncated"] == false {
            assert_eq!(generated, all - prompt, "{s}");
        }
        if assistant >= 2 {
            // Per-sample stop strings: the first turn ended at a space (else the sample would
            // have ended there), the later ones no longer do.
            let last = turns.iter().rev().find(|t| t["role"] == "assistant").unwrap()["content"].as_str().unwrap();
            assert!(s["finish_reason"] == "length" || last.contains("</action>"), "{s}");
        }
        if s["truncated"] == true && s["finish_reason"] != "length" {
            assert_eq!(all, max_len, "truncated before the limit: {s}");
        }
    }
    assert!(observed > 0, "no recorded sample has an observation");

    stack.wait_succeeded(&scored, LIMIT).await;
    for name in ["train/rewards/digits", "train/rewards/brevity"] {
        let points = stack.series(&scored, name).await;
        assert_eq!(points.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2], "{name}: {points:?}");
    }
    let reward_mean = stack.series(&scored, "validation/reward_mean").await;
    assert_eq!(reward_mean.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 2], "{reward_mean:?}");
    assert_eq!(stack.series(&scored, "validation/rewards/digits").await.len(), 2);
    assert!(stack.series(&scored, "validation/accuracy").await.is_empty(), "the plugin's rewards are not 0/1");
    let samples = stack.get(&format!("/v1/runs/{scored}/samples?split=train&limit=100")).await;
    let samples = samples["samples"].as_array().unwrap();
    assert!(!samples.is_empty());
    for s in samples {
        let (digits, brevity) = (s["rewards"]["digits"].as_f64().unwrap(), s["rewards"]["brevity"].as_f64().unwrap());
        assert!((s["reward"].as_f64().unwrap() - (digits + brevity)).abs() < 1e-9, "{s}");
        let completion = s["completion"].as_str().unwrap();
        assert_eq!(s["info"]["chars"].as_u64(), Some(completion.chars().count() as u64), "{s}");
    }
}

/// A reward plugin on a free local port: `digits` (the share of the completion's characters
/// that are digits) and `brevity` (1 / (1 + characters)), with the character count as `info`.
async fn start_plugin() -> String {
    async fn score(Json(request): Json<Value>) -> Json<Value> {
        let completion = request["completion"].as_str().unwrap_or_default();
        let chars = completion.chars().count();
        let digits = completion.chars().filter(char::is_ascii_digit).count() as f64 / chars.max(1) as f64;
        Json(json!({
            "rewards": {"digits": digits, "brevity": 1.0 / (1.0 + chars as f64)},
            "info": {"chars": chars},
        }))
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/score", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, axum::Router::new().route("/score", post(score))).await });
    url
}
