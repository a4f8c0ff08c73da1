//! The five services as processes on one NATS subject prefix and one database of the test's
//! own, sharing a scratch directory, with a tiny model made by `keel model init`.

#![allow(dead_code, clippy::unwrap_used)]

pub mod otlp;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use keel_testkit::{ServiceProcess, TestDatabase, keel_model_init};
use serde_json::Value;

pub struct Stack {
    pub prefix: String,
    pub database: TestDatabase,
    /// The database as the services reach it.
    pub database_url: String,
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
    /// Each service's own environment (the orchestrator's is made by [`Stack::orchestrator_env`]).
    own_env: BTreeMap<&'static str, Vec<(String, String)>>,
}

/// Where the services find NATS and Postgres, when not at the defaults (a test's
/// [`keel_testkit::Proxy`] in front of them).
#[derive(Debug, Clone, Default)]
pub struct Servers {
    pub nats_url: Option<String>,
    /// A NATS URL per service (`orchestrator`, `trainer`, ...), e.g. with its own credentials.
    pub nats_urls: BTreeMap<&'static str, String>,
    /// The Postgres server's `host:port` for every service's database URL.
    pub postgres: Option<String>,
}

impl Stack {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// [`Stack::start`] with `env` added to every service's environment.
    pub fn start_with(env: &[(&str, &str)]) -> Self {
        Self::start_on(env, &Servers::default())
    }

    /// [`Stack::start_with`], the services reaching NATS and Postgres where `servers` says.
    pub fn start_on(env: &[(&str, &str)], servers: &Servers) -> Self {
        Self::start_on_prefix(&format!("e2e.{}", uuid::Uuid::new_v4().simple()), env, servers)
    }

    /// [`Stack::start_on`] under the subject prefix `prefix`.
    pub fn start_on_prefix(prefix: &str, env: &[(&str, &str)], servers: &Servers) -> Self {
        let prefix = prefix.to_string();
        let mut common: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model");
        keel_model_init(&model);
        let database = TestDatabase::new("keel_e2e");
        let database_url = match &servers.postgres {
            Some(addr) => database.url_at(addr),
            None => database.url.clone(),
        };
        if let Some(url) = &servers.nats_url {
            for service in ["CHECKPOINT", "TRAINER", "GENERATOR", "REWARD", "ORCHESTRATOR"] {
                common.push((format!("KEEL_{service}__NATS_URL"), url.clone()));
            }
        }
        let blobs = dir.path().join("blobs");
        let pairs = |own: &[(&str, &str)]| -> Vec<(String, String)> {
            own.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        let mut own_env = BTreeMap::from([
            ("orchestrator", Vec::new()),
            (
                "checkpoint",
                pairs(&[
                    ("KEEL_CHECKPOINT__DATABASE_URL", &database_url),
                    ("KEEL_CHECKPOINT__STORAGE__KIND", "local"),
                    ("KEEL_CHECKPOINT__STORAGE__ROOT", blobs.to_str().unwrap()),
                    ("KEEL_CHECKPOINT__SUBJECT_PREFIX", &prefix),
                ]),
            ),
            ("trainer", pairs(&[("KEEL_TRAINER__SUBJECT_PREFIX", &prefix)])),
            (
                "generator",
                // A fixed id: started again, the generator answers its run's heartbeat that it no
                // longer holds the run (the run resumes on it at once).
                pairs(&[
                    ("KEEL_GENERATOR__SUBJECT_PREFIX", &prefix),
                    ("KEEL_GENERATOR__MODEL", model.to_str().unwrap()),
                    ("KEEL_GENERATOR__GENERATOR_ID", "g0"),
                ]),
            ),
            ("reward", pairs(&[("KEEL_REWARD__SUBJECT_PREFIX", &prefix)])),
        ]);
        for (service, url) in &servers.nats_urls {
            let env = own_env.get_mut(service).unwrap_or_else(|| panic!("no service `{service}`"));
            env.push((format!("KEEL_{}__NATS_URL", service.to_uppercase()), url.clone()));
        }
        let start = |service: &str| start_service(service, &[common.as_slice(), &own_env[service]].concat());
        let (checkpoint, trainer, generator, reward) =
            (start("checkpoint"), start("trainer"), start("generator"), start("reward"));
        let mut stack = Self {
            prefix,
            database,
            database_url,
            dir,
            model,
            checkpoint,
            trainer,
            generator,
            reward,
            orchestrator: None,
            http: reqwest::Client::new(),
            env: common,
            own_env,
        };
        stack.start_orchestrator();
        stack
    }

    /// The orchestrator's environment.
    pub fn orchestrator_env(&self) -> Vec<(String, String)> {
        let work = self.dir.path().join("work");
        let mut env: Vec<(String, String)> = [
            ("KEEL_ORCHESTRATOR__DATABASE_URL", self.database_url.as_str()),
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
        env.extend(self.own_env["orchestrator"].iter().cloned());
        env
    }

    /// (Re)starts the orchestrator; a run it finds orphaned is resumed within two seconds.
    pub fn start_orchestrator(&mut self) {
        self.orchestrator = Some(start_service("orchestrator", &self.orchestrator_env()));
    }

    /// The process of one of the four worker services.
    pub fn process(&mut self, service: &str) -> &mut ServiceProcess {
        match service {
            "checkpoint" => &mut self.checkpoint,
            "trainer" => &mut self.trainer,
            "generator" => &mut self.generator,
            "reward" => &mut self.reward,
            other => panic!("no service `{other}` in the stack"),
        }
    }

    /// Starts `service` again (after [`ServiceProcess::kill`]) on the address it had, with
    /// the environment it had.
    pub fn start_again(&mut self, service: &str) {
        let listen = self.process(service).url.trim_start_matches("http://").to_string();
        let mut env = [self.env.as_slice(), &self.own_env[service]].concat();
        env.push((format!("KEEL_{}__LISTEN", service.to_uppercase()), listen));
        *self.process(service) = start_service(service, &env);
    }

    /// Another process of `service` on the stack, with the environment the stack's own has
    /// less the variables `without` names, plus `env`.
    pub fn start_another(&self, service: &str, without: &[&str], env: &[(&str, &str)]) -> ServiceProcess {
        let mut all: Vec<(String, String)> = [self.env.as_slice(), &self.own_env[service]]
            .concat()
            .into_iter()
            .filter(|(k, _)| !without.contains(&k.as_str()))
            .collect();
        all.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        start_service(service, &all)
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
