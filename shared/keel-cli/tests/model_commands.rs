//! `keel model` as a user runs it: the binary as a process, its output checked against
//! transformers, and every bad input answered with one line and a non-zero exit.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Output};

use keel_testkit::{max_abs_diff, reference_logprobs, sequences, workspace_root, write_jsonl};
use serde_json::Value;

fn keel(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keel")).args(args).output().expect("run keel")
}

fn ok(args: &[&str]) -> String {
    let out = keel(args);
    assert!(out.status.success(), "keel {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// Runs a command that must fail; returns its single error line.
fn fails(args: &[&str]) -> String {
    let out = keel(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "keel {args:?} should fail: {stderr}");
    assert!(!stderr.contains("panicked"), "keel {args:?} panicked: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one error line expected: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    stderr
}

fn init(dir: &Path, arch: &str) -> String {
    let corpus = workspace_root().join("examples/tokenizer-corpus.txt");
    let out = dir.join(arch);
    ok(&[
        "model",
        "init",
        "--arch",
        arch,
        "--preset",
        "tiny",
        "--train-tokenizer",
        corpus.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--seed",
        "5",
    ]);
    out.to_string_lossy().into_owned()
}

#[test]
fn init_then_score_matches_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let model = init(dir.path(), "llama");
    let seqs = sequences(&[17, 3, 1, 9], 400, 4);
    let input = dir.path().join("in.jsonl");
    write_jsonl(&input, &seqs);
    // A batch size that splits the input, so batching and padding are exercised.
    let stdout = ok(&["model", "score", "--model", &model, "--input", input.to_str().unwrap(), "--batch-size", "3"]);
    let ours: Vec<Vec<f64>> = stdout
        .lines()
        .map(|line| serde_json::from_value(serde_json::from_str::<Value>(line).unwrap()["logprobs"].clone()).unwrap())
        .collect();
    let expected = reference_logprobs(Path::new(&model), &seqs, 1.0, dir.path());
    let diff = max_abs_diff(&ours, &expected);
    assert!(diff <= 1e-4, "max |keel - transformers| = {diff:e}");
    assert!(ours.iter().all(|row| row[0] == 0.0));

    // The same scores with the model split over 2 and 4 tensor-parallel ranks.
    for tp in ["2", "4"] {
        let args = ["model", "score", "--model", &model, "--input", input.to_str().unwrap(), "--batch-size", "3"];
        let stdout = ok(&[&args[..], &["--tp", tp]].concat());
        let split: Vec<Vec<f64>> = stdout
            .lines()
            .map(|line| {
                serde_json::from_value(serde_json::from_str::<Value>(line).unwrap()["logprobs"].clone()).unwrap()
            })
            .collect();
        let diff = max_abs_diff(&split, &ours);
        assert!(diff <= 1e-5, "max |TP={tp} - TP=1| = {diff:e}");
    }
}

#[test]
fn generate_is_reproducible_and_reports_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let model = init(dir.path(), "qwen2");
    let run = |seed: &str, temperature: &str| -> Value {
        let args = [
            "model",
            "generate",
            "--model",
            &model,
            "--prompt",
            "What is 2 + 2?",
            "--chat",
            "--max-tokens",
            "12",
            "--seed",
            seed,
            "--temperature",
            temperature,
            "--json",
        ];
        serde_json::from_str(&ok(&args)).unwrap()
    };
    let (a, b) = (run("7", "1.0"), run("7", "1.0"));
    assert_eq!(a, b, "same seed, same output");
    assert_eq!(a["token_ids"].as_array().unwrap().len(), a["logprobs"].as_array().unwrap().len());
    assert!(["stop", "length"].contains(&a["finish_reason"].as_str().unwrap()));
    let (g1, g2) = (run("1", "0"), run("2", "0"));
    assert_eq!(g1["token_ids"], g2["token_ids"], "greedy ignores the seed");

    // The same greedy tokens with the model split over 2 tensor-parallel ranks.
    let split = |tp: &str| -> Value {
        let args = ["model", "generate", "--model", &model, "--prompt", "What is 2 + 2?", "--chat"];
        let rest = ["--max-tokens", "12", "--temperature", "0", "--json", "--tp", tp];
        serde_json::from_str(&ok(&[&args[..], &rest[..]].concat())).unwrap()
    };
    assert_eq!(split("2")["token_ids"], g1["token_ids"], "greedy output at --tp 2");

    // The logprob reported for each sampled token is what `score` gives at that position.
    let prompt: Vec<i64> = serde_json::from_value(a["prompt_token_ids"].clone()).unwrap();
    let tokens: Vec<i64> = serde_json::from_value(a["token_ids"].clone()).unwrap();
    let full: Vec<i64> = prompt.iter().chain(&tokens).copied().collect();
    let input = dir.path().join("full.jsonl");
    write_jsonl(&input, &[full]);
    let scored: Value =
        serde_json::from_str(ok(&["model", "score", "--model", &model, "--input", input.to_str().unwrap()]).trim())
            .unwrap();
    let scored: Vec<f64> = serde_json::from_value(scored["logprobs"].clone()).unwrap();
    let generated: Vec<f64> = serde_json::from_value(a["logprobs"].clone()).unwrap();
    let diff = max_abs_diff(&[scored[prompt.len()..].to_vec()], &[generated]);
    assert!(diff <= 1e-4, "generation logprobs differ from scoring by {diff:e}");
}

#[test]
fn bad_inputs_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let model = init(dir.path(), "qwen3");
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    };
    let score = |model: &str, input: &str| fails(&["model", "score", "--model", model, "--input", input]);

    let good = write("good.jsonl", "{\"token_ids\": [1, 2]}\n");
    assert!(score(&dir.path().join("absent").to_string_lossy(), &good).contains("does not exist"));
    assert!(
        score(&model, &write("range.jsonl", "{\"token_ids\": [1]}\n{\"token_ids\": [1, 100000]}\n"))
            .contains("line 2: token id 100000 is out of range")
    );
    assert!(score(&model, &write("json.jsonl", "{\"token_ids\": [1,\n")).contains("json.jsonl line 1"));
    assert!(score(&model, &write("key.jsonl", "{\"ids\": [1]}\n")).contains("expected {\"token_ids\""));
    assert!(score(&model, &write("empty.jsonl", "{\"token_ids\": []}\n")).contains("token_ids is empty"));
    assert!(score(&model, &dir.path().join("none.jsonl").to_string_lossy()).contains("none.jsonl"));

    let broken = dir.path().join("broken");
    std::fs::create_dir(&broken).unwrap();
    for file in ["config.json", "tokenizer.json"] {
        std::fs::copy(Path::new(&model).join(file), broken.join(file)).unwrap();
    }
    std::fs::write(broken.join("model.safetensors"), b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": broken}xx").unwrap();
    assert!(score(&broken.to_string_lossy(), &good).contains("corrupt safetensors"));

    let generate = |extra: &[&str]| {
        let mut args = vec!["model", "generate", "--model", model.as_str(), "--prompt", "hi"];
        args.extend_from_slice(extra);
        fails(&args)
    };
    assert!(generate(&["--device", "tpu"]).contains("unknown device `tpu`"));
    assert!(generate(&["--dtype", "int8"]).contains("unknown dtype `int8`"));
    assert!(generate(&["--top-p", "1.5"]).contains("top_p"));
    assert!(generate(&["--max-tokens", "100000"]).contains("exceeds the model's context"));
    let corpus = workspace_root().join("examples/tokenizer-corpus.txt");
    assert!(
        fails(&[
            "model",
            "init",
            "--arch",
            "gpt2",
            "--train-tokenizer",
            corpus.to_str().unwrap(),
            "--out",
            "/tmp/unused-keel"
        ])
        .contains("unknown architecture `gpt2`")
    );
}
