//! The `http` environment against a real reward server on loopback: success (single, named
//! rewards, batched, with auth), a slow server (timeout), 5xx (retries, then the error),
//! recovery after 503s, garbage JSON, an oversized reply, connection refused, the
//! concurrency limit, and each `on_error` policy.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use keel_environments::scoring::{Error, Scorer};
use keel_protocol::reward::{
    EnvConfig, EnvSample, EnvStepRequest, EnvStepResult, HttpRewardConfig, Message, OnError, PluginBatchRequest,
    PluginRequest,
};
use serde_json::{Value, json};

#[derive(Default)]
struct Counters {
    slow: AtomicUsize,
    fail: AtomicUsize,
    flaky: AtomicUsize,
    garbage: AtomicUsize,
    bad_request: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

fn judge(request: &PluginRequest) -> Value {
    let truth = request.metadata["ground_truth"].as_str().unwrap_or("");
    let reward = if request.completion.contains(truth) { 1.0 } else { 0.0 };
    json!({"reward": reward, "info": {"prompt": request.prompt, "turns": request.messages.len()}})
}

async fn start() -> (String, Arc<Counters>) {
    let counters = Arc::new(Counters::default());
    let app = Router::new()
        .route("/ok", post(|Json(r): Json<PluginRequest>| async move { Json(judge(&r)) }))
        .route(
            "/auth",
            post(|headers: HeaderMap, Json(r): Json<PluginRequest>| async move {
                if headers.get("authorization").and_then(|v| v.to_str().ok()) == Some("Bearer s3cret") {
                    Ok(Json(judge(&r)))
                } else {
                    Err(StatusCode::UNAUTHORIZED)
                }
            }),
        )
        .route("/named", post(|| async { Json(json!({"rewards": {"format": 0.25, "correct": 1.0}})) }))
        .route(
            "/batch",
            post(|Json(b): Json<PluginBatchRequest>| async move {
                Json(json!({"results": b.samples.iter().map(judge).collect::<Vec<_>>()}))
            }),
        )
        .route(
            "/slow",
            post(|State(c): State<Arc<Counters>>| async move {
                c.slow.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(5)).await;
                Json(json!({"reward": 1.0}))
            }),
        )
        .route(
            "/fail",
            post(|State(c): State<Arc<Counters>>| async move {
                c.fail.fetch_add(1, Ordering::SeqCst);
                StatusCode::INTERNAL_SERVER_ERROR
            }),
        )
        .route(
            "/flaky",
            post(|State(c): State<Arc<Counters>>| async move {
                if c.flaky.fetch_add(1, Ordering::SeqCst) < 2 {
                    Err(StatusCode::SERVICE_UNAVAILABLE)
                } else {
                    Ok(Json(json!({"reward": 0.5})))
                }
            }),
        )
        .route(
            "/garbage",
            post(|State(c): State<Arc<Counters>>| async move {
                c.garbage.fetch_add(1, Ordering::SeqCst);
                "{\"reward\": 1.0, oops"
            }),
        )
        .route("/moved", post(|| async { (StatusCode::TEMPORARY_REDIRECT, [("location", "/ok")]) }))
        .route("/no-reward", post(|| async { Json(json!({"info": {"why": "forgot"}})) }))
        .route("/nan", post(|| async { ([("content-type", "application/json")], "{\"reward\": 1e999}") }))
        .route("/huge", post(|| async { Json(json!({"reward": 1.0, "info": {"pad": "x".repeat(2 << 20)}})) }))
        .route(
            "/bad-request",
            post(|State(c): State<Arc<Counters>>| async move {
                c.bad_request.fetch_add(1, Ordering::SeqCst);
                StatusCode::BAD_REQUEST
            }),
        )
        .route(
            "/counted",
            post(|State(c): State<Arc<Counters>>| async move {
                let now = c.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                c.max_in_flight.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
                c.in_flight.fetch_sub(1, Ordering::SeqCst);
                Json(json!({"reward": 1.0}))
            }),
        )
        .with_state(counters.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, counters)
}

/// The plugins of these tests listen on 127.0.0.1: the operator allows private addresses.
fn scorer() -> Scorer {
    let mut config = keel_reward::default_config();
    config.nats_url = String::new();
    config.http_allow_private_addresses = true;
    keel_reward::state(&config, None).unwrap().scorer
}

fn config(url: String) -> HttpRewardConfig {
    HttpRewardConfig { url, timeout_ms: 2_000, max_retries: 2, backoff_ms: 10, ..HttpRewardConfig::default() }
}

fn samples(n: usize) -> Vec<EnvSample> {
    (0..n)
        .map(|i| EnvSample {
            messages: vec![
                Message::new("user", format!("what is {i}+{i}?")),
                Message::new("assistant", format!("{}", 2 * i)),
            ],
            metadata: json!({"ground_truth": if i % 2 == 0 { format!("{}", 2 * i) } else { "never".into() }}),
            token_ids: None,
            agent: None,
        })
        .collect()
}

