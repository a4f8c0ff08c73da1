//! The run API in-process against the real Postgres (a database of the test's own): spec
//! validation (every problem with its field path), listing and paging, cancel, auth, and
//! metrics by name and step range.

#![allow(clippy::unwrap_used)]

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use keel_orchestrator::api::{AppState, routes};
use keel_orchestrator::db;
use serde_json::{Value, json};
use tower::ServiceExt;

struct Api {
    app: axum::Router,
    pool: sqlx::PgPool,
    model: tempfile::TempDir,
    datasets: tempfile::TempDir,
    _database: keel_testkit::TestDatabase,
}

impl Api {
    async fn start(token: Option<&str>) -> Self {
        let database = keel_testkit::TestDatabase::new("keel_orch");
        let pool = db::connect(&database.url).await.unwrap();
        // Nothing listens here: only specs naming a checkpoint would ask.
        let checkpoints = keel_client::checkpoint::CheckpointClient::new("http://127.0.0.1:9");
        let roots = keel_service::paths::PathRoots::new(&keel_service::paths::default_roots(), "path_roots").unwrap();
        let datasets = tempfile::tempdir().unwrap();
        let state = AppState {
            pool: pool.clone(),
            checkpoints,
            token: token.map(str::to_string),
            roots,
            datasets: datasets.path().to_path_buf(),
            max_dataset_bytes: 4096,
            mlflow: Default::default(),
        };
        let model = tempfile::tempdir().unwrap();
        std::fs::write(model.path().join("config.json"), "{}").unwrap();
        Self { app: routes(state), pool, model, datasets, _database: database }
    }

    async fn send(&self, request: Request<Body>) -> (StatusCode, Value) {
        let response = self.app.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    async fn submit(&self, body: &str, content_type: &str) -> (StatusCode, Value) {
        let request = Request::post("/v1/runs").header("content-type", content_type).body(Body::from(body.to_string()));
        self.send(request.unwrap()).await
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.send(Request::get(path).body(Body::empty()).unwrap()).await
    }

    fn sft_yaml(&self) -> String {
        format!(
            "algorithm: sft\nmodel: {{path: {}}}\ndata: {{train: {{kind: arithmetic, size: 64}}}}\n\
             training: {{loss: {{type: nll}}, global_batch_size: 8, micro_batch_size: 4}}\nmax_num_steps: 4\n",
            self.model.path().display()
        )
    }
}

fn fields(body: &Value) -> Vec<String> {
    body["error"]["problems"].as_array().unwrap().iter().map(|p| p["field"].as_str().unwrap().to_string()).collect()
}

#[tokio::test]
async fn bad_specs_are_refused_naming_every_field() {
    let api = Api::start(None).await;
    let (status, body) = api.submit("algorithm: sft\nmodel: [unclosed", "application/yaml").await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("line"), "{body}");

    let with_colour = api.sft_yaml() + "colour: blue\n";
    let (status, body) = api.submit(&with_colour, "application/yaml").await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(body["error"]["message"].as_str().unwrap().contains("colour"), "{body}");

    let wrong_type = api.sft_yaml().replace("max_num_steps: 4", "max_num_steps: four");
    let (status, body) = api.submit(&wrong_type, "application/yaml").await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(fields(&body), ["max_num_steps"], "{body}");

    let nested = api.sft_yaml().replace("micro_batch_size: 4", "micro_batch_size: -4");
    let (_, body) = api.submit(&nested, "application/yaml").await;
    assert_eq!(fields(&body), ["training.micro_batch_size"], "{body}");

