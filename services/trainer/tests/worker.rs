//! The trainer worker against the real NATS server: claim, load, logprobs (inline and by
//! object-store reference), train, save, release; typed errors for malformed requests while
//! the worker keeps serving; a second claim refused; an abandoned claim released when its
//! lease runs out; the collective transfer of an export to a generator that leaves midway,
//! and then whole. Each test uses its own subject prefix and worker id.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use keel_protocol::Subjects;
use keel_protocol::subjects::TrainerOp;
use keel_service::nats::Bulk;
use serde_json::{Value, json};

const BUCKET: &str = "keel-test-bulk";

struct Harness {
    client: async_nats::Client,
    subjects: Subjects,
    worker: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<keel_service::Result<()>>,
}

impl Harness {
    async fn start() -> Self {
        let unique = uuid::Uuid::new_v4().simple().to_string();
        let prefix = format!("keeltest.{unique}");
        let worker = format!("w{}", &unique[..8]);
        let mut config = keel_trainer::default_config();
        config.listen = "127.0.0.1:0".parse().unwrap();
        config.subject_prefix = prefix.clone();
        config.worker_id = Some(worker.clone());
        config.bulk_bucket = BUCKET.into();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(keel_trainer::run(config, async move {
            let _ = stopped.await;
        }));
        let client = keel_service::nats::connect(&keel_service::nats::default_url()).await.unwrap();
        let harness = Self { client, subjects: Subjects::new(&prefix).unwrap(), worker, stop: Some(stop), task };
        // Ready once the worker answers on its own subject.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let subject = harness.subjects.trainer(&harness.worker, TrainerOp::Heartbeat);
            let answer = tokio::time::timeout(
                Duration::from_secs(1),
                harness.client.request(subject, json!({"run_id": "nobody"}).to_string().into()),
            )
            .await;
            if matches!(answer, Ok(Ok(_))) {
                break;
            }
            assert!(Instant::now() < deadline, "the worker did not come up");
        }
        harness
    }

    async fn raw(&self, op: TrainerOp, body: String) -> Value {
        let subject = self.subjects.trainer(&self.worker, op);
        // The client's own request timeout (10 s by default) is lifted to the 120 s this
        // waits: a step on a loaded 2-core machine can take longer than 10 s.
        let request = async_nats::Request::new().payload(body.into()).timeout(Some(Duration::from_secs(120)));
        let reply = tokio::time::timeout(Duration::from_secs(121), self.client.send_request(subject, request))
            .await
            .expect("reply within 120 s")
            .expect("request");
        serde_json::from_slice(&reply.payload).unwrap()
    }

    async fn call(&self, op: TrainerOp, body: Value) -> Value {
        self.raw(op, body.to_string()).await
    }

    /// A request made for `holder` (the header a run's driver sends).
    async fn call_as(&self, holder: &str, op: TrainerOp, body: Value) -> Value {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(keel_protocol::trainer::HOLDER_HEADER, holder);
        let subject = self.subjects.trainer(&self.worker, op);
        let reply = self.client.request_with_headers(subject, headers, body.to_string().into()).await.unwrap();
        serde_json::from_slice(&reply.payload).unwrap()
    }

    async fn ok(&self, op: TrainerOp, body: Value) -> Value {
        let reply = self.call(op, body).await;
        assert!(reply.get("ok").is_some(), "{op:?} failed: {reply}");
        reply["ok"].clone()
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap().unwrap();
    }
}

fn error_type(reply: &Value) -> &str {
    reply["error"]["type"].as_str().unwrap_or_else(|| panic!("expected an error reply, got {reply}"))
}

fn sft_training() -> Value {
    json!({"loss": {"type": "nll"}, "global_batch_size": 4, "micro_batch_size": 2, "optimizer": {"lr": 1e-3}})
}

