//! The checkpoint service against the real Postgres and NATS: uploads verified and committed,
//! downloads (ranges, tar), identical files stored once, bad input refused without leaving
//! anything visible or leaked, concurrent uploads, retention with leases, and the events.

#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::{Stack, entry, sha256};
use futures::StreamExt;
use keel_protocol::Subjects;
use keel_protocol::checkpoint::Checkpoint;
use serde_json::{Value, json};

struct Client {
    http: reqwest::Client,
    url: String,
}

impl Client {
    fn new(stack: &Stack) -> Self {
        Self { http: reqwest::Client::new(), url: stack.url.clone() }
    }

    async fn create(&self, body: Value) -> (u16, Value) {
        let response = self.http.post(format!("{}/v1/checkpoints", self.url)).json(&body).send().await.unwrap();
        (response.status().as_u16(), response.json().await.unwrap())
    }

    async fn put(&self, id: &str, path: &str, content: &[u8]) -> (u16, String) {
        let url = format!("{}/v1/checkpoints/{id}/files/{path}", self.url);
        let response = self.http.put(url).body(content.to_vec()).send().await.unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    }

    async fn commit(&self, id: &str) -> (u16, Value) {
        let response = self.http.post(format!("{}/v1/checkpoints/{id}/commit", self.url)).send().await.unwrap();
        (response.status().as_u16(), response.json().await.unwrap())
    }

    async fn get(&self, path: &str) -> reqwest::Response {
        self.http.get(format!("{}{path}", self.url)).send().await.unwrap()
    }

    /// Creates, uploads every missing file and commits.
    async fn checkpoint(
        &self,
        run: &str,
        step: u64,
        metrics: Value,
        files: &[(&str, &[u8])],
        retention: Value,
    ) -> Checkpoint {
        let entries: Vec<_> = files.iter().map(|(p, c)| entry(p, c)).collect();
        let body = json!({"run_id": run, "step": step, "metrics": metrics, "files": entries, "retention": retention});
        let (status, created) = self.create(body).await;
        assert_eq!(status, 201, "{created}");
        let id = created["id"].as_str().unwrap().to_string();
        for missing in created["missing"].as_array().unwrap() {
            let path = missing.as_str().unwrap();
            let content = files.iter().find(|(p, _)| *p == path).unwrap().1;
            let (status, text) = self.put(&id, path, content).await;
            assert_eq!(status, 204, "{text}");
        }
        let (status, committed) = self.commit(&id).await;
        assert_eq!(status, 200, "{committed}");
        serde_json::from_value(committed).unwrap()
    }
}

#[tokio::test]
async fn files_round_trip_with_ranges_tar_and_dedupe() {
    let stack = Stack::start().await;
    let c = Client::new(&stack);
    let weights: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let config = br#"{"model_type": "qwen3"}"#;
    let first = c
        .checkpoint(
            "run-a",
            10,
            json!({"acc": 0.5}),
            &[("model.safetensors", &weights), ("config.json", config)],
            Value::Null,
        )
        .await;
    assert_eq!((first.status.as_str(), first.step, first.missing.len()), ("complete", 10, 0));

    let id = first.id;
    let body = c.get(&format!("/v1/checkpoints/{id}/files/model.safetensors")).await;
    assert_eq!(body.headers()["accept-ranges"], "bytes");
    assert_eq!(body.bytes().await.unwrap().as_ref(), &weights[..]);
    let part = c
        .http
        .get(format!("{}/v1/checkpoints/{id}/files/model.safetensors", c.url))
        .header("range", "bytes=1000-1999")
        .send()
        .await
        .unwrap();
    assert_eq!(part.status(), 206);
    assert_eq!(part.headers()["content-range"], format!("bytes 1000-1999/{}", weights.len()));
    assert_eq!(part.bytes().await.unwrap().as_ref(), &weights[1000..2000]);
    let tail = c
        .http
        .get(format!("{}/v1/checkpoints/{id}/files/config.json", c.url))
        .header("range", "bytes=-5")
        .send()
        .await
        .unwrap();
    assert_eq!(tail.bytes().await.unwrap().as_ref(), &config[config.len() - 5..]);
    let bad = c
        .http
        .get(format!("{}/v1/checkpoints/{id}/files/config.json", c.url))
        .header("range", "bytes=9999-")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 416);

    let tar_bytes = c.get(&format!("/v1/checkpoints/{id}/archive")).await.bytes().await.unwrap();
    let mut archive = tar::Archive::new(&tar_bytes[..]);
    let mut seen = Vec::new();
    for member in archive.entries().unwrap() {
        let mut member = member.unwrap();
        let path = member.path().unwrap().display().to_string();
        let mut content = Vec::new();
        member.read_to_end(&mut content).unwrap();
        seen.push((path, sha256(&content)));
    }
    assert_eq!(seen, vec![("config.json".into(), sha256(config)), ("model.safetensors".into(), sha256(&weights))]);

    // The same weights again: stored once, not even sent.
    let (status, second) = c
        .create(json!({"run_id": "run-a", "step": 20, "files": [entry("model.safetensors", &weights), entry("config.json", b"{}")]}))
        .await;
    assert_eq!(status, 201);
    assert_eq!(second["missing"], json!(["config.json"]));
    assert_eq!(stack.blob_count(), 2);

    let latest = c.get("/v1/runs/run-a/checkpoints/latest").await.json::<Checkpoint>().await.unwrap();
    assert_eq!(latest.id, id, "a pending checkpoint is not visible");
    let listed = c.get("/v1/checkpoints?run_id=run-a").await.json::<Vec<Checkpoint>>().await.unwrap();
    assert_eq!(listed.len(), 1);
}