async fn step(
    scorer: &Scorer,
    config: HttpRewardConfig,
    on_error: OnError,
    n: usize,
) -> Result<Vec<EnvStepResult>, Error> {
    let request = EnvStepRequest { env: EnvConfig::Http(config), on_error, samples: samples(n) };
    scorer.step(request).await.map(|r| r.results)
}

fn error_of(result: &EnvStepResult) -> (String, String) {
    let e = result.error.clone().unwrap_or_else(|| panic!("no error in {result:?}"));
    (e.kind, e.message)
}

#[tokio::test]
async fn rewards_come_back_single_named_batched_and_with_auth() {
    let (url, _) = start().await;
    let scorer = scorer();
    let results = step(&scorer, config(format!("{url}/ok")), OnError::Fail, 4).await.unwrap();
    assert_eq!(results.iter().map(|r| r.reward).collect::<Vec<_>>(), [1.0, 0.0, 1.0, 0.0]);
    assert_eq!(results[1].info, json!({"prompt": "what is 1+1?", "turns": 2}));

    let named = step(&scorer, config(format!("{url}/named")), OnError::Fail, 1).await.unwrap();
    assert_eq!(named[0].reward, 1.25);
    assert_eq!(named[0].rewards.get("format"), Some(&0.25));

    let batched = HttpRewardConfig { batch_size: 3, ..config(format!("{url}/batch")) };
    let results = step(&scorer, batched, OnError::Fail, 7).await.unwrap();
    assert_eq!(results.iter().map(|r| r.reward).collect::<Vec<_>>(), [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]);

    let without = step(&scorer, config(format!("{url}/auth")), OnError::Zero, 1).await.unwrap();
    assert_eq!(error_of(&without[0]).0, "http_status");
    let with = HttpRewardConfig { authorization: Some("Bearer s3cret".into()), ..config(format!("{url}/auth")) };
    assert_eq!(step(&scorer, with, OnError::Fail, 1).await.unwrap()[0].reward, 1.0);
}

#[tokio::test]
async fn a_slow_server_times_out_after_the_retries() {
    let (url, counters) = start().await;
    let slow = HttpRewardConfig { timeout_ms: 200, max_retries: 1, ..config(format!("{url}/slow")) };
    let results = step(&scorer(), slow, OnError::Zero, 1).await.unwrap();
    let (kind, message) = error_of(&results[0]);
    assert_eq!(kind, "timeout");
    assert!(message.contains("200 ms") && message.contains("after 2 attempts"), "{message}");
    assert_eq!(results[0].reward, 0.0);
    assert!(counters.slow.load(Ordering::SeqCst) >= 1);
}

#[tokio::test]
async fn server_errors_are_retried_then_reported() {
    let (url, counters) = start().await;
    let scorer = scorer();
    let results = step(&scorer, config(format!("{url}/fail")), OnError::Zero, 1).await.unwrap();
    let (kind, message) = error_of(&results[0]);
    assert_eq!(kind, "http_status");
    assert!(message.contains("500") && message.contains("after 3 attempts"), "{message}");
    assert_eq!(counters.fail.load(Ordering::SeqCst), 3, "one try and two retries");

    let recovered = step(&scorer, config(format!("{url}/flaky")), OnError::Fail, 1).await.unwrap();
    assert_eq!(recovered[0].reward, 0.5);
    assert_eq!(counters.flaky.load(Ordering::SeqCst), 3);

    let results = step(&scorer, config(format!("{url}/bad-request")), OnError::Zero, 1).await.unwrap();
    assert_eq!(error_of(&results[0]).0, "http_status");
    assert_eq!(counters.bad_request.load(Ordering::SeqCst), 1, "a 4xx is not retried");
}

#[tokio::test]
async fn malformed_and_oversized_replies_fail_the_sample() {
    let (url, counters) = start().await;
    let scorer = scorer();
    for (path, kind, needle) in [
        ("garbage", "malformed_reply", "not a reward"),
        ("no-reward", "malformed_reply", "neither `reward` nor `rewards`"),
        ("nan", "malformed_reply", "not a reward"),
        ("huge", "too_large", "larger than 1048576 bytes"),
    ] {
        let results = step(&scorer, config(format!("{url}/{path}")), OnError::Zero, 2).await.unwrap();
        for result in &results {
            let (k, message) = error_of(result);
            assert_eq!(k, kind, "{path}: {message}");
            assert!(message.contains(needle), "{path}: {message}");
            assert_eq!(result.reward, 0.0);
        }
    }
    assert_eq!(counters.garbage.load(Ordering::SeqCst), 2, "malformed replies are not retried");
}

