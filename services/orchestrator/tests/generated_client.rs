//! `openapi/keel.yaml` makes a working client: openapi-python-client 0.29.1 (from
//! `.venv-openapi-client`, which `scripts/setup` makes) generates a Python client from the
//! committed document, and `generated_client.py` drives the orchestrator, run as a process,
//! with it: submit, list, show, cancel and the events stream, each answer (errors included)
//! a typed object of the client.
//!
//! The tool must read the document without a warning but one: it generates no code for YAML
//! bodies, so `POST /v1/runs` is generated for its JSON body only.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

use keel_testkit::{ServiceProcess, TestDatabase, workspace_root};

const TOKEN: &str = "generated-client-token";

/// The tool's warnings: the first line of each (`WARNING parsing POST /v1/runs ...`,
/// `Unable to process schema ...`), and the detail of each `WARNING`.
fn warnings(output: &str) -> Vec<String> {
    let lines: Vec<&str> = output.lines().collect();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.starts_with("WARNING") || line.starts_with("Unable to process") || line.contains("not in PATH") {
            let detail = lines[i + 1..].iter().find(|l| !l.trim().is_empty()).unwrap_or(&"");
            found.push(format!("{line} {detail}"));
        }
    }
    found
}

/// Generates the client from `openapi/keel.yaml` into `out`; panics on an error or a warning
/// other than the YAML body's.
fn generate(venv: &Path, out: &Path) {
    let tool = venv.join("bin/openapi-python-client");
    assert!(
        tool.exists(),
        "{} is missing: run scripts/setup (it makes .venv-openapi-client with openapi-python-client 0.29.1)",
        tool.display()
    );
    let tests = workspace_root().join("services/orchestrator/tests");
    // The venv's `ruff` formats the generated code.
    let path = format!("{}:{}", venv.join("bin").display(), std::env::var("PATH").unwrap_or_default());
    let output = Command::new(&tool)
        .env("PATH", path)
        .arg("generate")
        .arg("--path")
        .arg(workspace_root().join("openapi/keel.yaml"))
        .arg("--output-path")
        .arg(out)
        .arg("--config")
        .arg(tests.join("openapi-python-client.yaml"))
        .output()
        .unwrap();
    let report = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success() && out.join("keel_client").is_dir(), "the client was not generated:\n{report}");
    let found = warnings(&report);
    let expected = [
        "WARNING parsing POST /v1/runs within default. Unsupported content type application/yaml",
        "WARNING parsing POST /v1/runs/validate within default. Unsupported content type application/yaml",
    ];
    assert!(found == expected, "openapi-python-client warned about openapi/keel.yaml: {found:#?}\n\n{report}");
}

#[test]
fn a_client_generated_from_the_document_drives_the_runs_api() {
    let venv = workspace_root().join(".venv-openapi-client");
    let scratch = tempfile::tempdir().unwrap();
    let client = scratch.path().join("client");
    generate(&venv, &client);

    let database = TestDatabase::new("keel_orch_client");
    let model = tempfile::tempdir().unwrap();
    std::fs::write(model.path().join("config.json"), "{}").unwrap();
    let prefix = format!("client.{}", uuid::Uuid::new_v4().simple());
    let work = scratch.path().join("work");
    // No trainer serves this prefix and the scheduler looks once an hour: a run stays queued.
    let orchestrator = ServiceProcess::start(
        "orchestrator",
        &[
            ("KEEL_ORCHESTRATOR__DATABASE_URL", &database.url),
            ("KEEL_ORCHESTRATOR__SUBJECT_PREFIX", &prefix),
            ("KEEL_ORCHESTRATOR__CHECKPOINT_URL", "http://127.0.0.1:9"),
            ("KEEL_ORCHESTRATOR__WORK_DIR", work.to_str().unwrap()),
            ("KEEL_ORCHESTRATOR__API_TOKEN", TOKEN),
            ("KEEL_ORCHESTRATOR__POLL_SECONDS", "3600"),
        ],
    );
    let script = workspace_root().join("services/orchestrator/tests/generated_client.py");
    let output = Command::new(venv.join("bin/python"))
        .env("PYTHONPATH", &client)
        .arg(&script)
        .args([orchestrator.url.as_str(), TOKEN, model.path().to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the generated client failed against the orchestrator:\n{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    eprintln!("{stdout}");
}
