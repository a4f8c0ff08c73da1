//! Helpers for tests that compare Keel with transformers (Python in the workspace `.venv`).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use keel_model::CausalLm;
use serde_json::Value;
use tch::{Device, Kind, Tensor};

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("workspace root")
}

/// The Python with torch and transformers: `KEEL_PYTHON`, else the workspace `.venv`.
pub fn python() -> PathBuf {
    std::env::var_os("KEEL_PYTHON").map(PathBuf::from).unwrap_or_else(|| workspace_root().join(".venv/bin/python"))
}

/// Runs a subcommand of `tests/reference/hf_reference.py` and parses its JSON output.
pub fn reference(args: &[&str]) -> Value {
    let script = workspace_root().join("tests/reference/hf_reference.py");
    let output = Command::new(python())
        .arg(&script)
        .args(args)
        .env("TRANSFORMERS_VERBOSITY", "error")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run the transformers reference (scripts/setup creates .venv)");
    assert!(
        output.status.success(),
        "reference {args:?} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("reference prints JSON")
}

/// Deterministic token sequences of the given lengths.
pub fn sequences(lengths: &[usize], vocab: i64, seed: i64) -> Vec<Vec<i64>> {
    lengths
        .iter()
        .enumerate()
        .map(|(row, &len)| (0..len as i64).map(|i| (i * 37 + row as i64 * 101 + seed * 13 + 5) % vocab).collect())
        .collect()
}

pub fn write_jsonl(path: &Path, seqs: &[Vec<i64>]) {
    let text: String = seqs.iter().map(|s| format!("{}\n", serde_json::json!({ "token_ids": s }))).collect();
    std::fs::write(path, text).expect("write input");
}

/// Keel's logprobs of right-padded `seqs`, one row per sequence, cut to its length.
pub fn keel_logprobs(model: &CausalLm, seqs: &[Vec<i64>], temperature: f64) -> Vec<Vec<f64>> {
    let width = seqs.iter().map(Vec::len).max().unwrap_or(0);
    let padded: Vec<i64> = seqs.iter().flat_map(|s| s.iter().copied().chain(std::iter::repeat_n(3, width - s.len()))).collect();
    let ids = Tensor::from_slice(&padded).view([seqs.len() as i64, width as i64]);
    let lengths: Vec<i64> = seqs.iter().map(|s| s.len() as i64).collect();
    let lp = model.token_logprobs(&ids, &lengths, temperature).expect("token_logprobs");
    let flat = Vec::<f64>::try_from(lp.to_kind(Kind::Double).flatten(0, -1)).expect("to vec");
    seqs.iter().enumerate().map(|(row, s)| flat[row * width..row * width + s.len()].to_vec()).collect()
}

pub fn reference_logprobs(model_dir: &Path, seqs: &[Vec<i64>], temperature: f64, scratch: &Path) -> Vec<Vec<f64>> {
    let input = scratch.join("input.jsonl");
    write_jsonl(&input, seqs);
    let out = reference(&["score", model_dir.to_str().unwrap(), input.to_str().unwrap(), "--temperature", &temperature.to_string()]);
    serde_json::from_value(out["logprobs"].clone()).expect("logprobs")
}

pub fn max_abs_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    assert_eq!(a.len(), b.len(), "row counts differ");
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len(), "row lengths differ");
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f64::max)
}

pub fn load_f32(dir: &Path) -> CausalLm {
    CausalLm::load(dir, Device::Cpu, Kind::Float).expect("load model")
}