    let impossible = json!({
        "algorithm": "grpo",
        "model": {"path": "/no/such/model"},
        "data": {"train": {"kind": "arithmetic"}, "validation": {"kind": "jsonl", "path": "/no/such.jsonl"}},
        "environments": {"default": {"name": "math"}},
        "training": {"loss": {"type": "clipped_pg"}, "global_batch_size": 48, "micro_batch_size": 8},
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 1},
        "generation": {"max_new_tokens": 600},
        "validation": {"num_samples": 2, "pass_at_k": [1, 4]},
        "checkpointing": {"keep_top_k": 2},
    });
    let (status, body) = api.submit(&impossible.to_string(), "application/json").await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        fields(&body),
        [
            "training.global_batch_size",
            "generation.max_new_tokens",
            "grpo.num_generations_per_prompt",
            "validation.pass_at_k[1]",
            "checkpointing.metric_name",
            "model.path",
            "data.validation.path",
        ],
        "{body}"
    );
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("grpo.num_generations_per_prompt: must be at least 2"), "{message}");

    // A reward plugin whose URL is not an absolute http(s) one is refused at submit, not
    // queued to fail on the reward service.
    for url in ["reward.example/score", "ftp://reward.example/score", "/score"] {
        let mut spec = impossible.clone();
        spec["grpo"]["num_generations_per_prompt"] = json!(4);
        spec["training"]["global_batch_size"] = json!(16);
        spec["generation"]["max_new_tokens"] = json!(16);
        spec["validation"] = json!({"num_samples": 4, "pass_at_k": [1]});
        spec["checkpointing"] = json!({});
        spec["data"] = json!({"train": {"kind": "arithmetic"}});
        spec["model"] = json!({"path": api.model.path()});
        spec["environments"] = json!({"default": {"name": "http", "url": url}});
        let (status, body) = api.submit(&spec.to_string(), "application/json").await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{url}: {body}");
        assert_eq!(fields(&body), ["environments.default.url"], "{url}: {body}");
    }

    let (_, listed) = api.get("/v1/runs").await;
    assert_eq!(listed["runs"].as_array().unwrap().len(), 0, "nothing refused was stored");
}