#[tokio::test]
async fn bad_uploads_leave_nothing_visible_or_leaked() {
    let stack = Stack::start().await;
    let c = Client::new(&stack);
    let content = b"the real weights".to_vec();
    let (status, created) =
        c.create(json!({"run_id": "run-b", "step": 1, "files": [entry("model.safetensors", &content)]})).await;
    assert_eq!(status, 201);
    let id = created["id"].as_str().unwrap().to_string();

    let (status, text) = c.put(&id, "model.safetensors", b"forged weights!!").await;
    assert_eq!(status, 422, "{text}");
    assert!(text.contains("sha_mismatch"), "{text}");
    let (status, text) = c.put(&id, "model.safetensors", b"the real weights, and more").await;
    assert_eq!(status, 413, "{text}");
    let (status, text) = c.put(&id, "other.bin", &content).await;
    assert_eq!(status, 404, "undeclared file: {text}");
    let (status, body) = c.commit(&id).await;
    assert_eq!(status, 409);
    assert!(body["error"]["message"].as_str().unwrap().contains("model.safetensors"), "{body}");

    // An upload that stops halfway: the connection closes after half the declared length.
    let address = stack.url.trim_start_matches("http://").to_string();
    let mut socket = std::net::TcpStream::connect(&address).unwrap();
    let head = format!(
        "PUT /v1/checkpoints/{id}/files/model.safetensors HTTP/1.1\r\nhost: {address}\r\ncontent-length: {}\r\n\r\n",
        content.len()
    );
    socket.write_all(head.as_bytes()).unwrap();
    socket.write_all(&content[..content.len() / 2]).unwrap();
    // The upload is under way once its staging file exists; then the client goes away.
    let deadline = Instant::now() + Duration::from_secs(10);
    while stack.staging_count() == 0 {
        assert!(Instant::now() < deadline, "the upload never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(socket);
    let deadline = Instant::now() + Duration::from_secs(10);
    while stack.staging_count() > 0 {
        assert!(Instant::now() < deadline, "the interrupted upload's staging file stayed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(stack.blob_count(), 0, "nothing stored");
    let listed = c.get("/v1/checkpoints?run_id=run-b").await.json::<Vec<Checkpoint>>().await.unwrap();
    assert!(listed.is_empty());
    assert_eq!(c.get(&format!("/v1/checkpoints/{id}/files/model.safetensors")).await.status(), 404);

    // Then the real upload works and the checkpoint commits.
    assert_eq!(c.put(&id, "model.safetensors", &content).await.0, 204);
    assert_eq!(c.commit(&id).await.0, 200);
    assert_eq!(c.commit(&id).await.0, 409, "committed once");
    assert_eq!(c.put(&id, "model.safetensors", &content).await.0, 409, "files of a committed checkpoint do not change");
}

/// Metrics at the ends of f64's range (a fuzzer sent `-1.7976931348623157e308`) come back
/// as they were sent, not as a 500 when the store reads them.
#[tokio::test]
async fn metrics_at_the_ends_of_the_float_range_round_trip() {
    let stack = Stack::start().await;
    let c = Client::new(&stack);
    let metrics = json!({"lowest": f64::MIN, "highest": f64::MAX, "tiny": 5e-324, "loss": 0.25});
    let made = c.checkpoint("extremes", 1, metrics, &[("a.bin", b"x")], Value::Null).await;
    assert_eq!(made.metrics["lowest"], f64::MIN);
    assert_eq!(made.metrics["highest"], f64::MAX);
    assert_eq!(made.metrics["tiny"], 5e-324);
    assert_eq!(made.metrics["loss"], 0.25);
    let listed = c.get("/v1/runs/extremes/checkpoints/latest").await;
    assert_eq!(listed.status(), 200);
    let listed: Checkpoint = listed.json().await.unwrap();
    assert_eq!(listed.metrics, made.metrics);

    // `info` is JSON in Postgres: the number that it would store and then fail to give back
    // (a fuzzer's; the client saw a 500 for a checkpoint that existed) is refused naming its
    // path, and nothing is stored; large numbers that read back are kept.
    let good = entry("a.bin", b"x");
    let info = json!({"fuzz": [-1.7976931348623157e308]});
    let (status, reply) = c.create(json!({"run_id": "fuzzed", "step": 1, "files": [good], "info": info})).await;
    assert_eq!(status, 422, "{reply}");
    assert!(reply["error"]["message"].as_str().unwrap().contains("info.fuzz[0]"), "{reply}");
    let listed = c.get("/v1/checkpoints?run_id=fuzzed").await;
    assert_eq!(listed.json::<Value>().await.unwrap(), json!([]), "the refused checkpoint was stored");
    let good = entry("a.bin", b"x");
    let (status, kept) =
        c.create(json!({"run_id": "fuzzed", "step": 2, "files": [good], "info": {"big": 1e300}})).await;
    assert_eq!(status, 201, "{kept}");
    assert_eq!(kept["info"]["big"], 1e300);
}

#[tokio::test]
async fn bad_requests_name_the_field() {
    let stack = Stack::start().await;
    let c = Client::new(&stack);
    let good = entry("a.bin", b"x");
    let cases = [
        (json!({"run_id": "r", "step": 1, "files": [entry("../../etc/passwd", b"x")]}), "files[0].path"),
        (json!({"run_id": "r", "step": 1, "files": [entry("/abs/path", b"x")]}), "files[0].path"),
        (json!({"run_id": "r", "step": 1, "files": [entry("sp ace.bin", b"x")]}), "files[0].path"),
        (
            json!({"run_id": "r", "step": 1, "files": [{"path": "a.bin", "sha256": "XYZ", "size": 1}]}),
            "files[0].sha256",
        ),
        (json!({"run_id": "r", "step": 1, "files": [good, good]}), "files[1].path"),
        (json!({"run_id": "r", "step": 1, "files": []}), "files"),
        (json!({"run_id": "", "step": 1, "files": [good]}), "run_id"),
        (json!({"run_id": "r", "step": -1, "files": [good]}), "step"),
        (json!({"run_id": "r", "step": 1, "files": [good], "colour": "red"}), "colour"),
    ];
    for (body, needle) in cases {
        let (status, reply) = c.create(body.clone()).await;
        assert_eq!(status, 422, "{body}: {reply}");
        assert!(reply["error"]["message"].as_str().unwrap().contains(needle), "{body}: {reply}");
    }
    assert_eq!(c.get("/v1/checkpoints/not-a-uuid").await.status(), 404);
    let traversal = c.put(&uuid::Uuid::new_v4().to_string(), "..%2F..%2Fetc%2Fpasswd", b"x").await;
    assert_eq!(traversal.0, 422, "{traversal:?}");
    assert!(traversal.1.contains("../../etc/passwd"), "{traversal:?}");
    assert_eq!(stack.blob_count(), 0);
}

/// NUL characters (which Postgres cannot store) are refused with 422, or find nothing;
/// never a 500.
#[tokio::test]
async fn nul_characters_are_refused_or_find_nothing() {
    let stack = Stack::start().await;
    let c = Client::new(&stack);
    let good = entry("a.bin", b"x");
    let cases = [
        (json!({"run_id": "r\u{0}", "step": 1, "files": [good]}), "run_id"),
        (json!({"run_id": "r", "step": 1, "files": [good], "metrics": {"lo\u{0}ss": 1.0}}), "metrics"),
        (json!({"run_id": "r", "step": 1, "files": [good], "info": {"a": ["b\u{0}"]}}), "info"),
        (json!({"run_id": "r", "step": 1, "files": [good], "info": {"k\u{0}": 1}}), "info"),
        (
            json!({"run_id": "r", "step": 1, "files": [good], "retention": {"metric": "m\u{0}", "keep_top_k": 1}}),
            "retention",
        ),
    ];
    for (body, needle) in cases {
        let (status, reply) = c.create(body.clone()).await;
        assert_eq!(status, 422, "{body}: {reply}");
        assert!(reply["error"]["message"].as_str().unwrap().contains(needle), "{body}: {reply}");
    }
    let listed = c.get("/v1/checkpoints?run_id=r%00x").await;
    assert_eq!(listed.status(), 200);
    assert_eq!(listed.json::<Value>().await.unwrap(), json!([]));
    assert_eq!(c.get("/v1/runs/r%00x/checkpoints/latest").await.status(), 404);
    assert_eq!(c.get("/v1/runs/r%00x/checkpoints/best?metric=m").await.status(), 404);
    let made = c.checkpoint("r", 1, json!({}), &[("a.bin", b"x")], Value::Null).await;
    let lease = c
        .http
        .post(format!("{}/v1/checkpoints/{}/leases", c.url, made.id))
        .json(&json!({"holder": "h\u{0}", "seconds": 10}))
        .send()
        .await
        .unwrap();
    assert_eq!(lease.status(), 422);
    assert!(lease.text().await.unwrap().contains("holder"));
}

#[tokio::test]
async fn concurrent_uploads_to_one_run() {
    let stack = Stack::start().await;
    let c = Client::new(&stack);
    let contents: Vec<Vec<u8>> = (0..6u8).map(|i| vec![i; 200_000 + i as usize]).collect();
    let runs = contents.iter().enumerate().map(|(i, content)| {
        let c = &c;
        async move {
            c.checkpoint(
                "run-c",
                i as u64,
                json!({}),
                &[("model.safetensors", content), ("config.json", b"{}")],
                Value::Null,
            )
            .await
        }
    });
    let done = futures::future::join_all(runs).await;
    assert!(done.iter().all(|c| c.status == "complete"));
    let listed = c.get("/v1/checkpoints?run_id=run-c").await.json::<Vec<Checkpoint>>().await.unwrap();
    assert_eq!(listed.iter().map(|c| c.step).collect::<Vec<_>>(), [0, 1, 2, 3, 4, 5]);
    assert_eq!(stack.blob_count(), 7, "six weights and one shared config");
}

#[tokio::test]
async fn retention_keeps_the_best_and_the_latest_and_spares_leased_ones() {
    let stack = Stack::start().await;
    let c = Client::new(&stack);
    let client = keel_service::nats::connect(&keel_service::nats::default_url()).await.unwrap();
    let subjects = Subjects::new(&stack.prefix).unwrap();
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream(subjects.checkpoint_stream()).await.unwrap();
    let consumer =
        stream.create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig::default()).await.unwrap();
    let mut events = consumer.messages().await.unwrap();

    let policy = json!({"keep_top_k": 1, "metric": "acc", "higher_is_better": true});
    let file = |n: u8| vec![n; 1000];
    let one = c.checkpoint("run-d", 1, json!({"acc": 0.9}), &[("w.bin", &file(1))], policy.clone()).await;
    let two = c.checkpoint("run-d", 2, json!({"acc": 0.5}), &[("w.bin", &file(2))], policy.clone()).await;
    // A reader holds step 2, which the next commit makes neither the best nor the latest.
    let lease: Value = c
        .http
        .post(format!("{}/v1/checkpoints/{}/leases", c.url, two.id))
        .json(&json!({"holder": "gen-0", "seconds": 60}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let three = c.checkpoint("run-d", 3, json!({"acc": 0.7}), &[("w.bin", &file(3))], policy.clone()).await;
    let steps = |listed: Vec<Checkpoint>| listed.iter().map(|c| c.step).collect::<Vec<_>>();
    let listed = c.get("/v1/checkpoints?run_id=run-d").await.json::<Vec<Checkpoint>>().await.unwrap();
    assert_eq!(steps(listed), [1, 2, 3], "1 is the best, 2 is leased, 3 the latest");
    assert_eq!(c.http.delete(format!("{}/v1/checkpoints/{}", c.url, two.id)).send().await.unwrap().status(), 409);

    let lease_id = lease["id"].as_str().unwrap();
    let released =
        c.http.delete(format!("{}/v1/checkpoints/{}/leases/{lease_id}", c.url, two.id)).send().await.unwrap();
    assert_eq!(released.status(), 204);
    let listed = c.get("/v1/checkpoints?run_id=run-d").await.json::<Vec<Checkpoint>>().await.unwrap();
    assert_eq!(steps(listed), [1, 3]);
    assert_eq!(stack.blob_count(), 2, "the deleted checkpoint's blob is collected");

    let best = c.get("/v1/runs/run-d/checkpoints/best?metric=acc").await.json::<Checkpoint>().await.unwrap();
    assert_eq!(best.id, one.id);
    let lowest = c.get("/v1/runs/run-d/checkpoints/best?metric=acc&higher_is_better=false").await;
    assert_eq!(lowest.json::<Checkpoint>().await.unwrap().id, three.id);
    assert_eq!(c.get("/v1/runs/run-d/checkpoints/best?metric=loss").await.status(), 404);

    // Events: three created, then step 2 deleted, in order.
    let mut seen = Vec::new();
    while seen.len() < 4 {
        let message = tokio::time::timeout(Duration::from_secs(10), events.next()).await.unwrap().unwrap().unwrap();
        let event: Value = serde_json::from_slice(&message.payload).unwrap();
        seen.push((
            message.subject.to_string().rsplit('.').next().unwrap().to_string(),
            event["step"].as_u64().unwrap(),
        ));
    }
    assert_eq!(seen, [("created".to_string(), 1), ("created".into(), 2), ("created".into(), 3), ("deleted".into(), 2)]);
}

/// A small tmpfs mounted for one test (the test suite runs as root, as CI does here).
struct Mount(std::path::PathBuf);

impl Mount {
    fn tmpfs(at: &std::path::Path, size: &str) -> Self {
        std::fs::create_dir_all(at).unwrap();
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .status();
        assert!(status.is_ok_and(|s| s.success()), "cannot mount a tmpfs at {} (this test needs root)", at.display());
        Self(at.to_path_buf())
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[tokio::test]
async fn a_full_disk_refuses_the_upload_and_keeps_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("small");
    let _mount = Mount::tmpfs(&root, "4m");
    let stack = Stack::start_with(dir, root, 16).await;
    let c = Client::new(&stack);
    let big = vec![7u8; 8 << 20];
    let (status, created) =
        c.create(json!({"run_id": "run-e", "step": 1, "files": [entry("model.safetensors", &big)]})).await;
    assert_eq!(status, 201);
    let id = created["id"].as_str().unwrap().to_string();
    let (status, text) = c.put(&id, "model.safetensors", &big).await;
    assert_eq!(status, 507, "{text}");
    assert!(text.contains("storage_full"), "{text}");
    assert_eq!((stack.staging_count(), stack.blob_count()), (0, 0), "nothing staged or stored is left");
    assert_eq!(c.commit(&id).await.0, 409);
    let listed = c.get("/v1/checkpoints?run_id=run-e").await.json::<Vec<Checkpoint>>().await.unwrap();
    assert!(listed.is_empty());
    // Room again (a small file): the store works.
    let small = b"fits".to_vec();
    let done = c.checkpoint("run-e", 2, json!({}), &[("config.json", &small)], Value::Null).await;
    assert_eq!(done.status, "complete");
}

#[tokio::test]
async fn uploads_beyond_the_slots_get_503_until_one_frees() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("blobs");
    let stack = Stack::start_with(dir, root, 1).await;
    let c = Client::new(&stack);
    let (a, b) = (vec![1u8; 1000], vec![2u8; 1000]);
    let (_, created) =
        c.create(json!({"run_id": "run-f", "step": 1, "files": [entry("a.bin", &a), entry("b.bin", &b)]})).await;
    let id = created["id"].as_str().unwrap().to_string();
    // The first upload holds its slot while its body trickles in.
    let (tx, rx) = futures::channel::mpsc::unbounded::<Result<Vec<u8>, std::io::Error>>();
    let url = format!("{}/v1/checkpoints/{id}/files/a.bin", c.url);
    let slow = tokio::spawn(c.http.put(url).body(reqwest::Body::wrap_stream(rx)).send());
    tx.unbounded_send(Ok(a[..10].to_vec())).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while stack.staging_count() == 0 {
        assert!(Instant::now() < deadline, "the first upload never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, text) = c.put(&id, "b.bin", &b).await;
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("busy"), "{text}");
    tx.unbounded_send(Ok(a[10..].to_vec())).unwrap();
    drop(tx);
    assert_eq!(slow.await.unwrap().unwrap().status(), 204);
    assert_eq!(c.put(&id, "b.bin", &b).await.0, 204, "the slot is free again");
    assert_eq!(c.commit(&id).await.0, 200);
}
