//! The generator binary as a process, driven by the official `openai` Python client
//! (`tests/openai_client.py`, run in `.venv`).

#![allow(clippy::unwrap_used)]

use keel_model::Architecture;
use keel_model::init::{InitSpec, Preset, init_model};
use keel_testkit::ServiceProcess;

#[test]
fn the_official_openai_client_works_against_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    init_model(&InitSpec {
        architecture: Architecture::Qwen3,
        preset: Preset::Tiny,
        tokenizer_corpus: vec![keel_testkit::workspace_root().join("examples/tokenizer-corpus.txt")],
        out: model.clone(),
        seed: 5,
    })
    .unwrap();
    let prefix = format!("keeltest.oa{}", uuid::Uuid::new_v4().simple());
    let server = ServiceProcess::start(
        "generator",
        &[
            ("KEEL_GENERATOR__MODEL", model.to_str().unwrap()),
            ("KEEL_GENERATOR__MAX_MODEL_LEN", "512"),
            ("KEEL_GENERATOR__SUBJECT_PREFIX", &prefix),
        ],
    );
    let script = keel_testkit::workspace_root().join("services/generator/tests/openai_client.py");
    let out =
        std::process::Command::new(keel_testkit::python()).arg(&script).arg(&server.url).arg("tiny").output().unwrap();
    assert!(
        out.status.success(),
        "openai client checks failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