#[tokio::test]
async fn connection_refused_is_reported() {
    // Port 1 (tcpmux) is privileged and has no listener here.
    let refused = HttpRewardConfig { max_retries: 1, ..config("http://127.0.0.1:1/score".into()) };
    let results = step(&scorer(), refused, OnError::Zero, 1).await.unwrap();
    let (kind, message) = error_of(&results[0]);
    assert_eq!(kind, "unreachable");
    assert!(message.to_lowercase().contains("refused") && message.contains("after 2 attempts"), "{message}");
}

#[tokio::test]
async fn concurrency_is_limited_per_endpoint() {
    let (url, counters) = start().await;
    let limited = HttpRewardConfig { max_concurrency: 2, ..config(format!("{url}/counted")) };
    let results = step(&scorer(), limited, OnError::Fail, 8).await.unwrap();
    assert!(results.iter().all(|r| r.reward == 1.0));
    assert_eq!(counters.max_in_flight.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn on_error_decides_zero_skip_or_fail() {
    let (url, _) = start().await;
    let scorer = scorer();
    let garbage = || config(format!("{url}/garbage"));
    let zero = step(&scorer, garbage(), OnError::Zero, 1).await.unwrap();
    assert_eq!((zero[0].reward, zero[0].skipped, zero[0].terminated), (0.0, false, true));
    let skip = step(&scorer, garbage(), OnError::Skip, 1).await.unwrap();
    assert!(skip[0].skipped && skip[0].error.is_some());
    match step(&scorer, garbage(), OnError::Fail, 2).await {
        Err(Error::SampleFailed { index, error }) => assert_eq!((index, error.kind.as_str()), (0, "malformed_reply")),
        other => panic!("expected a failed request, got {other:?}"),
    }
}

#[tokio::test]
async fn bad_configurations_are_refused_with_the_field() {
    let scorer = scorer();
    for (config, needle) in [
        (HttpRewardConfig { url: "not a url".into(), ..HttpRewardConfig::default() }, "env.url"),
        (HttpRewardConfig { url: "ftp://x/".into(), ..HttpRewardConfig::default() }, "env.url"),
        (HttpRewardConfig { batch_size: 0, ..config("http://x/".into()) }, "env.batch_size"),
        (HttpRewardConfig { max_concurrency: 0, ..config("http://x/".into()) }, "env.max_concurrency"),
        (
            HttpRewardConfig {
                authorization_env: Some("KEEL_REWARD_SECRET_SURELY_UNSET".into()),
                ..config("http://x/".into())
            },
            "`KEEL_REWARD_SECRET_SURELY_UNSET` may not be sent to http://x/",
        ),
        (
            HttpRewardConfig { authorization_env: Some("PATH".into()), ..config("http://x/".into()) },
            "KEEL_REWARD_SECRET_",
        ),
        (HttpRewardConfig { max_retries: 1_000_000, ..config("http://x/".into()) }, "env.max_retries: must be 0 to 10"),
        (HttpRewardConfig { timeout_ms: 0, ..config("http://x/".into()) }, "env.timeout_ms"),
    ] {
        match step(&scorer, config, OnError::Fail, 1).await {
            Err(Error::InvalidRequest(message)) => assert!(message.contains(needle), "{message}"),
            other => panic!("expected an invalid request naming {needle}, got {other:?}"),
        }
    }
}

/// A secret goes only to the URLs its operator bound it to (`<secret>_URL`); a request
/// naming another URL is refused in the same words as one naming a secret that does not
/// exist, so refusals reveal nothing.
#[tokio::test]
async fn secrets_go_only_to_the_urls_the_operator_bound_them_to() {
    let (url, _) = start().await;
    // SAFETY: nextest runs each test in a process of its own; nothing else reads the
    // environment while these are set.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("KEEL_REWARD_SECRET_PLUGIN_TEST", "Bearer s3cret");
        std::env::set_var("KEEL_REWARD_SECRET_PLUGIN_TEST_URL", format!("{url}/auth"));
        std::env::set_var("KEEL_REWARD_SECRET_UNBOUND_TEST", "Bearer s3cret");
    }
    let scorer = scorer();
    let named = |var: &'static str, at: String| HttpRewardConfig { authorization_env: Some(var.into()), ..config(at) };
    let bound = step(&scorer, named("KEEL_REWARD_SECRET_PLUGIN_TEST", format!("{url}/auth")), OnError::Fail, 1).await;
    assert_eq!(bound.unwrap()[0].reward, 1.0, "the bound URL gets the secret");
    let refusal = |var: &'static str, at: String| {
        let scorer = scorer.clone();
        async move {
            match step(&scorer, named(var, at), OnError::Fail, 1).await {
                Err(Error::InvalidRequest(message)) => message,
                other => panic!("expected a refusal, got {other:?}"),
            }
        }
    };
    let elsewhere = refusal("KEEL_REWARD_SECRET_PLUGIN_TEST", "http://attacker.example/collect".into()).await;
    let sibling = refusal("KEEL_REWARD_SECRET_PLUGIN_TEST", format!("{url}/authx")).await;
    let unbound = refusal("KEEL_REWARD_SECRET_UNBOUND_TEST", format!("{url}/auth")).await;
    let missing = refusal("KEEL_REWARD_SECRET_NOT_THERE", "http://attacker.example/collect".into()).await;
    for message in [&elsewhere, &sibling, &unbound, &missing] {
        assert!(message.contains("may not be sent to"), "{message}");
        assert!(!message.contains("s3cret"), "{message}");
    }
    assert_eq!(
        elsewhere.replace("PLUGIN_TEST", "X"),
        missing.replace("NOT_THERE", "X"),
        "a secret that exists and one that does not are refused alike"
    );
}