/// Four counting sequences of 8 tokens; the first 2 of each are the prompt.
fn small_batch() -> Value {
    let input_ids: Vec<Vec<i64>> = [20, 40, 60, 80].iter().map(|&s| (s..s + 8).collect()).collect();
    let mask = [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0];
    json!({"input_ids": input_ids, "token_mask": vec![mask; 4]})
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_drives_a_worker_from_claim_to_release() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    keel_testkit::keel_model_init(&model);
    let h = Harness::start().await;

    // Claim through the queue group: the free worker answers with its id.
    let claim = h
        .client
        .request(h.subjects.trainer_claim(), json!({"run_id": "run-a", "lease_seconds": 30}).to_string().into())
        .await
        .unwrap();
    let claim: Value = serde_json::from_slice(&claim.payload).unwrap();
    assert_eq!(claim["ok"]["worker_id"], h.worker.as_str(), "{claim}");

    // Requests before load, or from another run, are refused.
    let reply = h.call(TrainerOp::Train, json!({"run_id": "run-a", "batch": {"inline": small_batch()}})).await;
    assert_eq!(error_type(&reply), "not_loaded");
    let reply =
        h.call(TrainerOp::Load, json!({"run_id": "run-b", "policy": {"path": "/x"}, "training": sft_training()})).await;
    assert_eq!(error_type(&reply), "wrong_run");

    // Bad configurations are refused at load, every problem named.
    let mut bad = sft_training();
    bad["loss"] = json!({"type": "clipped_pg", "ratio_clip_c": 0.5, "sequence_level_importance_ratios": true,
        "use_importance_sampling_correction": true, "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio_min": 3.0, "truncated_importance_sampling_ratio_max": 2.0});
    let reply = h.call(TrainerOp::Load, json!({"run_id": "run-a", "policy": {"path": model}, "training": bad})).await;
    assert_eq!(error_type(&reply), "invalid_config");
    let message = reply["error"]["message"].as_str().unwrap();
    for field in [
        "training.loss.ratio_clip_c",
        "training.loss.sequence_level_importance_ratios",
        "training.loss.truncated_importance_sampling_ratio_min",
    ] {
        assert!(message.contains(field), "{field} not in {message}");
    }
    let mut unknown = sft_training();
    unknown["loss"] = json!({"type": "ppo-magic"});
    let reply =
        h.call(TrainerOp::Load, json!({"run_id": "run-a", "policy": {"path": model}, "training": unknown})).await;
    assert_eq!(error_type(&reply), "invalid_request");
    assert!(reply["error"]["message"].as_str().unwrap().contains("ppo-magic"), "{reply}");
    // A model that is not there (inside the worker's path roots) fails to load.
    let missing = std::env::temp_dir().join(format!("keel-no-model-{}", uuid::Uuid::new_v4().simple()));
    let reply = h
        .call(TrainerOp::Load, json!({"run_id": "run-a", "policy": {"path": missing}, "training": sft_training()}))
        .await;
    assert_eq!(error_type(&reply), "load_failed");

    let loaded =
        h.ok(TrainerOp::Load, json!({"run_id": "run-a", "policy": {"path": model}, "training": sft_training()})).await;
    assert!(loaded["parameters"].as_i64().unwrap() > 10_000, "{loaded}");
    assert_eq!(loaded["step"], 0);

    // Logprobs inline.
    let lp = h
        .ok(
            TrainerOp::Logprobs,
            json!({"run_id": "run-a", "batch": {"inline": {"input_ids": [[5, 6, 7], [8, 9]]}}, "temperature": 0.8}),
        )
        .await;
    let rows = lp["logprobs"]["inline"]["logprobs"].as_array().unwrap();
    assert_eq!((rows[0].as_array().unwrap().len(), rows[1].as_array().unwrap().len()), (3, 2));
    assert_eq!(rows[0][0], 0.0);
    assert!(rows[0][1].as_f64().unwrap() < 0.0);

    // Malformed requests get typed errors, and the worker keeps serving.
    let mut mismatched = small_batch();
    mismatched["token_mask"][1] = json!([0.0, 1.0]);
    let reply = h.call(TrainerOp::Train, json!({"run_id": "run-a", "batch": {"inline": mismatched}})).await;
    assert_eq!(error_type(&reply), "invalid_request");
    assert!(reply["error"]["message"].as_str().unwrap().contains("token_mask row 1 has 2 entries"), "{reply}");
    let reply = h
        .raw(
            TrainerOp::Train,
            r#"{"run_id": "run-a", "batch": {"inline": {"input_ids": [[1, 2]], "token_mask": [[0, NaN]]}}}"#.into(),
        )
        .await;
    assert_eq!(error_type(&reply), "invalid_request");
    let reply = h.raw(TrainerOp::Train, "not json".into()).await;
    assert_eq!(error_type(&reply), "invalid_request");
    let mut out_of_vocab = small_batch();
    out_of_vocab["input_ids"][0][3] = json!(1_000_000);
    let reply = h.call(TrainerOp::Train, json!({"run_id": "run-a", "batch": {"inline": out_of_vocab}})).await;
    assert_eq!(error_type(&reply), "invalid_request");
    assert!(reply["error"]["message"].as_str().unwrap().contains("1000000"), "{reply}");
    let reply = h.call(TrainerOp::Train, json!({"run_id": "someone-else", "batch": {"inline": small_batch()}})).await;
    assert_eq!(error_type(&reply), "wrong_run");

    let trained = h.ok(TrainerOp::Train, json!({"run_id": "run-a", "batch": {"inline": small_batch()}})).await;
    assert_eq!(trained["steps"].as_array().unwrap().len(), 1, "{trained}");
    assert!(trained["steps"][0]["metrics"]["loss"].as_f64().unwrap() > 0.0);
    assert!(trained["memory"]["rss_bytes"].as_u64().unwrap() > 0);
    let beat = h.ok(TrainerOp::Heartbeat, json!({"run_id": "run-a"})).await;
    assert_eq!(beat["loaded"], true);

    // A batch over 1 MiB goes by reference, and so does the reply.
    let bulk = Bulk::open(h.client.clone(), BUCKET).await.unwrap();
    let big: Vec<Vec<i64>> = (0..300).map(|r| (0..1000).map(|i| 100 + (r * 7 + i) % 300).collect()).collect();
    let bytes = serde_json::to_vec(&json!({"input_ids": big})).unwrap();
    assert!(bytes.len() > 1 << 20);
    let object = bulk.put(&bytes).await.unwrap();
    let lp = h.ok(TrainerOp::Logprobs, json!({"run_id": "run-a", "batch": {"object": object}})).await;
    let rows: keel_protocol::trainer::Logprobs =
        bulk.fetch(serde_json::from_value(lp["logprobs"].clone()).unwrap()).await.unwrap();
    assert!(lp["logprobs"].get("object").is_some(), "a 3 MB reply must travel by reference");
    assert_eq!(rows.logprobs.len(), 300);
    assert!(rows.logprobs.iter().all(|r| r.len() == 1000));

    let ckpt = dir.path().join("ckpt-1");
    let saved = h.ok(TrainerOp::Save, json!({"run_id": "run-a", "path": ckpt, "info": {"consumed_samples": 4}})).await;
    assert_eq!(saved["step"], 1);
    assert!(ckpt.join("model.safetensors").is_file() && ckpt.join("trainer_state.json").is_file());
    let reply = h.call(TrainerOp::Save, json!({"run_id": "run-a", "path": ckpt})).await;
    assert_eq!(error_type(&reply), "save_failed");

    h.ok(TrainerOp::Release, json!({"run_id": "run-a"})).await;
    let reply =
        h.call(TrainerOp::Logprobs, json!({"run_id": "run-a", "batch": {"inline": {"input_ids": [[5, 6]]}}})).await;
    assert_eq!(error_type(&reply), "wrong_run");
    // Free again: another run claims it and resumes from the checkpoint.
    h.ok(TrainerOp::Claim, json!({"run_id": "run-c"})).await;
    let loaded = h.ok(TrainerOp::Load, json!({"run_id": "run-c", "policy": {"path": ckpt}, "reference": {"path": model}, "training": sft_training()})).await;
    assert_eq!(loaded["step"], 1);
    let reply =
        h.call(TrainerOp::Score, json!({"run_id": "run-c", "batch": {"inline": {"input_ids": [[5, 6, 7]]}}})).await;
    assert_eq!(error_type(&reply), "invalid_request", "an SFT policy has no value head");
    // A reward-model run gets a value head and scores sequences.
    let rm = json!({"loss": {"type": "bradley_terry"}, "global_batch_size": 2, "micro_batch_size": 2});
    let loaded = h.ok(TrainerOp::Load, json!({"run_id": "run-c", "policy": {"path": model}, "training": rm})).await;
    assert_eq!(loaded["has_value_head"], true);
    let scored = h
        .ok(TrainerOp::Score, json!({"run_id": "run-c", "batch": {"inline": {"input_ids": [[5, 6, 7], [8, 9]]}}}))
        .await;
    assert_eq!(scored["scores"].as_array().unwrap().len(), 2, "{scored}");
    h.ok(TrainerOp::Release, json!({"run_id": "run-c"})).await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_held_worker_refuses_other_claims_until_its_lease_expires() {
    let h = Harness::start().await;
    let claimed = h.ok(TrainerOp::Claim, json!({"run_id": "owner", "lease_seconds": 1.0})).await;
    assert_eq!(claimed["worker_id"], h.worker.as_str());

    let reply = h.call(TrainerOp::Claim, json!({"run_id": "intruder"})).await;
    assert_eq!(error_type(&reply), "busy");
    assert!(reply["error"]["message"].as_str().unwrap().contains("owner"), "{reply}");
    // Claiming again by the same run renews; a lease outside the limits is refused.
    h.ok(TrainerOp::Claim, json!({"run_id": "owner", "lease_seconds": 1.0})).await;
    let reply = h.call(TrainerOp::Claim, json!({"run_id": "owner", "lease_seconds": -1})).await;
    assert_eq!(error_type(&reply), "invalid_request");
    // A held worker has left the queue group: nobody answers a group claim.
    let group = h.client.request(h.subjects.trainer_claim(), json!({"run_id": "intruder"}).to_string().into()).await;
    assert!(group.is_err(), "a held worker answered a group claim: {group:?}");

    // The owner disappears; once the lease runs out the worker is free again.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let reply = h.call(TrainerOp::Claim, json!({"run_id": "intruder"})).await;
        if reply.get("ok").is_some() {
            break;
        }
        assert_eq!(error_type(&reply), "busy");
        assert!(Instant::now() < deadline, "the abandoned claim was never released");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reply = h.call(TrainerOp::Heartbeat, json!({"run_id": "owner"})).await;
    assert_eq!(error_type(&reply), "wrong_run");
    h.stop().await;
}

/// A run's driver whose lease lapsed is replaced by a new claim of the same run: from then
/// on the worker refuses the old holder's requests (a heartbeat, a save, a release) and
/// serves the new one's.
#[tokio::test(flavor = "multi_thread")]
async fn a_newer_holder_of_the_run_fences_out_the_older_one() {
    let h = Harness::start().await;
    h.ok(TrainerOp::Claim, json!({"run_id": "r", "lease_seconds": 30.0, "holder": "first"})).await;
    assert!(h.call_as("first", TrainerOp::Heartbeat, json!({"run_id": "r"})).await.get("ok").is_some());
    h.ok(TrainerOp::Claim, json!({"run_id": "r", "lease_seconds": 30.0, "holder": "second"})).await;
    for op in [TrainerOp::Heartbeat, TrainerOp::Release] {
        let reply = h.call_as("first", op, json!({"run_id": "r"})).await;
        assert_eq!(error_type(&reply), "stale_holder", "{op:?}: {reply}");
        assert!(reply["error"]["message"].as_str().unwrap().contains("second"), "{reply}");
    }
    let save = h.call_as("first", TrainerOp::Save, json!({"run_id": "r", "path": "/tmp/x", "info": {}})).await;
    assert_eq!(error_type(&save), "stale_holder", "{save}");
    let anonymous = h.call(TrainerOp::Heartbeat, json!({"run_id": "r"})).await;
    assert_eq!(error_type(&anonymous), "stale_holder", "a request naming no holder is refused too: {anonymous}");
    assert!(h.call_as("second", TrainerOp::Heartbeat, json!({"run_id": "r"})).await.get("ok").is_some());
    assert!(h.call_as("second", TrainerOp::Release, json!({"run_id": "r"})).await.get("ok").is_some());
    h.stop().await;
}

/// A load or save naming a path outside the worker's roots (default: `.keel`,
/// `/var/lib/keel` and the temporary directory) is refused before anything is read or
/// written, naming the path and the setting.
#[tokio::test(flavor = "multi_thread")]
async fn loads_and_saves_outside_the_path_roots_are_refused() {
    let h = Harness::start().await;
    h.ok(TrainerOp::Claim, json!({"run_id": "r"})).await;
    let load = json!({"run_id": "r", "policy": {"path": "/usr/share"}, "training": sft_training()});
    let reply = h.call(TrainerOp::Load, load).await;
    assert_eq!(error_type(&reply), "invalid_request", "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(message.contains("policy.path: `/usr/share` is outside") && message.contains("KEEL_TRAINER__PATH_ROOTS"));
    let reply = h.call(TrainerOp::Save, json!({"run_id": "r", "path": "/usr/local/keel-save", "info": {}})).await;
    assert_eq!(error_type(&reply), "invalid_request", "{reply}");
    assert!(!std::path::Path::new("/usr/local/keel-save").exists(), "nothing was written");
    let reply = h.call(TrainerOp::Save, json!({"run_id": "r", "path": "/tmp/../etc/keel", "info": {}})).await;
    assert!(reply["error"]["message"].as_str().unwrap().contains("without `..`"), "{reply}");
    // An adapter directory inside the roots whose base model is outside them.
    let adapter = tempfile::tempdir().unwrap();
    let config = json!({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
                        "base_model_name_or_path": "/usr/share"});
    std::fs::write(adapter.path().join("adapter_config.json"), config.to_string()).unwrap();
    let load = json!({"run_id": "r", "policy": {"path": adapter.path()}, "training": sft_training()});
    let reply = h.call(TrainerOp::Load, load).await;
    assert_eq!(error_type(&reply), "invalid_request", "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(message.contains("base_model_name_or_path") && message.contains("`/usr/share` is outside"), "{message}");
    h.stop().await;
}

/// A communicator a generator keeps with the worker: its session and the communicator.
type Link = (String, keel_collective::SharedComm);

/// The generator's side of one collective transfer, played here: asks the worker to send
/// `buckets` of `export` — over `link`, kept from an earlier transfer, or a new communicator
/// — and receives them, keeping at most `keep` of them before leaving (dropping the
/// communicator). Returns the worker's answer, and when it accepted, the buckets received
/// and the link to keep.
async fn receive(
    h: &Harness,
    export: &str,
    buckets: &[(u64, u64)],
    keep: usize,
    link: Option<Link>,
) -> (Value, Vec<tch::Tensor>, Option<Link>) {
    let session = link.as_ref().map_or_else(|| uuid::Uuid::new_v4().simple().to_string(), |(s, _)| s.clone());
    let request =
        json!({"export": export, "session": session, "device": "cpu", "ranges": buckets, "reuse": link.is_some()});
    let answer = h.client.request(h.subjects.trainer_send_weights(&h.worker), request.to_string().into()).await;
    let answer: Value = serde_json::from_slice(&answer.unwrap().payload).unwrap();
    if answer.get("ok").is_none() {
        return (answer, Vec::new(), None);
    }
    let comm = match link {
        Some((_, comm)) => comm,
        None => {
            let meeting = format!("{}.{session}", h.subjects.trainer_weights_meeting(&h.worker));
            let any = std::net::IpAddr::from([0, 0, 0, 0]);
            let timeout = Duration::from_secs(60);
            keel_collective::join_process_group(&h.client, &meeting, 1, 2, tch::Device::Cpu, any, timeout)
                .await
                .unwrap()
        }
    };
    let sizes: Vec<u64> = buckets.iter().map(|(_, bytes)| *bytes).collect();
    let (received, comm) = tokio::task::spawn_blocking(move || {
        let mut received = Vec::new();
        for bytes in sizes.into_iter().take(keep) {
            let mut bucket = tch::Tensor::zeros([bytes as i64], (tch::Kind::Uint8, tch::Device::Cpu));
            comm.broadcast(&mut bucket, 0).unwrap();
            received.push(bucket);
        }
        (received, comm)
    })
    .await
    .unwrap();
    let whole = received.len() == buckets.len();
    (answer, received, whole.then_some((session, comm)))
}

/// The collective transfer from the worker's side: a generator that leaves after the first
/// bucket fails that transfer alone (the worker keeps serving and forgets that
/// communicator); the next transfer of the same export, on a new communicator, arrives
/// whole, every tensor equal to the model's; and the one after it reuses that communicator.
#[tokio::test(flavor = "multi_thread")]
async fn a_generator_that_leaves_midway_fails_its_transfer_alone_and_the_next_arrives_whole() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    keel_testkit::keel_model_init(&model);
    let h = Harness::start().await;
    h.ok(TrainerOp::Claim, json!({"run_id": "run-x"})).await;
    h.ok(TrainerOp::Load, json!({"run_id": "run-x", "policy": {"path": model}, "training": sft_training()})).await;
    let exported = h
        .ok(
            TrainerOp::Export,
            json!({"run_id": "run-x", "dtype": "f32", "bucket_bytes": 64 << 10, "to": {"kind": "collective"}}),
        )
        .await;
    let weights: keel_protocol::generator::WeightBuckets = serde_json::from_value(exported["weights"].clone()).unwrap();
    assert!(weights.buckets.len() > 2, "small buckets split the export");
    let first = weights.buckets[0].at.collective().cloned().expect("a collective export's bucket says where it is");
    assert_eq!((first.device.as_str(), first.gpu_uuid.as_ref()), ("cpu", None));
    let ranges: Vec<(u64, u64)> =
        weights.buckets.iter().map(|b| (b.at.collective().unwrap().offset, b.bytes)).collect();
    let total: u64 = ranges.iter().map(|(_, bytes)| bytes).sum();

    // Asking to reuse a communicator the worker does not keep is refused, naming it.
    let (answer, _, _) = receive(
        &h,
        &first.export,
        &ranges,
        usize::MAX,
        Some(("nope".into(), std::sync::Arc::new(keel_collective::Single))),
    )
    .await;
    assert_eq!(error_type(&answer), "unknown_session", "{answer}");

    let (answer, partial, _) = receive(&h, &first.export, &ranges, 1, None).await;
    assert_eq!(answer["ok"]["bytes"], total, "{answer}");
    assert_eq!(partial.len(), 1, "the generator left after the first bucket");
    h.ok(TrainerOp::Heartbeat, json!({"run_id": "run-x"})).await;

    let (answer, received, link) = receive(&h, &first.export, &ranges, usize::MAX, None).await;
    assert_eq!(answer["ok"]["bytes"], total, "{answer}");
    assert!(partial[0].equal(&received[0]), "the bucket received before leaving was whole");
    let stored = tch::Tensor::read_safetensors(model.join("model.safetensors")).unwrap();
    let stored: std::collections::HashMap<String, tch::Tensor> = stored.into_iter().collect();
    let mut compared = 0;
    for (bucket, flat) in weights.buckets.iter().zip(&received) {
        for (name, tensor) in keel_model::packing::unpack_tensor(flat, &bucket.tensors, tch::Kind::Float).unwrap() {
            if let Some(original) = stored.get(&name) {
                assert!(tensor.equal(&original.to_kind(tch::Kind::Float)), "{name} arrived changed");
                compared += 1;
            }
        }
    }
    assert!(compared >= stored.len() - 1, "{compared} of the model's {} tensors compared", stored.len());

    // The communicator is kept: the next transfer goes over it, the same bytes again.
    let (answer, again, _) = receive(&h, &first.export, &ranges, usize::MAX, link).await;
    assert_eq!(answer["ok"]["bytes"], total, "{answer}");
    assert!(again.iter().zip(&received).all(|(a, b)| a.equal(b)), "the kept communicator carries the same buckets");
    h.ok(TrainerOp::Release, json!({"run_id": "run-x"})).await;
    h.stop().await;
}
