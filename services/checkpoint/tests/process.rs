//! The service as a process: a multi-GB file round-trips bit-exact while the service's peak
//! resident memory stays flat; and a model directory stored as a checkpoint comes back with
//! `keel checkpoint download` as a directory transformers loads, with the same logits.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

use bytes::Bytes;
use common::Stack;
use futures::StreamExt;
use keel_testkit::{ServiceProcess, binary, keel_model_init};
use serde_json::json;
use sha2::{Digest, Sha256};

/// 1 MiB chunks: one random buffer with the chunk's index written into its head, so every
/// chunk differs and making one costs a copy.
fn chunks(total: u64) -> impl Iterator<Item = Bytes> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let base: Vec<u8> = (0..1 << 20)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let count = total.div_ceil(1 << 20);
    (0..count).map(move |i| {
        let mut chunk = base.clone();
        chunk[..8].copy_from_slice(&i.to_le_bytes());
        let len = (total - i * (1 << 20)).min(1 << 20) as usize;
        chunk.truncate(len);
        Bytes::from(chunk)
    })
}

/// The process's peak resident memory (VmHWM) in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[tokio::test(flavor = "multi_thread")]
async fn a_multi_gb_file_round_trips_with_flat_memory() {
    let size: u64 = (2 << 30) + 12_345;
    let expected = tokio::task::spawn_blocking(move || {
        let mut hasher = Sha256::new();
        chunks(size).for_each(|c| hasher.update(&c));
        hex::encode(hasher.finalize())
    })
    .await
    .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let database = keel_testkit::TestDatabase::new("keel_ckpt");
    let root = dir.path().join("store");
    let prefix = format!("test.{}", uuid::Uuid::new_v4().simple());
    let service = ServiceProcess::start(
        "checkpoint",
        &[
            ("KEEL_CHECKPOINT__DATABASE_URL", &database.url),
            ("KEEL_CHECKPOINT__STORAGE__KIND", "local"),
            ("KEEL_CHECKPOINT__STORAGE__ROOT", root.to_str().unwrap()),
            ("KEEL_CHECKPOINT__SUBJECT_PREFIX", &prefix),
        ],
    );
    let started_rss = peak_rss(service.pid());
    let client = reqwest::Client::new();
    let files = json!([{"path": "model.safetensors", "sha256": expected, "size": size}]);
    let created: serde_json::Value = client
        .post(format!("{}/v1/checkpoints", service.url))
        .json(&json!({"run_id": "big", "step": 1, "files": files}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = created["id"].as_str().unwrap();
    let body = reqwest::Body::wrap_stream(futures::stream::iter(chunks(size).map(Ok::<_, std::io::Error>)));
    let put = client
        .put(format!("{}/v1/checkpoints/{id}/files/model.safetensors", service.url))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 204, "{}", put.text().await.unwrap());
    assert_eq!(client.post(format!("{}/v1/checkpoints/{id}/commit", service.url)).send().await.unwrap().status(), 200);

    let response =
        client.get(format!("{}/v1/checkpoints/{id}/files/model.safetensors", service.url)).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let mut stream = response.bytes_stream();
    let mut hasher = Sha256::new();
    let mut received = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        received += chunk.len() as u64;
        hasher.update(&chunk);
    }
    assert_eq!((received, hex::encode(hasher.finalize())), (size, expected), "bit-exact");

    let peak = peak_rss(service.pid());
    println!("service peak RSS: {} MiB at start, {} MiB after 2 GiB up and down", started_rss >> 20, peak >> 20);
    assert!(peak < started_rss + (128 << 20), "peak RSS grew from {started_rss} to {peak} bytes");
    let stream = keel_protocol::Subjects::new(&prefix).unwrap().checkpoint_stream();
    let client = keel_service::nats::connect(&keel_service::nats::default_url()).await.unwrap();
    async_nats::jetstream::new(client).delete_stream(&stream).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn an_exported_checkpoint_loads_in_transformers() {
    let stack = Stack::start().await;
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    keel_model_init(&model);
    let keel = binary("keel");

    let cli = |args: &[&str]| {
        let out =
            Command::new(&keel).arg("checkpoint").args(args).env("KEEL_CHECKPOINT_URL", &stack.url).output().unwrap();
        assert!(out.status.success(), "keel checkpoint {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let id = cli(&["upload", model.to_str().unwrap(), "--run", "export", "--step", "7", "--metric", "acc=0.25"]);
    let id = id.trim();
    assert!(cli(&["list", "--run", "export"]).contains(id));
    let restored = dir.path().join("restored");
    cli(&["download", id, "--out", restored.to_str().unwrap()]);
    let tar = dir.path().join("export.tar");
    cli(&["export", id, "--out", tar.to_str().unwrap()]);
    let unpacked = dir.path().join("unpacked");
    tar::Archive::new(std::fs::File::open(&tar).unwrap()).unpack(&unpacked).unwrap();
    for entry in std::fs::read_dir(&model).unwrap() {
        let name = entry.unwrap().file_name();
        let original = std::fs::read(model.join(&name)).unwrap();
        assert_eq!(std::fs::read(unpacked.join(&name)).unwrap(), original, "{name:?} in the tar");
        assert_eq!(std::fs::read(restored.join(&name)).unwrap(), original, "{name:?} downloaded");
    }

    let script = r#"
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
original, restored = sys.argv[1], sys.argv[2]
a = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)
b = AutoModelForCausalLM.from_pretrained(restored, dtype=torch.float32)
ids = AutoTokenizer.from_pretrained(restored)("What is 2 + 3?", return_tensors="pt").input_ids
with torch.no_grad():
    diff = (a(ids).logits - b(ids).logits).abs().max().item()
print(diff)
"#;
    let out = Command::new(keel_testkit::python())
        .args(["-c", script, model.to_str().unwrap(), restored.to_str().unwrap()])
        .env("TRANSFORMERS_VERBOSITY", "error")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let diff: f64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert_eq!(diff, 0.0, "the restored model computes the same logits");
}
