//! Every HTTP service fuzzed against its committed OpenAPI document with Schemathesis (from
//! `.venv-schemathesis`, which `scripts/setup` makes): generated and boundary requests, a
//! bounded number per operation, each answer put through every check Schemathesis has (a
//! 5xx, a status or content type the document does not list, a body that violates its
//! schema, a schema-valid request refused or an invalid one accepted, auth ignored, ...),
//! but for the exceptions `tests/schemathesis.toml` lists with their reasons: what a
//! document cannot express. The services run as processes with their tokens on (the fuzzer
//! sends them).

#![allow(clippy::unwrap_used)]

use std::process::Command;

use keel_testkit::{ServiceProcess, TestDatabase, keel_model_init, workspace_root};

const TOKEN: &str = "fuzz-token";

/// Runs Schemathesis on `document` against `url`; panics with its report on any failure.
/// A run whose only trouble is an internal error of the fuzzer itself (a Python exception in
/// Schemathesis or Hypothesis, reported as a "Runtime Error" with no failed check) is run once
/// more.
fn fuzz(document: &str, url: &str) -> String {
    let first = fuzz_once(document, url);
    let report = match first {
        Ok(report) => report,
        Err(report) if report.contains("Runtime Error") && !report.contains("FAILURES") => {
            eprintln!("{document}: the fuzzer itself failed, running it again:\n{report}");
            fuzz_once(document, url)
                .unwrap_or_else(|report| panic!("schemathesis found problems in {document}:\n{report}"))
        }
        Err(report) => panic!("schemathesis found problems in {document}:\n{report}"),
    };
    let counts = report.lines().skip_while(|l| !l.starts_with("Test cases:")).nth(1).unwrap_or_default().trim();
    eprintln!("{document}: {counts}");
    counts.to_string()
}

/// One Schemathesis run: its report, as an error when it did not pass.
fn fuzz_once(document: &str, url: &str) -> Result<String, String> {
    let schemathesis = workspace_root().join(".venv-schemathesis/bin/schemathesis");
    assert!(schemathesis.exists(), "{} is missing: run scripts/setup", schemathesis.display());
    let scratch = tempfile::tempdir().unwrap();
    let config = workspace_root().join("tests/schemathesis.toml");
    let output = Command::new(&schemathesis)
        .current_dir(scratch.path())
        .args(["--config-file", config.to_str().unwrap()])
        .args(["run", workspace_root().join("openapi").join(document).to_str().unwrap(), "--url", url])
        .args(["-H", &format!("Authorization: Bearer {TOKEN}")])
        // One worker: with two, Hypothesis's lambda printing (`ast.parse` in two threads at
        // once) failed in both runs of one suite with CPython 3.11's "SystemError: AST
        // constructor recursion depth mismatch", whose counter threads share.
        .args(["--max-examples", "40", "--workers", "1", "--seed", "1", "--no-color"])
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&output.stdout).into_owned();
    if output.status.success() { Ok(report) } else { Err(report) }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_service_answers_fuzzed_requests_as_its_document_says() {
    let dir = tempfile::tempdir().unwrap();
    let database = TestDatabase::new("keel_e2e_fuzz");
    let prefix = format!("fuzz.{}", uuid::Uuid::new_v4().simple());
    let checkpoint = ServiceProcess::start(
        "checkpoint",
        &[
            ("KEEL_CHECKPOINT__DATABASE_URL", &database.url),
            ("KEEL_CHECKPOINT__STORAGE__KIND", "local"),
            ("KEEL_CHECKPOINT__STORAGE__ROOT", dir.path().join("blobs").to_str().unwrap()),
            ("KEEL_CHECKPOINT__NATS_URL", ""),
            ("KEEL_CHECKPOINT__API_TOKEN", TOKEN),
        ],
    );
    let work = dir.path().join("work");
    let orchestrator = ServiceProcess::start(
        "orchestrator",
        &[
            ("KEEL_ORCHESTRATOR__DATABASE_URL", &database.url),
            ("KEEL_ORCHESTRATOR__SUBJECT_PREFIX", &prefix),
            ("KEEL_ORCHESTRATOR__CHECKPOINT_URL", &checkpoint.url),
            ("KEEL_ORCHESTRATOR__CHECKPOINT_TOKEN", TOKEN),
            ("KEEL_ORCHESTRATOR__WORK_DIR", work.to_str().unwrap()),
            ("KEEL_ORCHESTRATOR__API_TOKEN", TOKEN),
        ],
    );
    let reward = ServiceProcess::start("reward", &[("KEEL_REWARD__NATS_URL", ""), ("KEEL_REWARD__API_TOKEN", TOKEN)]);
    let model = dir.path().join("model");
    keel_model_init(&model);
    let generator = ServiceProcess::start(
        "generator",
        &[
            ("KEEL_GENERATOR__NATS_URL", ""),
            ("KEEL_GENERATOR__MODEL", model.to_str().unwrap()),
            ("KEEL_GENERATOR__MAX_MODEL_LEN", "256"),
            ("KEEL_GENERATOR__API_KEY", TOKEN),
        ],
    );

    let mut summary = Vec::new();
    for (document, url) in [
        ("keel.yaml", &orchestrator.url),
        ("checkpoint.json", &checkpoint.url),
        ("reward.json", &reward.url),
        ("generator.json", &generator.url),
    ] {
        summary.push(format!("{document}: {}", fuzz(document, url)));
    }
    eprintln!("\n{}", summary.join("\n"));
}