/// By default a run cannot point the `http` environment inside: a plugin on 127.0.0.1, the
/// cloud metadata address and `localhost` are refused naming the setting that allows them.
#[tokio::test]
async fn private_addresses_are_refused_unless_the_operator_allows_them() {
    let (url, _) = start().await;
    let mut config = keel_reward::default_config();
    config.nats_url = String::new();
    let strict = keel_reward::state(&config, None).unwrap().scorer;
    for target in [format!("{url}/ok"), "http://169.254.169.254/latest/meta-data".into(), "http://localhost:9/".into()]
    {
        match step(&strict, config_for(&target), OnError::Fail, 1).await {
            Err(Error::InvalidRequest(message)) => {
                assert!(message.contains("http_allow_private_addresses"), "{message}")
            }
            other => panic!("expected {target} to be refused, got {other:?}"),
        }
    }
    // Refused when the environment is built: nothing was sent. The operator's switch lets
    // the same plugin through.
    assert_eq!(step(&scorer(), config_for(&format!("{url}/ok")), OnError::Fail, 1).await.unwrap()[0].reward, 1.0);

    // Or only the hosts named in `http_private_hosts` (as Compose names its agent's service):
    // the plugin by that name is reached; by its literal address, and anything else inside,
    // still refused.
    config.http_private_hosts = vec!["localhost".into()];
    let named = keel_reward::state(&config, None).unwrap().scorer;
    let by_name = url.replace("127.0.0.1", "localhost");
    assert_eq!(step(&named, config_for(&format!("{by_name}/ok")), OnError::Fail, 1).await.unwrap()[0].reward, 1.0);
    for target in [format!("{url}/ok"), "http://169.254.169.254/latest/meta-data".into()] {
        match step(&named, config_for(&target), OnError::Fail, 1).await {
            Err(Error::InvalidRequest(message)) => assert!(message.contains("http_private_hosts"), "{message}"),
            other => panic!("expected {target} to be refused, got {other:?}"),
        }
    }
    config.http_private_hosts = vec!["http://agent:8091/".into()];
    let error = keel_service::ServiceConfig::validate(&config).unwrap_err().to_string();
    assert!(error.contains("http_private_hosts"), "{error}");
}

/// A plugin on a host the operator lets the reward service call answers 307 to another port
/// of the same machine, where a service would answer a reward: that redirect is not
/// followed (the sample fails, the other port never sees the POST); one within the plugin's
/// own origin is.
#[tokio::test]
async fn a_redirect_cannot_lead_the_call_to_another_port() {
    let (inside, counters) = start().await;
    let target = format!("{inside}/counted");
    let app = Router::new().fallback(move || {
        let target = target.clone();
        async move { (StatusCode::TEMPORARY_REDIRECT, [("location", target)]) }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let plugin = format!("http://localhost:{}", listener.local_addr().unwrap().port());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let mut config = keel_reward::default_config();
    config.nats_url = String::new();
    config.http_private_hosts = vec!["localhost".into()];
    let named = keel_reward::state(&config, None).unwrap().scorer;
    let refused = step(&named, config_for(&format!("{plugin}/score")), OnError::Fail, 1).await.unwrap_err();
    let message = format!("{refused:?}");
    assert!(message.contains("another host or port") && message.contains("redirect"), "{message}");
    assert_eq!(counters.max_in_flight.load(Ordering::SeqCst), 0, "the redirect reached the other port");

    let by_name = inside.replace("127.0.0.1", "localhost");
    let moved = step(&named, config_for(&format!("{by_name}/moved")), OnError::Fail, 1).await.unwrap();
    assert_eq!(moved[0].reward, 1.0, "a redirect within the plugin's origin: {moved:?}");
}

fn config_for(url: &str) -> HttpRewardConfig {
    config(url.to_string())
}