/// Hostile sizes and strings are refused at once with 422 naming the field: nothing is
/// allocated or generated for them, and nothing is stored.
#[tokio::test]
async fn hostile_specs_are_refused_before_any_work() {
    let api = Api::start(None).await;
    let grpo = |extra: Value| {
        let mut spec = json!({
            "algorithm": "grpo",
            "model": {"path": api.model.path()},
            "data": {"train": {"kind": "arithmetic"}},
            "environments": {"default": {"name": "math"}},
            "training": {"loss": {"type": "clipped_pg"}, "global_batch_size": 8, "micro_batch_size": 4},
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4},
        });
        for (key, value) in extra.as_object().unwrap() {
            spec[key] = value.clone();
        }
        spec.to_string()
    };
    let cases = [
        (grpo(json!({"data": {"train": {"kind": "arithmetic", "size": 95_403_352_724u64}}})), "data.train.size"),
        // Written as a float, an integer all the same (as JSON Schema's `integer` has it): too many.
        (grpo(json!({"data": {"train": {"kind": "arithmetic", "size": 1e9}}})), "data.train.size"),
        // Not an integer: a shape error, at the dataset (serde reports tagged enums whole).
        (grpo(json!({"data": {"train": {"kind": "arithmetic", "size": 1.5}}})), "data.train"),
        (
            grpo(json!({"data": {"train": {"kind": "arithmetic", "operations": "", "max_operand": 4_000_000_000u64}}})),
            "data.train.operations",
        ),
        (
            grpo(json!({"grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 1_000_000_000}})),
            "grpo.num_generations_per_prompt",
        ),
        (
            grpo(json!({"grpo": {"num_prompts_per_step": 1u64 << 62, "num_generations_per_prompt": 4}})),
            "grpo.num_prompts_per_step",
        ),
        (grpo(json!({"max_total_sequence_length": 1u64 << 40})), "max_total_sequence_length"),
        (grpo(json!({"validation": {"num_samples": 1_000_000_000}})), "validation.num_samples"),
        (grpo(json!({"name": "nul\u{0}name"})), "name"),
        (grpo(json!({"environments": {"default": {"name": "ma\u{0}th"}}})), "environments.default.name"),
        // Files outside the orchestrator's path roots are never read.
        (grpo(json!({"data": {"train": {"kind": "jsonl", "path": "/etc/shadow"}}})), "data.train.path"),
        (grpo(json!({"model": {"path": "/usr/lib"}})), "model.path"),
    ];
    // Generating any of these datasets would exhaust memory or never end: the answer
    // coming back at all shows nothing was generated.
    for (spec, field) in cases {
        let (status, body) = api.submit(&spec, "application/json").await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{field}: {body}");
        assert!(fields(&body).contains(&field.to_string()), "{field}: {body}");
    }
    // 100,000 levels of flow nesting, in YAML or JSON: refused before parsing. 1,000 levels
    // of block YAML: refused by the parser.
    let flow = format!("algorithm: sft\nname: {}{}\n", "[".repeat(100_000), "]".repeat(100_000));
    let json = format!("{{\"algorithm\": \"sft\", \"name\": {}{}}}", "[".repeat(100_000), "]".repeat(100_000));
    for (deep, content_type) in [(flow, "application/yaml"), (json, "application/json")] {
        let (status, body) = api.submit(&deep, content_type).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{content_type}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().contains("levels deep"), "{body}");
    }
    let block: String = (0..1_000).map(|depth| format!("{}- \n", "  ".repeat(depth))).collect();
    let (status, body) = api.submit(&format!("algorithm: sft\nname:\n{block}"), "application/yaml").await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    let (_, listed) = api.get("/v1/runs").await;
    assert_eq!(listed["runs"].as_array().unwrap().len(), 0, "nothing refused was stored");
}

#[tokio::test]
async fn runs_are_listed_paged_shown_and_cancelled() {
    let api = Api::start(None).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        let (status, run) = api.submit(&api.sft_yaml(), "application/yaml").await;
        assert_eq!(status, StatusCode::CREATED, "{run}");
        assert_eq!(run["status"], "queued");
        assert_eq!(run["total_steps"], 4);
        ids.push(run["id"].as_str().unwrap().to_string());
    }
    let (_, page) = api.get("/v1/runs?limit=2").await;
    let first: Vec<&str> = page["runs"].as_array().unwrap().iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(first, [ids[2].as_str(), ids[1].as_str()], "newest first");
    let (_, rest) = api.get(&format!("/v1/runs?limit=2&after={}", page["next"].as_str().unwrap())).await;
    assert_eq!(rest["runs"][0]["id"], ids[0].as_str());
    assert!(rest["next"].is_null());

    let cancel = Request::post(format!("/v1/runs/{}/cancel", ids[0])).body(Body::empty()).unwrap();
    let (status, run) = api.send(cancel).await;
    assert_eq!((status, run["status"].as_str()), (StatusCode::OK, Some("cancelled")), "{run}");
    let again = Request::post(format!("/v1/runs/{}/cancel", ids[0])).body(Body::empty()).unwrap();
    assert_eq!(api.send(again).await.0, StatusCode::CONFLICT);
    let (_, cancelled) = api.get("/v1/runs?status=cancelled").await;
    assert_eq!(cancelled["runs"].as_array().unwrap().len(), 1);
    assert_eq!(api.get("/v1/runs?status=sleeping").await.0, StatusCode::BAD_REQUEST);
    assert_eq!(api.get(&format!("/v1/runs/{}", uuid::Uuid::new_v4())).await.0, StatusCode::NOT_FOUND);
    assert_eq!(api.get("/v1/runs/not-a-uuid").await.0, StatusCode::NOT_FOUND);

    // Metrics as a driver records them, read back by name and step range.
    let id: uuid::Uuid = ids[1].parse().unwrap();
    let owner = uuid::Uuid::new_v4();
    let mut conn = api.pool.acquire().await.unwrap();
    db::start_run(&mut conn, id, owner, false).await.unwrap();
    for step in 1..=3u64 {
        let metrics = [("train/loss".to_string(), 1.0 / step as f64), ("train/reward".to_string(), step as f64)];
        let record = db::StepRecord { step, metrics: metrics.into(), ..Default::default() };
        assert!(db::record_step(&mut conn, id, owner, &record).await.unwrap());
    }
    let duplicate = db::StepRecord { step: 3, ..Default::default() };
    assert!(!db::record_step(&mut conn, id, owner, &duplicate).await.unwrap(), "a step is recorded once");
    let (_, metrics) = api.get(&format!("/v1/runs/{id}/metrics?names=train/reward&from_step=2")).await;
    assert_eq!(metrics, json!({"metrics": [{"name": "train/reward", "points": [[2, 2.0], [3, 3.0]]}]}));
    let (_, run) = api.get(&format!("/v1/runs/{id}")).await;
    assert_eq!((run["step"].as_u64(), run["latest_metrics"]["train/reward"].as_f64()), (Some(3), Some(3.0)));
}

