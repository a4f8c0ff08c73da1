//! `openapi/generator.json` makes a working client: openapi-python-client 0.29.1 (from
//! `.venv-openapi-client`, which `scripts/setup` makes) generates a Python client from the
//! committed document without a warning, and `generated_client.py` drives the generator,
//! run as a process, with it: completions and chat, whole and streamed (each server-sent
//! chunk read with the client's own response model), the model routes, tokenize, and an error
//! as the client's typed error.

#![allow(clippy::unwrap_used)]

use std::process::Command;

use keel_model::Architecture;
use keel_model::init::{InitSpec, Preset, init_model};
use keel_testkit::{ServiceProcess, workspace_root};

#[test]
fn a_client_generated_from_the_document_completes_and_streams() {
    let venv = workspace_root().join(".venv-openapi-client");
    let tool = venv.join("bin/openapi-python-client");
    assert!(tool.exists(), "{} is missing: run scripts/setup", tool.display());
    let scratch = tempfile::tempdir().unwrap();
    let client = scratch.path().join("client");
    let tests = workspace_root().join("services/generator/tests");
    let path = format!("{}:{}", venv.join("bin").display(), std::env::var("PATH").unwrap_or_default());
    let output = Command::new(&tool)
        .env("PATH", path)
        .arg("generate")
        .arg("--path")
        .arg(workspace_root().join("openapi/generator.json"))
        .arg("--output-path")
        .arg(&client)
        .arg("--config")
        .arg(tests.join("openapi-python-client.yaml"))
        .output()
        .unwrap();
    let report = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success() && client.join("keel_generator_client").is_dir(), "not generated:\n{report}");
    assert!(!report.contains("WARNING") && !report.contains("Unable to process"), "the tool warned:\n{report}");

    let model = scratch.path().join("tiny");
    init_model(&InitSpec {
        architecture: Architecture::Qwen3,
        preset: Preset::Tiny,
        tokenizer_corpus: vec![workspace_root().join("examples/tokenizer-corpus.txt")],
        out: model.clone(),
        seed: 5,
    })
    .unwrap();
    let prefix = format!("keeltest.gc{}", uuid::Uuid::new_v4().simple());
    let server = ServiceProcess::start(
        "generator",
        &[
            ("KEEL_GENERATOR__MODEL", model.to_str().unwrap()),
            ("KEEL_GENERATOR__SERVED_MODEL_NAME", "tiny"),
            ("KEEL_GENERATOR__SUBJECT_PREFIX", &prefix),
        ],
    );
    let out = Command::new(venv.join("bin/python"))
        .arg(tests.join("generated_client.py"))
        .args([server.url.as_str(), "tiny"])
        .env("PYTHONPATH", &client)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the generated client's checks failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
