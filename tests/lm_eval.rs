//! EleutherAI's lm-evaluation-harness against the generator, as its users run it: the
//! `local-completions` model (token-id prompts, `echo` with `max_tokens` 0 for
//! loglikelihoods, batches of 4 prompts per request) on a multiple-choice and a generation
//! task, beside lm-eval's own `hf` model on the same weights; and `local-chat-completions` on
//! the generation task. The per-choice loglikelihoods and the greedy answers are the same.
//! The tasks are `tests/lm_eval/*.yaml`, with their data beside them.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use keel_testkit::{ServiceProcess, keel_model_init};
use serde_json::Value;

/// Runs lm_eval with `args` on both tasks' directory; the samples it logged, by task, each
/// task's by document id.
fn lm_eval(args: &[&str], tasks: &str, out: &Path) -> BTreeMap<String, BTreeMap<u64, Value>> {
    let dir = keel_testkit::workspace_root().join("tests/lm_eval");
    let output = Command::new(keel_testkit::python())
        .args(["-m", "lm_eval"])
        .args(args)
        .args(["--tasks", tasks, "--include_path", ".", "--log_samples", "--output_path"])
        .arg(out)
        .current_dir(&dir)
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1")
        .env("HF_DATASETS_CACHE", out.join("datasets"))
        .env("TRANSFORMERS_VERBOSITY", "error")
        .output()
        .unwrap_or_else(|e| panic!("cannot run lm_eval (scripts/setup installs it in .venv): {e}"));
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "lm_eval {args:?} failed:\n{log}");
    let mut samples = BTreeMap::new();
    for entry in walk(out) {
        let name = entry.file_name().unwrap().to_string_lossy().into_owned();
        let Some(task) = name.strip_prefix("samples_").and_then(|n| n.rsplit_once('_')).map(|(t, _)| t.to_string())
        else {
            continue;
        };
        let text = std::fs::read_to_string(&entry).unwrap();
        let docs: BTreeMap<u64, Value> = text
            .lines()
            .map(|line| serde_json::from_str::<Value>(line).unwrap())
            .map(|sample| (sample["doc_id"].as_u64().unwrap(), sample))
            .collect();
        samples.insert(task, docs);
    }
    assert!(!samples.is_empty(), "lm_eval logged no samples under {}:\n{log}", out.display());
    samples
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else if path.extension().is_some_and(|e| e == "jsonl") {
            files.push(path);
        }
    }
    files
}

/// The loglikelihood of each choice of a multiple-choice sample, and whether it was greedy.
fn choices(sample: &Value) -> Vec<(f64, String)> {
    sample["resps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r[0][0].as_str().unwrap().parse().unwrap(), r[0][1].as_str().unwrap().to_string()))
        .collect()
}

#[test]
fn lm_eval_scores_the_generator_as_it_scores_transformers() {
    let scratch = tempfile::tempdir().unwrap();
    let model = scratch.path().join("model");
    keel_model_init(&model);
    let prefix = format!("e2e.{}", uuid::Uuid::new_v4().simple());
    let generator = ServiceProcess::start(
        "generator",
        &[
            ("KEEL_GENERATOR__SUBJECT_PREFIX", &prefix),
            ("KEEL_GENERATOR__MODEL", model.to_str().unwrap()),
            ("KEEL_GENERATOR__SERVED_MODEL_NAME", "tiny"),
        ],
    );
    let both = "keel_arithmetic_choice,keel_arithmetic_answer";
    let completions = format!(
        "base_url={}/v1/completions,model=tiny,tokenizer={},tokenized_requests=True,max_retries=1",
        generator.url,
        model.display()
    );
    let keel = lm_eval(
        &["--model", "local-completions", "--model_args", &completions, "--batch_size", "4"],
        both,
        &scratch.path().join("keel"),
    );
    let hf_args = format!("pretrained={},dtype=float32", model.display());
    let hf = lm_eval(
        &["--model", "hf", "--model_args", &hf_args, "--device", "cpu", "--batch_size", "4"],
        both,
        &scratch.path().join("hf"),
    );

    let (ours, theirs) = (&keel["keel_arithmetic_choice"], &hf["keel_arithmetic_choice"]);
    assert_eq!(ours.len(), 12);
    let mut largest: f64 = 0.0;
    for (doc, sample) in ours {
        let (got, want) = (choices(sample), choices(&theirs[doc]));
        assert_eq!(got.len(), 4, "doc {doc}");
        for ((lg, greedy_g), (lw, greedy_w)) in got.iter().zip(&want) {
            assert!(lg.is_finite() && *lg < 0.0, "doc {doc}: a loglikelihood, not a placeholder: {lg}");
            largest = largest.max((lg - lw).abs());
            assert_eq!(greedy_g, greedy_w, "doc {doc}: is_greedy");
        }
        // Not every choice alike: an echo ignored would score them all the same.
        assert!(got.iter().any(|c| c.0 != got[0].0), "doc {doc}: {got:?}");
    }
    assert!(largest <= 1e-4, "per-choice loglikelihoods differ from transformers' by up to {largest:e}");
    let answers = |samples: &BTreeMap<u64, Value>| -> Vec<String> {
        samples.values().map(|s| s["resps"][0][0].as_str().unwrap().to_string()).collect()
    };
    assert_eq!(answers(&keel["keel_arithmetic_answer"]), answers(&hf["keel_arithmetic_answer"]), "greedy answers");

    // The chat endpoint answers the generation task through the model's chat template.
    let chat_args = format!("base_url={}/v1/chat/completions,model=tiny,max_retries=1", generator.url);
    let chat = lm_eval(
        &["--model", "local-chat-completions", "--model_args", &chat_args, "--apply_chat_template"],
        "keel_arithmetic_answer",
        &scratch.path().join("chat"),
    );
    assert_eq!(chat["keel_arithmetic_answer"].len(), 12);
}