#[tokio::test]
async fn a_configured_token_is_required() {
    let api = Api::start(Some("s3cret")).await;
    let (status, body) = api.get("/v1/runs").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    let wrong = Request::get("/v1/runs").header("authorization", "Bearer nope").body(Body::empty()).unwrap();
    assert_eq!(api.send(wrong).await.0, StatusCode::UNAUTHORIZED);
    let right = Request::get("/v1/runs").header("authorization", "Bearer s3cret").body(Body::empty()).unwrap();
    assert_eq!(api.send(right).await.0, StatusCode::OK);
    assert_eq!(api.get("/metrics").await.0, StatusCode::UNAUTHORIZED, "metrics need the token too");
    let scrape = Request::get("/metrics").header("authorization", "Bearer s3cret").body(Body::empty()).unwrap();
    assert_eq!(api.send(scrape).await.0, StatusCode::OK);
}

/// The dry run: a valid spec comes back as it would run, with its defaults; a broken one
/// gets every problem, as `POST /v1/runs` would list them; neither creates a run.
#[tokio::test]
async fn validate_checks_like_submit_and_creates_nothing() {
    let api = Api::start(None).await;
    let validate = |body: String| {
        Request::post("/v1/runs/validate").header("content-type", "application/yaml").body(Body::from(body))
    };

    let (status, spec) = api.send(validate(api.sft_yaml()).unwrap()).await;
    assert_eq!(status, StatusCode::OK, "{spec}");
    assert_eq!(spec["max_num_steps"], 4);
    assert_eq!(spec["seed"], 42, "defaults are filled in: {spec}");
    assert!(spec["training"]["optimizer"]["lr"].is_number(), "{spec}");

    let broken = api
        .sft_yaml()
        .replace("micro_batch_size: 4", "micro_batch_size: 16")
        .replace(&api.model.path().display().to_string(), "/no/such/model");
    let (status, body) = api.send(validate(broken.clone()).unwrap()).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    let (_, submitted) = api.submit(&broken, "application/yaml").await;
    assert_eq!(fields(&body), fields(&submitted), "the dry run finds what submit finds");
    assert_eq!(fields(&body), ["training.micro_batch_size", "model.path"], "every problem is listed: {body}");

    let (_, listed) = api.get("/v1/runs").await;
    assert_eq!(listed["runs"].as_array().unwrap().len(), 0, "validating creates nothing");
}

/// A dataset file uploads as its bytes and comes back as a path named by its content (the
/// same file twice: the same path), which a spec then names; a name that is no JSONL or
/// Parquet file's, and a file over the limit, are refused and leave nothing behind.
#[tokio::test]
async fn uploaded_datasets_are_kept_by_content_and_named_by_specs() {
    let api = Api::start(None).await;
    let upload = |name: &str, body: Vec<u8>| {
        Request::post(format!("/v1/datasets?name={name}"))
            .header("content-type", "application/octet-stream")
            .body(Body::from(body))
            .unwrap()
    };
    let lines = "{\"prompt\": \"What is 1 + 1?\", \"answer\": \"2\"}\n".repeat(8);
    let (status, first) = api.send(upload("train.jsonl", lines.clone().into_bytes())).await;
    assert_eq!(status, StatusCode::CREATED, "{first}");
    let path = first["path"].as_str().unwrap().to_string();
    assert_eq!(first["bytes"], lines.len());
    assert!(path.starts_with(&api.datasets.path().display().to_string()) && path.ends_with(".jsonl"), "{first}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), lines);
    let (_, again) = api.send(upload("copy.jsonl", lines.clone().into_bytes())).await;
    assert_eq!(again["path"], path.as_str(), "the same bytes, the same path");

    let (status, body) = api.send(upload("train.csv", b"a,b".to_vec())).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains(".jsonl or .parquet"), "{body}");
    let (status, body) = api.send(upload("big.jsonl", vec![b'x'; 5000])).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
    assert_eq!(std::fs::read_dir(api.datasets.path()).unwrap().count(), 1, "refused uploads leave nothing");

    let spec = api.sft_yaml().replace("{kind: arithmetic, size: 64}", &format!("{{kind: jsonl, path: {path}}}"));
    let (status, run) = api.submit(&spec, "application/yaml").await;
    assert_eq!(status, StatusCode::CREATED, "{run}");
}
