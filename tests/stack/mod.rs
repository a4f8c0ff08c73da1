//! The five services as processes on one NATS subject prefix and one database of the test's
//! own, sharing a scratch directory, with a tiny model made by `keel model init`.

#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use keel_testkit::{ServiceProcess, TestDatabase, keel_model_init};
use serde_json::Value;

pub struct Stack {
    pub prefix: String,
    pub database: TestDatabase,
    pub dir: tempfile::TempDir,
    pub model: PathBuf,
    pub checkpoint: ServiceProcess,
    pub trainer: ServiceProcess,
    pub generator: ServiceProcess,
    pub reward: ServiceProcess,
    pub orchestrator: Option<ServiceProcess>,
    pub http: reqwest::Client,
    /// Environment every service gets (e.g. the OTLP endpoint).
    pub env: Vec<(String, String)>,
}

impl Stack {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// [`Stack::start`] with `env` added to every service's environment.
    pub fn start_with(env: &[(&str, &str)]) -> Self {
        let common: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let with = |own: &[(&str, &str)]| -> Vec<(String, String)> {
            own.iter().map(|(k, v)| (k.to_string(), v.to_string())).chain(common.iter().cloned()).collect()
        };
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model");
        keel_model_init(&model);
        let prefix = format!("e2e.{}", uuid::Uuid::new_v4().simple());
        let database = TestDatabase::new("keel_e2e");
        let blobs = dir.path().join("blobs");
        let checkpoint = start_service(
            "checkpoint",
            &with(&[
                ("KEEL_CHECKPOINT__DATABASE_URL", &database.url),
                ("KEEL_CHECKPOINT__STORAGE__KIND", "local"),
                ("KEEL_CHECKPOINT__STORAGE__ROOT", blobs.to_str().unwrap()),
                ("KEEL_CHECKPOINT__SUBJECT_PREFIX", &prefix),
            ]),
        );
        let trainer = start_service("trainer", &with(&[("KEEL_TRAINER__SUBJECT_PREFIX", &prefix)]));
        let generator = start_service(
            "generator",
            &with(&[("KEEL_GENERATOR__SUBJECT_PREFIX", &prefix), ("KEEL_GENERATOR__MODEL", model.to_str().unwrap())]),
        );
        let reward = start_service("reward", &with(&[("KEEL_REWARD__SUBJECT_PREFIX", &prefix)]));
        let mut stack = Self {
            prefix,
            database,
            dir,
            model,
            checkpoint,
            trainer,
            generator,
            reward,
            orchestrator: None,
            http: reqwest::Client::new(),
            env: common,
        };
        stack.start_orchestrator();
        stack
    }

    /// (Re)starts the orchestrator; a run it finds orphaned is resumed within two seconds.
    pub fn start_orchestrator(&mut self) {
        let work = self.dir.path().join("work");
        let mut env: Vec<(String, String)> = [
            ("KEEL_ORCHESTRATOR__DATABASE_URL", self.database.url.as_str()),
            ("KEEL_ORCHESTRATOR__SUBJECT_PREFIX", &self.prefix),
            ("KEEL_ORCHESTRATOR__CHECKPOINT_URL", &self.checkpoint.url),
            ("KEEL_ORCHESTRATOR__WORK_DIR", work.to_str().unwrap()),
            ("KEEL_ORCHESTRATOR__RUN_LEASE_SECONDS", "2"),
            ("KEEL_ORCHESTRATOR__POLL_SECONDS", "0.2"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        env.extend(self.env.iter().cloned());
        let orchestrator = start_service("orchestrator", &env);
        self.orchestrator = Some(orchestrator);
    }

    pub fn api(&self) -> String {
        self.orchestrator.as_ref().unwrap().url.clone()
    }

    /// Submits a JSON spec; panics with the API's answer unless it was accepted.
    pub async fn submit(&self, spec: &Value) -> String {
        let response = self.http.post(format!("{}/v1/runs", self.api())).json(spec).send().await.unwrap();
        let status = response.status();
        let body: Value = response.json().await.unwrap();
        assert_eq!(status, 201, "{body}");
        body["id"].as_str().unwrap().to_string()
    }

    pub async fn get(&self, path: &str) -> Value {
        let response = self.http.get(format!("{}{path}", self.api())).send().await.unwrap();
        assert!(response.status().is_success(), "GET {path}: {}", response.status());
        response.json().await.unwrap()
    }

    /// Polls the run until `done(run)` holds, failing after `limit`.
    pub async fn wait_for(&self, id: &str, limit: Duration, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            let run = self.get(&format!("/v1/runs/{id}")).await;
            if done(&run) {
                return run;
            }
            let status = run["status"].as_str().unwrap_or_default();
            assert!(!matches!(status, "failed" | "cancelled") || done(&run), "run {id} ended: {run}");
            assert!(Instant::now() < deadline, "run {id} did not get there in {limit:?}: {run}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn wait_succeeded(&self, id: &str, limit: Duration) -> Value {
        self.wait_for(id, limit, |run| run["status"] == "succeeded").await
    }

    /// One metric's points, `[(step, value)]`.
    pub async fn series(&self, id: &str, name: &str) -> Vec<(u64, f64)> {
        let body = self.get(&format!("/v1/runs/{id}/metrics?names={name}")).await;
        let Some(series) = body["metrics"].as_array().unwrap().first() else { return Vec::new() };
        series["points"].as_array().unwrap().iter().map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap())).collect()
    }
}

fn start_service(service: &str, env: &[(String, String)]) -> ServiceProcess {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    ServiceProcess::start(service, &env)
}

/// An arithmetic SFT spec on `model`.
pub fn sft_spec(model: &serde_json::Value, steps: u64, save_period: u64) -> Value {
    serde_json::json!({
        "name": "arithmetic-sft",
        "algorithm": "sft",
        "model": model,
        "data": {"train": {"kind": "arithmetic", "size": 256, "max_operand": 9, "seed": 1}},
        "training": {
            "loss": {"type": "nll"},
            "optimizer": {"lr": 0.003, "weight_decay": 0.0},
            "global_batch_size": 16,
            "micro_batch_size": 8,
        },
        "max_total_sequence_length": 64,
        "max_num_steps": steps,
        "checkpointing": {"save_period": save_period},
        "seed": 3,
    })
}

/// An arithmetic GRPO spec on `model` (math environment, validation and checkpoints every
/// 2 of 3 steps, the best checkpoint by validation accuracy kept).
pub fn grpo_spec(model: &serde_json::Value) -> Value {
    serde_json::json!({
        "name": "arithmetic-grpo",
        "algorithm": "grpo",
        "model": model,
        "data": {
            "train": {"kind": "arithmetic", "size": 64, "max_operand": 9, "seed": 2},
            "validation": {"kind": "arithmetic", "size": 4, "max_operand": 9, "seed": 9},
        },
        "environments": {"default": {"name": "math"}},
        "training": {
            "loss": {"type": "clipped_pg", "reference_policy_kl_penalty": 0.01},
            "optimizer": {"lr": 0.0005, "weight_decay": 0.0},
            "global_batch_size": 8,
            "micro_batch_size": 4,
        },
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "advantage_estimator": "grpo"},
        "generation": {"max_new_tokens": 12, "temperature": 1.0},
        "max_total_sequence_length": 64,
        "max_num_steps": 3,
        "validation": {"period": 2, "num_samples": 2, "pass_at_k": [1, 2], "temperature": 1.0},
        "checkpointing": {"save_period": 2, "keep_top_k": 1, "metric_name": "validation/accuracy"},
        "seed": 5,
    })
}
