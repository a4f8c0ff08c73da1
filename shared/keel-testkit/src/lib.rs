//! Test support shared by Keel's crates.
//!
//! - [`workspace_root`] and [`python`]: where the workspace and its `.venv` are.
//! - [`reference`]: runs `tests/reference/hf_reference.py` (transformers, the oracle for
//!   model numerics) and parses its JSON.
//! - [`sequences`], [`write_jsonl`], [`max_abs_diff`]: inputs and comparisons.
//! - [`ServiceProcess`]: a service binary started as a process on a free port;
//!   [`keel_model_init`]: a tiny model made with the `keel` binary.
//! - [`TestDatabase`]: a database of the test's own, dropped afterwards.
//! - [`Proxy`]: a TCP proxy a test cuts to take NATS or Postgres away from the services.
//! - [`NatsServer`]: a nats-server of a test's own.
//! - [`undeclared_path_parameters`]: what an OpenAPI document's operations leave undeclared.
//! - [`docs`]: the book's reference pages, generated from the code and checked for drift.

mod database;
pub mod docs;
mod nats;
mod process;
mod proxy;

pub use database::{TestDatabase, postgres_addr, postgres_url};
pub use nats::NatsServer;
pub use process::{ServiceProcess, binary, keel_model_init, keel_model_init_arch, keel_model_init_preset};
pub use proxy::Proxy;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

pub fn workspace_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.join("../..").canonicalize().unwrap_or_else(|_| here.join("../.."))
}

/// The Python with torch and transformers: `KEEL_PYTHON`, else the workspace `.venv`.
pub fn python() -> PathBuf {
    std::env::var_os("KEEL_PYTHON").map(PathBuf::from).unwrap_or_else(|| workspace_root().join(".venv/bin/python"))
}

/// Runs a subcommand of the transformers reference script and parses its JSON output.
/// Panics with the script's stderr on failure (this is test support).
pub fn reference(args: &[&str]) -> Value {
    let script = workspace_root().join("tests/reference/hf_reference.py");
    let output = Command::new(python())
        .arg(&script)
        .args(args)
        .env("TRANSFORMERS_VERBOSITY", "error")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} (scripts/setup creates .venv): {e}", python().display()));
    assert!(output.status.success(), "reference {args:?} failed:\n{}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| panic!("reference {args:?} printed no JSON: {e}"))
}

/// Deterministic token sequences of the given lengths, ids below `vocab`.
pub fn sequences(lengths: &[usize], vocab: i64, seed: i64) -> Vec<Vec<i64>> {
    lengths
        .iter()
        .enumerate()
        .map(|(row, &len)| (0..len as i64).map(|i| (i * 37 + row as i64 * 101 + seed * 13 + 5) % vocab).collect())
        .collect()
}

/// Writes `{"token_ids": [...]}` lines.
pub fn write_jsonl(path: &Path, seqs: &[Vec<i64>]) {
    let text: String = seqs.iter().map(|s| format!("{}\n", serde_json::json!({ "token_ids": s }))).collect();
    std::fs::write(path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// transformers' logprobs of `seqs` (one sequence at a time, f32).
pub fn reference_logprobs(model_dir: &Path, seqs: &[Vec<i64>], temperature: f64, scratch: &Path) -> Vec<Vec<f64>> {
    scored(model_dir, None, seqs, temperature, scratch)
}

/// transformers' logprobs of `seqs` under each of `models` (a model directory, and the LoRA
/// adapters PEFT loads on it when given), in one Python process: what a test scoring many
/// models calls instead of one process each.
pub fn reference_logprobs_many(
    models: &[(&Path, Option<&Path>)],
    seqs: &[Vec<i64>],
    scratch: &Path,
) -> Vec<Vec<Vec<f64>>> {
    let input = scratch.join("reference-input.jsonl");
    write_jsonl(&input, seqs);
    let jobs: Vec<Value> = models
        .iter()
        .map(|(model, adapter)| serde_json::json!({"model": model, "input": input, "adapter": adapter}))
        .collect();
    let jobs_file = scratch.join("reference-jobs.json");
    std::fs::write(&jobs_file, Value::Array(jobs).to_string())
        .unwrap_or_else(|e| panic!("write {}: {e}", jobs_file.display()));
    let out = reference(&["score-many", &jobs_file.to_string_lossy()]);
    serde_json::from_value(out["results"].clone()).unwrap_or_else(|e| panic!("reference logprobs: {e}"))
}

/// transformers' logprobs of `seqs` under the base model `model_dir` with the LoRA adapters
/// of `adapter_dir` loaded by PEFT (`PeftModel.from_pretrained`).
pub fn peft_logprobs(model_dir: &Path, adapter_dir: &Path, seqs: &[Vec<i64>], scratch: &Path) -> Vec<Vec<f64>> {
    scored(model_dir, Some(adapter_dir), seqs, 1.0, scratch)
}

fn scored(
    model_dir: &Path,
    adapter: Option<&Path>,
    seqs: &[Vec<i64>],
    temperature: f64,
    scratch: &Path,
) -> Vec<Vec<f64>> {
    let input = scratch.join("reference-input.jsonl");
    write_jsonl(&input, seqs);
    let (model, input, temperature) = (model_dir.to_string_lossy(), input.to_string_lossy(), temperature.to_string());
    let mut args = vec!["score", &model, &input, "--temperature", &temperature];
    let adapter = adapter.map(|a| a.to_string_lossy().into_owned());
    if let Some(adapter) = &adapter {
        args.extend(["--adapter", adapter.as_str()]);
    }
    let out = reference(&args);
    serde_json::from_value(out["logprobs"].clone()).unwrap_or_else(|e| panic!("reference logprobs: {e}"))
}

/// Largest absolute difference between two ragged tables of the same shape; a NaN anywhere
/// counts as an infinite difference.
pub fn max_abs_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    assert_eq!(a.len(), b.len(), "row counts differ");
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len(), "row lengths differ");
            x.iter().zip(y).map(|(p, q)| if p.is_nan() || q.is_nan() { f64::INFINITY } else { (p - q).abs() })
        })
        .fold(0.0, f64::max)
}

/// Every `{name}` segment of an OpenAPI document's paths that an operation under it does
/// not declare as an `in: path` parameter, as `METHOD /path {name}` (empty when the
/// document is complete: a client generator can call every operation).
pub fn undeclared_path_parameters(document: &Value) -> Vec<String> {
    let mut missing = Vec::new();
    let Some(paths) = document["paths"].as_object() else { return missing };
    for (path, operations) in paths {
        let names: Vec<&str> =
            path.split('/').filter_map(|segment| segment.strip_prefix('{')?.strip_suffix('}')).collect();
        for (method, operation) in operations.as_object().into_iter().flatten() {
            let declared = |name: &str| {
                operation["parameters"]
                    .as_array()
                    .is_some_and(|ps| ps.iter().any(|p| p["name"] == name && p["in"] == "path"))
            };
            for name in names.iter().filter(|n| !declared(n)) {
                missing.push(format!("{} {path} {{{name}}}", method.to_uppercase()));
            }
        }
    }
    missing
}
