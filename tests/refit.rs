//! Weights-only refits in memory, between a trainer and a generator as processes: after one
//! training step the trainer exports the policy's weights (in small buckets through the
//! object store), the generator loads them, and the logprobs it reports for its greedy
//! samples equal the trainer's for the same tokens to 1e-5 (f32) — at generator TP 1 and 2,
//! with trainer TP 1 and 2, through the object store, through shared memory and sent by the
//! trainer over a communicator (the collective transfer, TCP between the two processes on
//! the CPU), and for a LoRA run, whose refits carry the adapters only. A refit whose buckets
//! cannot all be fetched leaves the old version serving, and the next one succeeds. A
//! generator keeps the communicator of the collective transfer for the next refits, and forms
//! a new one when the trainer was started again.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use keel_protocol::generator::{BucketAt, WeightsLoaded, WeightsUpdated};
use keel_protocol::subjects::{GeneratorOp, TrainerOp};
use keel_protocol::trainer::{
    ExportReply, ExportRequest, ExportTo, LogprobsReply, LogprobsRequest, Scorer, SendAccepted, SendWeights, Sequences,
    TrainBatch, TrainRequest,
};
use keel_protocol::{Payload, Reply, Subjects};
use keel_testkit::{ServiceProcess, keel_model_init};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

struct Pair {
    nats: async_nats::Client,
    subjects: Subjects,
    worker: String,
    trainer: ServiceProcess,
    generator: ServiceProcess,
}

impl Pair {
    async fn start(model: &std::path::Path, generator_tp: usize) -> Self {
        let prefix = format!("refit.{}", uuid::Uuid::new_v4().simple());
        let worker = format!("w{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let trainer = ServiceProcess::start(
            "trainer",
            &[("KEEL_TRAINER__SUBJECT_PREFIX", &prefix), ("KEEL_TRAINER__WORKER_ID", &worker)],
        );
        let tp = generator_tp.to_string();
        let generator = ServiceProcess::start(
            "generator",
            &[
                ("KEEL_GENERATOR__SUBJECT_PREFIX", &prefix),
                ("KEEL_GENERATOR__MODEL", model.to_str().unwrap()),
                ("KEEL_GENERATOR__TENSOR_PARALLEL_SIZE", &tp),
            ],
        );
        let nats = keel_service::nats::connect(&keel_service::nats::default_url()).await.unwrap();
        let pair = Self { nats, subjects: Subjects::new(&prefix).unwrap(), worker, trainer, generator };
        // Run `r` holds the generator, which serves the run's model (its start-up model, as
        // loaded).
        let claimed: Value = pair.call(pair.subjects.generator_claim(), &json!({"run_id": "r"})).await.unwrap();
        let id = claimed["worker_id"].as_str().unwrap().to_string();
        let load = json!({"run_id": "r", "path": model});
        let _: Value = pair.call(pair.subjects.generator(&id, GeneratorOp::Load), &load).await.unwrap();
        pair
    }

    /// How many communicators the generator has formed with trainers (its `/metrics`).
    async fn links_formed(&self) -> u64 {
        let metrics = reqwest::get(format!("{}/metrics", self.generator.url)).await.unwrap().text().await.unwrap();
        let line = metrics.lines().find(|l| l.starts_with("keel_generator_weight_links_formed_total "));
        line.and_then(|l| l.split(' ').nth(1))
            .unwrap_or_else(|| panic!("no links counter in {metrics}"))
            .parse()
            .unwrap()
    }

    /// Stops the trainer and starts it again with the same worker id (a new process: no
    /// claim, no model, no exports, no communicators).
    fn restart_trainer(&mut self) {
        let prefix = self.subjects.prefix().to_string();
        self.trainer.kill();
        self.trainer = ServiceProcess::start(
            "trainer",
            &[("KEEL_TRAINER__SUBJECT_PREFIX", &prefix), ("KEEL_TRAINER__WORKER_ID", &self.worker)],
        );
    }

