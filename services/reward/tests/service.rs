//! The service's two faces: REST (`/v1/score`, `/v1/env/step`, `/metrics`, errors naming
//! the field) on a real socket, and the NATS queue group against the real NATS server on a
//! subject prefix of the test's own. Plus the committed OpenAPI documents.

#![allow(clippy::unwrap_used)]

use keel_protocol::reward::{EnvStepReply, ScoreReply};
use keel_protocol::{Reply, Subjects};
use serde_json::{Value, json};
use utoipa::OpenApi;

async fn serve_rest() -> String {
    serve_rest_with(None).await
}

async fn serve_rest_with(api_token: Option<&str>) -> String {
    let mut config = keel_reward::default_config();
    config.nats_url = String::new();
    config.api_token = api_token.map(str::to_string);
    let state = keel_reward::state(&config, None).unwrap();
    let app = keel_reward::app(state, config.api_token.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(keel_service::serve(listener, app, std::future::pending()));
    url
}

async fn post(url: &str, body: &str) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

#[tokio::test]
async fn rest_scores_steps_and_counts() {
    let url = serve_rest().await;
    let body = json!({
        "env": {"name": "math"},
        "samples": [
            {"prompt": "1/2 + 1/2?", "completion": "It is \\boxed{1}.", "metadata": {"ground_truth": "1"}},
            {"completion": "\\boxed{3}", "metadata": {"ground_truth": "2"}},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\\boxed{2}"}], "metadata": {"ground_truth": "2"}},
        ]
    });
    let (status, reply) = post(&format!("{url}/v1/score"), &body.to_string()).await;
    assert_eq!(status, 200, "{reply}");
    let reply: ScoreReply = serde_json::from_value(reply).unwrap();
    assert_eq!(reply.results.iter().map(|r| r.reward).collect::<Vec<_>>(), [1.0, 0.0, 1.0]);
    assert_eq!(reply.results[1].answer.as_deref(), Some("3"));
    assert!((reply.metrics["reward_mean"] - 2.0 / 3.0).abs() < 1e-9);

    let step = json!({
        "env": {"name": "sliding_puzzle", "max_moves": 10},
        "samples": [{"messages": [{"role": "assistant", "content": "<action>left</action>"}], "metadata": {"board": [[1, 2], [0, 3]]}}]
    });
    let (status, reply) = post(&format!("{url}/v1/env/step"), &step.to_string()).await;
    assert_eq!(status, 200, "{reply}");
    let reply: EnvStepReply = serde_json::from_value(reply).unwrap();
    assert_eq!((reply.results[0].reward, reply.results[0].terminated), (1.0, true));

    let metrics = reqwest::get(format!("{url}/metrics")).await.unwrap().text().await.unwrap();
    assert!(metrics.contains("keel_reward_samples_total{env=\"math\"} 3"), "{metrics}");
    assert!(metrics.contains("keel_reward_samples_total{env=\"sliding_puzzle\"} 1"), "{metrics}");
    assert!(metrics.contains("keel_reward_requests_in_flight 0"), "{metrics}");
}

#[tokio::test]
async fn rest_errors_name_the_field() {
    let url = serve_rest().await;
    let score = format!("{url}/v1/score");
    let cases = [
        ("{not json", 400, "invalid_json", "not JSON"),
        (r#"{"env": {"name": "chess"}, "samples": []}"#, 422, "invalid_request", "env"),
        (r#"{"env": {"name": "math", "time_limt_ms": 3}, "samples": []}"#, 422, "invalid_request", "time_limt_ms"),
        (
            r#"{"env": {"name": "math"}, "samples": [{"completion": 3}]}"#,
            422,
            "invalid_request",
            "samples[0].completion",
        ),
        (r#"{"env": {"name": "math"}, "samples": [{"prompt": "p"}]}"#, 422, "invalid_request", "samples[0].completion"),
        (
            r#"{"env": {"name": "math"}, "samples": [{"messages": [{"role": "user", "content": "x"}]}]}"#,
            422,
            "invalid_request",
            "samples[0].messages",
        ),
        (
            r#"{"env": {"name": "math", "answer_pattern": "(("}, "samples": []}"#,
            422,
            "invalid_request",
            "env.answer_pattern",
        ),
        (
            r#"{"env": {"name": "math"}, "on_error": "fail", "samples": [{"completion": "\\boxed{1}"}]}"#,
            422,
            "sample_failed",
            "metadata.ground_truth",
        ),
        (r#"{"env": {"name": "math"}, "on_error": "sometimes", "samples": []}"#, 422, "invalid_request", "on_error"),
    ];
    for (body, status, kind, needle) in cases {
        let (got, reply) = post(&score, body).await;
        assert_eq!(got, status, "{body}: {reply}");
        assert_eq!(reply["error"]["type"], kind, "{body}: {reply}");
        assert!(reply["error"]["message"].as_str().unwrap().contains(needle), "{body}: {reply}");
    }
    let (status, reply) =
        post(&format!("{url}/v1/env/step"), r#"{"env": {"name": "math"}, "samples": [{"messages": []}]}"#).await;
    assert_eq!(status, 422);
    assert!(reply["error"]["message"].as_str().unwrap().contains("samples[0].messages"), "{reply}");
    // The service is still up.
    assert_eq!(reqwest::get(format!("{url}/healthz")).await.unwrap().status(), 200);
}

/// With a token, scoring, environment steps and metrics answer only requests that carry it;
/// `/healthz` stays open.
#[tokio::test]
async fn a_token_guards_every_route_but_health() {
    let url = serve_rest_with(Some("r3ward")).await;
    let body =
        r#"{"env": {"name": "math"}, "samples": [{"completion": "\\boxed{2}", "metadata": {"ground_truth": "2"}}]}"#;
    let (status, refused) = post(&format!("{url}/v1/score"), body).await;
    assert_eq!(status, 401, "{refused}");
    let http = reqwest::Client::new();
    let metrics = http.get(format!("{url}/metrics")).send().await.unwrap();
    assert_eq!(metrics.status(), 401);
    let scored = http
        .post(format!("{url}/v1/score"))
        .bearer_auth("r3ward")
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(scored.status(), 200);
    assert_eq!(http.get(format!("{url}/healthz")).send().await.unwrap().status(), 200);
}

#[tokio::test]
async fn nats_queue_group_serves_scores_and_steps() {
    let prefix = format!("test.{}", uuid::Uuid::new_v4().simple());
    let subjects = Subjects::new(&prefix).unwrap();
    let client = keel_service::nats::connect(&keel_service::nats::default_url()).await.unwrap();
    let mut config = keel_reward::default_config();
    config.subject_prefix = prefix.clone();
    let state = keel_reward::state(&config, Some(client.clone())).unwrap();
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let server = tokio::spawn(keel_reward::nats::serve(client.clone(), subjects.clone(), state.scorer, async move {
        let _ = stop_rx.wait_for(|s| *s).await;
    }));
    // Wait until the queue group is subscribed: a request gets an answer.
    let ask = |subject: String, body: Value| {
        let client = client.clone();
        async move {
            let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                match client.request(subject.clone(), body.to_string().into()).await {
                    Ok(message) => return serde_json::from_slice::<Value>(&message.payload).unwrap(),
                    Err(e) if tokio::time::Instant::now() < deadline => {
                        let _ = e;
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                    Err(e) => panic!("no reply on {subject}: {e}"),
                }
            }
        }
    };
    let body = json!({"env": {"name": "exact_match"}, "samples": [{"completion": " Paris ", "metadata": {"ground_truth": "paris"}}]});
    let reply: Reply<ScoreReply> = serde_json::from_value(ask(subjects.reward_score(), body).await).unwrap();
    match reply {
        Reply::Ok(reply) => assert_eq!(reply.results[0].reward, 1.0),
        Reply::Error(e) => panic!("{e}"),
    }
    let body = json!({"env": {"name": "multiple_choice"}, "samples": [{"messages": [{"role": "assistant", "content": "Answer: C"}], "metadata": {"ground_truth": "C"}}]});
    let reply: Reply<EnvStepReply> = serde_json::from_value(ask(subjects.reward_env_step(), body).await).unwrap();
    match reply {
        Reply::Ok(reply) => assert_eq!((reply.results[0].reward, reply.results[0].terminated), (1.0, true)),
        Reply::Error(e) => panic!("{e}"),
    }
    let garbage = ask(subjects.reward_env_step(), json!({"env": {"name": "math"}})).await;
    assert_eq!(garbage["error"]["type"], "invalid_request", "{garbage}");
    assert!(garbage["error"]["message"].as_str().unwrap().contains("samples"), "{garbage}");
    // Still serving after the bad message.
    let body = json!({"env": {"name": "regex", "pattern": "^ok$"}, "samples": [{"completion": "ok"}]});
    let reply = ask(subjects.reward_score(), body).await;
    assert_eq!(reply["ok"]["results"][0]["reward"], 1.0, "{reply}");
    stop_tx.send(true).unwrap();
    server.await.unwrap().unwrap();
}

fn check_document(name: &str, generated: String) {
    let path = keel_testkit::workspace_root().join("openapi").join(name);
    if std::env::var_os("KEEL_UPDATE_OPENAPI").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} is out of date: run KEEL_UPDATE_OPENAPI=1 cargo nextest run -p keel-reward --test service",
        path.display()
    );
}

#[test]
fn the_committed_openapi_documents_match_the_code() {
    let doc = serde_json::to_string_pretty(&keel_service::openapi::document(&keel_reward::api::ApiDoc::openapi()))
        .unwrap()
        + "\n";
    let value: Value = serde_json::from_str(&doc).unwrap();
    for path in ["/v1/score", "/v1/env/step", "/metrics"] {
        assert!(value["paths"].get(path).is_some(), "{path} is not documented");
    }
    for schema in ["EnvConfig", "MathConfig", "HttpRewardConfig", "EnvStepResult", "OnError"] {
        assert!(value["components"]["schemas"].get(schema).is_some(), "{schema} is not documented");
    }
    check_document("reward.json", doc);
    let plugin = serde_json::to_string_pretty(&keel_service::openapi::document(&keel_reward::api::plugin_document()))
        .unwrap()
        + "\n";
    let value: Value = serde_json::from_str(&plugin).unwrap();
    assert!(value["paths"]["/"]["post"]["requestBody"].is_object());
    assert!(value["components"]["schemas"].get("PluginResponse").is_some());
    check_document("reward-plugin.json", plugin);
    let agent = serde_json::to_string_pretty(&keel_service::openapi::document(&keel_reward::api::agent_document()))
        .unwrap()
        + "\n";
    let value: Value = serde_json::from_str(&agent).unwrap();
    assert!(value["paths"]["/"]["post"]["requestBody"].is_object());
    for schema in ["AgentRequest", "AgentEndpoint", "AgentLimits", "PluginResponse"] {
        assert!(value["components"]["schemas"].get(schema).is_some(), "{schema} is not documented");
    }
    check_document("agent.json", agent);
}
