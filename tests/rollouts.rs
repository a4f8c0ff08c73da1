//! Rollouts end to end, through the five services as processes: multi-turn GRPO runs on
//! `sliding_puzzle` (observations masked out of the loss, per-sample stop strings,
//! truncation at the maximum length, every turn recorded with its role, turn-level credit),
//! a GRPO run scored by a user's HTTP reward plugin (its named rewards as metrics and on the
//! samples, its `info` stored, validation reported as the mean reward since the plugin's
//! rewards are not right-or-wrong), and on its rewards REINFORCE++ with the KL in the reward,
//! GSPO and async GRPO.

#![allow(clippy::unwrap_used)]

mod stack;

use std::time::Duration;

use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use serde_json::{Value, json};
use stack::otlp::otlp_receiver;
use stack::{Stack, grpo_spec};

const LIMIT: Duration = Duration::from_secs(600);

#[tokio::test(flavor = "multi_thread")]
async fn multi_turn_rollouts_and_reward_plugins_reach_the_run() {
    let (otlp, spans) = otlp_receiver().await;
    let stack = Stack::start_with(&[
        ("KEEL_REWARD__HTTP_ALLOW_PRIVATE_ADDRESSES", "true"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp),
        ("OTEL_BSP_SCHEDULE_DELAY", "200"),
    ]);
    let (plugin, traceparents) = start_plugin().await;

    // The puzzle, up to 3 turns. A turn that runs out of new tokens ends its sample, so the
    // first turn stops at a space (the run's stop string, which a random model soon
    // writes); from the second on, the puzzle's own stop string (`</action>`, which it will
    // not write) replaces it. Observations are long: with room for them (512 tokens) samples
    // go on to a second turn; with 100 the first observation is cut at the limit.
    let (max_turns, max_new) = (3u64, 8u64);
    let puzzle = |max_len: u64| {
        let mut spec = grpo_spec(&json!({"path": stack.model}));
        spec["environments"] = json!({"default": {"name": "sliding_puzzle", "max_moves": 50}});
        spec["grpo"]["max_rollout_turns"] = json!(max_turns);
        spec["grpo"]["turn_level_advantages"] = json!(true);
        spec["grpo"]["samples_to_record"] = json!(8);
        spec["generation"]["max_new_tokens"] = json!(max_new);
        spec["generation"]["stop"] = json!([" "]);
        spec["max_total_sequence_length"] = json!(max_len);
        spec["max_num_steps"] = json!(2);
        spec["data"]["validation"] = Value::Null;
        spec["checkpointing"] = json!({"enabled": false});
        spec
    };
    let roomy = stack.submit(&puzzle(512)).await;
    let cut = stack.submit(&puzzle(100)).await;

    let mut scored = grpo_spec(&json!({"path": stack.model}));
    scored["environments"] = json!({"default": {"name": "http", "url": plugin}});
    scored["max_num_steps"] = json!(2);
    scored["checkpointing"] = json!({"enabled": false});
    let scored = stack.submit(&scored).await;
    // REINFORCE++ with the KL in the reward, on the plugin's rewards (which always differ
    // between samples, so the first step moves the policy away from the reference).
    let kl_in_reward = stack.submit(&scored_kl_spec(&stack, &plugin)).await;
    // GSPO: sequence-level ratios with a sequence-level loss; two optimiser steps a step, so
    // the second trains off the policy that generated (ratios leave 1, clipped per sequence).
    let mut gspo = grpo_spec(&json!({"path": stack.model}));
    gspo["environments"] = json!({"default": {"name": "http", "url": plugin}});
    gspo["training"]["global_batch_size"] = json!(4);
    gspo["training"]["micro_batch_size"] = json!(2);
    gspo["training"]["loss"] = json!({
        "type": "clipped_pg", "token_level_loss": false, "sequence_level_importance_ratios": true,
        "ratio_clip_min": 0.0003, "ratio_clip_max": 0.0004, "reference_policy_kl_penalty": 0.01,
    });
    gspo["max_num_steps"] = json!(2);
    gspo["data"]["validation"] = Value::Null;
    gspo["checkpointing"] = json!({"enabled": false});
    let gspo = stack.submit(&gspo).await;
    // Async GRPO: step t+1's rollouts run while step t trains, from weights at most one
    // update old, refit under the running samples (in flight), with the importance-sampling
    // correction for the difference.
    let mut asynchronous = grpo_spec(&json!({"path": stack.model}));
    asynchronous["environments"] = json!({"default": {"name": "http", "url": plugin}});
    asynchronous["grpo"]["async_grpo"] =
        json!({"enabled": true, "max_trajectory_age_steps": 1, "in_flight_weight_updates": true});
    asynchronous["training"]["loss"] = json!({
        "type": "clipped_pg", "reference_policy_kl_penalty": 0.01, "use_importance_sampling_correction": true,
    });
    asynchronous["max_num_steps"] = json!(4);
    asynchronous["checkpointing"] = json!({"save_period": 2});
    let asynchronous = stack.submit(&asynchronous).await;

    stack.wait_succeeded(&roomy, LIMIT).await;
    let turns = stack.series(&roomy, "train/turns_per_sample").await;
    assert!(turns.iter().any(|(_, t)| *t > 1.0), "no sample took a second turn: {turns:?}");
    let mut observed = 0;
    for s in samples_of(&stack, &roomy).await {
        let turns = s["turns"].as_array().unwrap();
        let roles: Vec<&str> = turns.iter().map(|t| t["role"].as_str().unwrap()).collect();
        let assistant = roles.iter().filter(|r| **r == "assistant").count() as u64;
        // Every turn is recorded, the model's and the environment's in turn.
        assert!(roles.iter().enumerate().all(|(i, r)| *r == if i % 2 == 0 { "assistant" } else { "user" }), "{s}");
        assert!((1..=max_turns).contains(&assistant), "{s}");
        // The puzzle saw every assistant turn (its `info` counts the moves).
        assert_eq!(s["info"]["moves"].as_u64(), Some(assistant), "{s}");
        let (prompt, generated, all) = tokens(&s);
        assert!(generated <= max_new * assistant, "{s}");
        if roles.contains(&"user") {
            // Observation tokens are in the sequence but not among the generated (trained) ones.
            assert!(generated < all - prompt, "observation tokens counted as generated: {s}");
            observed += 1;
        }
        if assistant >= 2 {
            // Per-sample stop strings: the first turn ended at a space (else the sample would
            // have ended there), the later ones no longer do.
            let last = turns.iter().rev().find(|t| t["role"] == "assistant").unwrap()["content"].as_str().unwrap();
            assert!(s["finish_reason"] == "length" || last.contains("</action>"), "{s}");
        }
    }
    assert!(observed > 0, "no recorded sample has an observation");

    stack.wait_succeeded(&cut, LIMIT).await;
    let mut at_limit = 0;
    for s in samples_of(&stack, &cut).await {
        let (_, _, all) = tokens(&s);
        assert!(all <= 100, "{s}");
        if s["finish_reason"] == "stop" {
            // Its first turn stopped at a space, its observation did not fit: cut at the limit.
            assert!(s["truncated"] == true && all == 100, "{s}");
            at_limit += 1;
        }
    }
    assert!(at_limit > 0, "no sample's observation reached the limit");

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

    // Each call to the plugin is a client span of the reward service, under its server span,
    // and the plugin's request carries it as the parent. Validation's calls (summarised in
    // the orchestrator's trace) carry their context marked not sampled; the training
    // rollouts' are sampled.
    let sent = traceparents.lock().unwrap().clone();
    assert!(sent.iter().any(|t| t.ends_with("-00")), "validation's calls are not sampled: {sent:?}");
    let parent = sent.iter().find(|t| t.ends_with("-01")).cloned().expect("a sampled call to the plugin");
    let client_id = parent.split('-').nth(2).unwrap().to_string();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let (client, received) = loop {
        let received = spans.lock().unwrap().clone();
        if let Some(span) = received.iter().find(|s| s.id == client_id).cloned() {
            break (span, received);
        }
        assert!(std::time::Instant::now() < deadline, "no span {client_id} (the plugin's parent) was exported");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!((client.name.as_str(), client.service.as_str()), ("reward.plugin POST", "keel-reward"), "{client:?}");
    assert_eq!(client.attributes.get("http.response.status_code").map(String::as_str), Some("200"), "{client:?}");
    assert!(client.attributes["url.full"].ends_with("/score"), "{client:?}");
    let server = received.iter().find(|s| s.id == client.parent).expect("the client span's parent was exported");
    assert_eq!(server.service, "keel-reward", "{server:?}");

    stack.wait_succeeded(&kl_in_reward, LIMIT).await;
    let penalty = stack.series(&kl_in_reward, "train/kl_in_reward").await;
    assert_eq!(penalty.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2], "{penalty:?}");
    // k3 is never negative; the first step's policy is the reference (KL 0), the second's not.
    assert!(penalty[0].1.abs() < 1e-6 && penalty[1].1 > 0.0, "{penalty:?}");
    for (step, kl) in stack.series(&kl_in_reward, "train/kl_penalty").await {
        assert_eq!(kl, 0.0, "step {step}: the loss has no KL term");
    }

    stack.wait_succeeded(&gspo, LIMIT).await;
    let loss = stack.series(&gspo, "train/loss").await;
    assert_eq!(loss.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2], "{loss:?}");
    assert!(loss.iter().all(|p| p.1.is_finite()), "{loss:?}");
    for (step, error) in stack.series(&gspo, "train/token_mult_prob_error").await {
        assert!((0.99..1.05).contains(&error), "step {step}: token_mult_prob_error {error}");
    }
    // Each sequence's ratio is clipped to GSPO's narrow range [1 − 3e-4, 1 + 4e-4]; the second
    // optimiser step of each step is off-policy, so its ratios leave 1.
    for (step, low) in stack.series(&gspo, "train/probs_ratio_clamped_min").await {
        assert!(low >= 1.0 - 3e-4 - 1e-6, "step {step}: clamped ratio {low}");
    }
    let (low, high) =
        (stack.series(&gspo, "train/probs_ratio_min").await, stack.series(&gspo, "train/probs_ratio_max").await);
    for ((step, low), (_, high)) in low.iter().zip(&high) {
        assert!(high - low > 1e-6, "step {step}: ratios {low}..{high} never left 1");
    }

    stack.wait_succeeded(&asynchronous, LIMIT).await;
    // Step 1 trains on rollouts of the starting weights; every later step on rollouts made
    // while the step before it trained, one update old; none dropped.
    let ages = stack.series(&asynchronous, "async/trajectory_age_max").await;
    assert_eq!(ages, [(1, 0.0), (2, 1.0), (3, 1.0), (4, 1.0)], "{ages:?}");
    let counted = stack.series(&asynchronous, "async/trajectories_age_1").await;
    assert_eq!(counted.iter().map(|p| p.1).collect::<Vec<_>>(), [0.0, 8.0, 8.0, 8.0], "{counted:?}");
    for name in ["async/dropped_trajectories", "async/trajectory_age_mean"] {
        let points = stack.series(&asynchronous, name).await;
        assert_eq!(points.len(), 4, "{name}: {points:?}");
        assert!(points.iter().all(|p| p.1 <= 1.0), "{name}: {points:?}");
    }
    assert!(stack.series(&asynchronous, "async/dropped_trajectories").await.iter().all(|p| p.1 == 0.0));
    for name in ["async/trainer_idle_seconds", "async/generator_idle_seconds", "train/loss"] {
        let points = stack.series(&asynchronous, name).await;
        assert_eq!(points.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2, 3, 4], "{name}: {points:?}");
        assert!(points.iter().all(|p| p.1.is_finite() && (p.1 >= 0.0 || name == "train/loss")), "{name}: {points:?}");
    }
    let validated = stack.series(&asynchronous, "validation/reward_mean").await;
    assert_eq!(validated.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 2, 4], "{validated:?}");
    let checkpoints = stack.get(&format!("/v1/runs/{asynchronous}/checkpoints")).await;
    let steps: Vec<u64> = checkpoints.as_array().unwrap().iter().map(|c| c["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [2, 4], "{checkpoints}");
}

/// A GRPO run scored by the plugin with REINFORCE++ and the KL in the reward.
fn scored_kl_spec(stack: &Stack, plugin: &str) -> Value {
    let mut spec = grpo_spec(&json!({"path": stack.model}));
    spec["environments"] = json!({"default": {"name": "http", "url": plugin}});
    spec["grpo"]["advantage_estimator"] = json!("reinforce_plus_plus");
    spec["training"]["loss"] =
        json!({"type": "clipped_pg", "use_kl_in_reward": true, "reference_policy_kl_penalty": 0.05});
    spec["max_num_steps"] = json!(2);
    spec["data"]["validation"] = Value::Null;
    spec["checkpointing"] = json!({"enabled": false});
    spec
}

/// The training samples a run recorded.
async fn samples_of(stack: &Stack, run: &str) -> Vec<Value> {
    let samples = stack.get(&format!("/v1/runs/{run}/samples?split=train&limit=100")).await;
    let samples = samples["samples"].as_array().unwrap().clone();
    assert_eq!(samples.len(), 16, "8 samples recorded at each of 2 steps");
    samples
}

/// A sample's token counts: prompt, generated, all.
fn tokens(sample: &Value) -> (u64, u64, u64) {
    let count = |name: &str| sample[name].as_u64().unwrap();
    (count("num_prompt_tokens"), count("num_generated_tokens"), count("num_tokens"))
}

/// A reward plugin on a free local port: `digits` (the share of the completion's characters
/// that are digits) and `brevity` (1 / (1 + characters)), with the character count as `info`;
/// it keeps the `traceparent` of each request.
async fn start_plugin() -> (String, Arc<Mutex<Vec<String>>>) {
    async fn score(State(seen): State<Seen>, headers: HeaderMap, Json(request): Json<Value>) -> Json<Value> {
        if let Some(parent) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
            seen.lock().unwrap().push(parent.to_string());
        }
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
    let seen = Seen::default();
    let app = axum::Router::new().route("/score", post(score)).with_state(seen.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, seen)
}

/// The `traceparent` headers of the plugin's requests.
type Seen = Arc<Mutex<Vec<String>>>;