    async fn call<Rep: DeserializeOwned>(&self, subject: String, body: &impl serde::Serialize) -> Result<Rep, Value> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let payload = serde_json::to_vec(body).unwrap();
            match self.nats.request(subject.clone(), payload.into()).await {
                Ok(reply) => {
                    return match serde_json::from_slice::<Reply<Rep>>(&reply.payload).unwrap() {
                        Reply::Ok(value) => Ok(value),
                        Reply::Error(e) => Err(serde_json::to_value(&e).unwrap()),
                    };
                }
                // The generator may still be subscribing.
                Err(e) => assert!(Instant::now() < deadline, "{subject}: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn trainer<Rep: DeserializeOwned>(&self, op: TrainerOp, body: &impl serde::Serialize) -> Rep {
        self.call(self.subjects.trainer(&self.worker, op), body).await.unwrap_or_else(|e| panic!("{op:?}: {e}"))
    }

    /// A greedy rollout once the generator serves `version` (0: the run's model as loaded):
    /// the prompt and tokens, and the tokens' logprobs.
    async fn rollout(&self, version: u64) -> (Vec<i64>, Vec<f64>) {
        let request = json!({"run_id": "r", "prompt_token_ids": [5, 88, 17, 201, 33], "n": 1, "max_tokens": 8,
            "sampling": {"temperature": 1.0, "top_k": 1}, "ignore_eos": true, "min_weight_version": version});
        let deadline = Instant::now() + Duration::from_secs(60);
        let reply: Value = loop {
            match self.call::<Value>(self.subjects.generate("r"), &request).await {
                Ok(reply) => break reply,
                Err(e) if e["type"] == "stale_weights" => {
                    assert!(Instant::now() < deadline, "the generator never served version {version}")
                }
                Err(e) => panic!("rollout: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(reply["weight_version"], version);
        let sample = &reply["samples"][0];
        let tokens: Vec<i64> = serde_json::from_value(sample["token_ids"].clone()).unwrap();
        let logprobs: Vec<f64> = serde_json::from_value(sample["logprobs"].clone()).unwrap();
        ([vec![5, 88, 17, 201, 33], tokens].concat(), logprobs)
    }

    /// Publishes `event` with a reply subject and returns the generator's report of it.
    async fn publish(&self, event: &WeightsUpdated) -> WeightsLoaded {
        let body = serde_json::to_vec(event).unwrap().into();
        let reply = self.nats.request(self.subjects.weights_updated(&event.run_id), body).await.unwrap();
        let report: WeightsLoaded = serde_json::from_slice(&reply.payload).unwrap();
        assert_eq!((report.run_id.as_str(), report.version), (event.run_id.as_str(), event.version));
        report
    }
}

/// How an export reaches the generator.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Through {
    Objects,
    SharedMemory,
    Collective,
}

/// One training step, an export in 64 KiB buckets (objects, files in shared memory, or a
/// buffer the trainer sends), a refit, and the logprobs compared.
async fn refit_matches_the_trainer(
    model: &std::path::Path,
    generator_tp: usize,
    trainer_tp: usize,
    through: Through,
    lora: bool,
) {
    let pair = Pair::start(model, generator_tp).await;
    let _: Value = pair.call(pair.subjects.trainer_claim(), &json!({"run_id": "r"})).await.unwrap();
    let mut training = json!({"loss": {"type": "nll"}, "global_batch_size": 2, "micro_batch_size": 2,
        "optimizer": {"lr": 0.05, "weight_decay": 0.0}});
    if lora {
        training["lora"] =
            json!({"enabled": true, "rank": 4, "alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]});
    }
    let load = json!({"run_id": "r", "policy": {"path": model}, "training": training, "seed": 1,
        "tensor_parallel_size": trainer_tp});
    let _: Value = pair.trainer(TrainerOp::Load, &load).await;
    let input_ids = vec![(10..30).collect::<Vec<i64>>(), (40..60).collect()];
    let token_mask = input_ids.iter().map(|r| vec![1.0; r.len()]).collect();
    let batch = TrainBatch { input_ids, token_mask, ..Default::default() };
    let train = TrainRequest { run_id: "r".into(), batch: Payload::Inline(batch), temperature: 1.0 };
    let _: Value = pair.trainer(TrainerOp::Train, &train).await;
    let shared_dir = (through == Through::SharedMemory)
        .then(|| format!("{}/test-{}", keel_service::paths::SHARED_WEIGHTS_DIR, uuid::Uuid::new_v4().simple()));
    let to = match (&shared_dir, through) {
        (Some(dir), _) => ExportTo::SharedMemory { dir: dir.clone() },
        (None, Through::Collective) => ExportTo::Collective,
        (None, _) => ExportTo::ObjectStore,
    };
    let export = ExportRequest { run_id: "r".into(), dtype: Some("f32".into()), bucket_bytes: 64 << 10, to };
    let mut export = export;
    if lora {
        export.bucket_bytes = 8 << 10;
    }
    // CUDA IPC shares GPU memory: a trainer on the CPU says so.
    let ipc = ExportRequest { to: ExportTo::CudaIpc, ..export.clone() };
    let refused = pair.call::<ExportReply>(pair.subjects.trainer(&pair.worker, TrainerOp::Export), &ipc).await;
    let refused = refused.expect_err("a CPU trainer refuses a CUDA IPC export");
    assert!(refused.to_string().contains("CUDA IPC") && refused.to_string().contains("Cpu"), "{refused}");
    let exported: ExportReply = pair.trainer(TrainerOp::Export, &export).await;
    assert!(exported.weights.buckets.len() > 1, "small buckets split the export");
    let names: Vec<&str> =
        exported.weights.buckets.iter().flat_map(|b| b.tensors.iter().map(|t| t.name.as_str())).collect();
    if lora {
        let lora = exported.weights.lora.as_ref().expect("a LoRA export says so");
        assert_eq!(lora.scale, 4.0, "alpha / rank");
        assert_eq!(std::path::Path::new(&lora.base).canonicalize().unwrap(), model.canonicalize().unwrap());
        assert!(names.iter().all(|n| n.contains(".lora_A.") || n.contains(".lora_B.")), "adapters only: {names:?}");
    } else {
        assert_eq!(exported.weights.lora, None);
        assert!(names.contains(&"model.embed_tokens.weight"), "{names:?}");
    }

    if through == Through::Collective {
        refuses_what_it_cannot_send(&pair, &exported).await;
    }

    // A refit whose buckets are not all there is refused; the base weights keep serving.
    let mut broken = exported.weights.clone();
    if through == Through::Collective {
        // An export the trainer does not keep: it refuses to send it.
        for bucket in &mut broken.buckets {
            let BucketAt::Collective(sent) = &mut bucket.at else { panic!("a bucket of a collective export") };
            sent.export = "gone".into();
        }
    } else {
        match &mut broken.buckets[1].at {
            BucketAt::Object(object) => object.name = "gone".into(),
            BucketAt::File(file) => file.push_str(".gone"),
            other => panic!("a bucket is an object or a file, not {other:?}"),
        }
    }
    let report = pair
        .publish(&WeightsUpdated {
            run_id: "r".into(),
            version: 1,
            path: String::new(),
            weights: Some(broken),
            refit_mode: None,
        })
        .await;
    let failure = report.error.clone().unwrap_or_else(|| panic!("the generator reports the failed refit: {report:?}"));
    if through == Through::Collective {
        assert!(failure.contains("export gone is not kept"), "{failure}");
    }
    let (base_tokens, _) = pair.rollout(0).await;
    let reply = loop {
        let request = json!({"run_id": "r", "prompt_token_ids": [5, 88], "max_tokens": 2, "min_weight_version": 1});
        match pair.call::<Value>(pair.subjects.generate("r"), &request).await {
            Err(e) if e["type"] == "stale_weights" => tokio::time::sleep(Duration::from_millis(100)).await,
            other => break other,
        }
    };
    let error = reply.unwrap_err();
    assert_eq!(error["type"], "refit_failed", "{error}");
    let (still, _) = pair.rollout(0).await;
    assert_eq!(still, base_tokens, "the old version serves after a failed refit");

    let collective = exported.weights.buckets[0].at.collective().cloned();
    let event = WeightsUpdated {
        run_id: "r".into(),
        version: 2,
        path: String::new(),
        weights: Some(exported.weights),
        refit_mode: None,
    };
    let report = pair.publish(&event).await;
    assert!(report.error.is_none() && report.seconds > 0.0, "the generator reports the refit done: {report:?}");
    assert_eq!(report.dtype.as_deref(), Some("float32"), "and the dtype it serves in (f32 on a CPU)");
    let (sequence, generated) = pair.rollout(2).await;
    if through == Through::Collective {
        // The next refit goes over the communicator the generator kept with the trainer.
        let report = pair.publish(&WeightsUpdated { version: 3, ..event.clone() }).await;
        assert!(report.error.is_none(), "a refit over the kept communicator: {report:?}");
        let (again, _) = pair.rollout(3).await;
        assert_eq!(again, sequence, "the same weights serve the same greedy tokens");
        assert_eq!(pair.links_formed().await, 1, "the second refit went over the communicator of the first");
    }
    let request = LogprobsRequest {
        run_id: "r".into(),
        model: Scorer::Policy,
        batch: Payload::Inline(Sequences { input_ids: vec![sequence.clone()] }),
        temperature: 1.0,
    };
    let reply: LogprobsReply = pair.trainer(TrainerOp::Logprobs, &request).await;
    let Payload::Inline(logprobs) = reply.logprobs else { panic!("a small reply is inline") };
    let trained = &logprobs.logprobs[0][5..];
    assert_eq!(trained.len(), generated.len());
    let diff = trained.iter().zip(&generated).map(|(t, g)| (f64::from(*t) - g).abs()).fold(0.0, f64::max);
    let through = match through {
        Through::SharedMemory => "shared memory",
        Through::Objects => "the object store",
        Through::Collective => "a communicator (TCP)",
    };
    let through = if lora { format!("{through}, LoRA adapters") } else { through.to_string() };
    eprintln!(
        "generator TP {generator_tp}, trainer TP {trainer_tp}, through {through}: {} logprobs, largest difference {diff:e}",
        trained.len()
    );
    assert!(
        diff <= 1e-5,
        "generator TP {generator_tp}, trainer TP {trainer_tp}, through {through}: logprobs differ by {diff:e}\n{trained:?}\n{generated:?}"
    );
    // Letting the worker go removes the run's exports in shared memory, and frees those it
    // kept to send.
    let _: Value = pair.trainer(TrainerOp::Release, &json!({"run_id": "r"})).await;
    if let Some(first) = collective {
        let request = SendWeights {
            export: first.export,
            session: "s2".into(),
            device: "cpu".into(),
            ranges: vec![],
            reuse: false,
        };
        let subject = pair.subjects.trainer_send_weights(&pair.worker);
        let refused = pair.call::<SendAccepted>(subject, &request).await.expect_err("the export is freed");
        assert!(refused["message"].as_str().unwrap().contains("is not kept"), "{refused}");
    }
    if let Some(dir) = shared_dir {
        assert!(!std::path::Path::new(&dir).exists(), "{dir} is removed when the run releases the worker");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn after_a_weights_only_refit_the_generator_scores_as_the_trainer() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    keel_model_init(&model);
    for (generator_tp, trainer_tp, through, lora) in [
        (1, 1, Through::Objects, false),
        (2, 1, Through::Objects, false),
        (2, 2, Through::Objects, false),
        (1, 1, Through::SharedMemory, false),
        (2, 2, Through::SharedMemory, false),
        (1, 1, Through::Collective, false),
        (2, 1, Through::Collective, false),
        (2, 2, Through::Collective, false),
        (1, 1, Through::Objects, true),
        (2, 1, Through::SharedMemory, true),
        (1, 1, Through::Collective, true),
    ] {
        refit_matches_the_trainer(&model, generator_tp, trainer_tp, through, lora).await;
    }
}

/// The trainer's refusals of a request to send an export, each naming what is wrong: a
/// generator on another kind of device, a range outside the export, a session that is not a
/// subject token.
async fn refuses_what_it_cannot_send(pair: &Pair, exported: &ExportReply) {
    let first = exported.weights.buckets[0].at.collective().cloned().expect("a bucket of a collective export");
    assert_eq!(first.device, "cpu");
    let subject = pair.subjects.trainer_send_weights(&pair.worker);
    assert_eq!(first.subject, subject);
    let request = SendWeights {
        export: first.export.clone(),
        session: "s1".into(),
        device: "cuda".into(),
        ranges: vec![(first.offset, exported.weights.buckets[0].bytes)],
        reuse: false,
    };
    let refusals = [
        (request.clone(), "the export is in cpu memory and the generator receives on `cuda`"),
        (SendWeights { device: "cpu".into(), ranges: vec![(0, 1 << 40)], ..request.clone() }, "is not inside"),
        (SendWeights { device: "cpu".into(), session: "a.b".into(), ..request.clone() }, "session `a.b`"),
        (SendWeights { device: "cpu".into(), reuse: true, ..request.clone() }, "keeps no communicator of session s1"),
    ];
    for (request, expected) in refusals {
        let refused = pair.call::<SendAccepted>(subject.clone(), &request).await.expect_err("refused");
        let kind = if request.reuse { "unknown_session" } else { "invalid_request" };
        assert_eq!(refused["type"], kind, "{refused}");
        assert!(refused["message"].as_str().unwrap().contains(expected), "{refused}");
    }
}

/// A generator keeps the communicator it formed with a trainer for the next refits; when the
/// trainer was started again (it keeps none), the generator's next refit forms a new one and
/// succeeds, and the one after it goes over that one.
#[tokio::test(flavor = "multi_thread")]
async fn a_generator_forms_a_new_communicator_with_a_restarted_trainer() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    keel_model_init(&model);
    let mut pair = Pair::start(&model, 1).await;
    let mut version = 0;
    for restarted in [false, true] {
        if restarted {
            pair.restart_trainer();
        }
        let _: Value = pair.call(pair.subjects.trainer_claim(), &json!({"run_id": "r"})).await.unwrap();
        let load = json!({"run_id": "r", "policy": {"path": model}, "training": {"loss": {"type": "nll"},
            "global_batch_size": 2, "micro_batch_size": 2}});
        let _: Value = pair.trainer(TrainerOp::Load, &load).await;
        let export = ExportRequest {
            run_id: "r".into(),
            dtype: Some("f32".into()),
            bucket_bytes: 64 << 10,
            to: ExportTo::Collective,
        };
        let exported: ExportReply = pair.trainer(TrainerOp::Export, &export).await;
        // Twice: over a new communicator (or a kept one the trainer no longer has), then the
        // kept one.
        for _ in 0..2 {
            version += 1;
            let event = WeightsUpdated {
                run_id: "r".into(),
                version,
                path: String::new(),
                weights: Some(exported.weights.clone()),
                refit_mode: None,
            };
            let report = pair.publish(&event).await;
            assert!(report.error.is_none(), "refit {version} (trainer restarted: {restarted}): {report:?}");
            pair.rollout(version).await;
        }
        // One communicator formed per trainer process: the second refit went over it.
        assert_eq!(pair.links_formed().await, 1 + u64::from(restarted));
    }
}
