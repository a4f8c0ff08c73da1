//! `keel generate serve-bench` against the generator as a process (HTTP only, no NATS):
//! every request of a Poisson load completes with all its tokens and the timings are
//! reported; bad arguments and an unreachable server are one error line.

#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

use keel_testkit::{ServiceProcess, binary, keel_model_init};
use serde_json::Value;

fn serve_bench(args: &[&str]) -> Output {
    Command::new(binary("keel")).args(["generate", "serve-bench"]).args(args).output().expect("run keel")
}

#[test]
fn a_poisson_load_completes_and_reports_its_latencies() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    keel_model_init(&model);
    let generator = ServiceProcess::start(
        "generator",
        &[
            ("KEEL_GENERATOR__MODEL", model.to_str().unwrap()),
            ("KEEL_GENERATOR__MAX_NUM_SEQS", "4"),
            // HTTP only: a standalone server needs no NATS.
            ("KEEL_GENERATOR__NATS_URL", ""),
        ],
    );
    let prompts = dir.path().join("prompts.json");
    let out = serve_bench(&[
        "--url",
        &generator.url,
        "--vocab-size",
        "200",
        "--input-len",
        "24",
        "--output-len",
        "6",
        "--num-prompts",
        "10",
        "--request-rate",
        "40",
        "--max-concurrency",
        "6",
        "--save-prompts",
        prompts.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "serve-bench failed: {stderr}");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["completed"], 10, "{report}");
    assert_eq!(report["failed"], 0, "{report}");
    assert_eq!(report["output_tokens"], 60, "ignore_eos gives every request all its tokens: {report}");
    for metric in ["ttft", "tpot", "itl"] {
        for stat in ["mean_ms", "median_ms", "p99_ms"] {
            assert!(report[metric][stat].as_f64().unwrap() > 0.0, "{metric}.{stat}: {report}");
        }
    }
    assert!(report["ttft"]["p99_ms"].as_f64() >= report["ttft"]["median_ms"].as_f64());
    let saved: Vec<Vec<i64>> = serde_json::from_slice(&std::fs::read(&prompts).unwrap()).unwrap();
    assert_eq!(saved.len(), 10);
    assert!(saved.iter().all(|p| p.len() == 24 && p.iter().all(|&t| (0..200).contains(&t))));
}

#[test]
fn bad_arguments_and_an_unreachable_server_are_one_line() {
    let cases: [(&[&str], &str); 3] = [
        (&["--url", "http://127.0.0.1:9", "--vocab-size", "0"], "--vocab-size"),
        (&["--url", "http://127.0.0.1:9", "--vocab-size", "10", "--request-rate", "0"], "--request-rate"),
        (&["--url", "http://127.0.0.1:9", "--vocab-size", "10", "--num-prompts", "1"], "127.0.0.1:9"),
    ];
    for (args, needle) in cases {
        let out = serve_bench(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "one line expected: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}
