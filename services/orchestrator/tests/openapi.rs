//! `openapi/keel.yaml` and `openapi/run-spec.schema.json` are generated from the code: this
//! test fails when they drift. Regenerate with
//! `KEEL_UPDATE_OPENAPI=1 cargo nextest run -p keel-orchestrator --test openapi`.

#![allow(clippy::unwrap_used)]

use keel_orchestrator::api::{openapi_yaml, run_spec_schema};

fn check(file: &str, generated: &str) {
    let path = keel_testkit::workspace_root().join("openapi").join(file);
    if std::env::var_os("KEEL_UPDATE_OPENAPI").is_some() {
        std::fs::write(&path, generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} is out of date: run KEEL_UPDATE_OPENAPI=1 cargo nextest run -p keel-orchestrator --test openapi",
        path.display()
    );
}

#[test]
fn the_committed_documents_match_the_code() {
    let yaml = openapi_yaml();
    check("keel.yaml", &yaml);
    let document: serde_json::Value = serde_yaml_ng::from_str(&yaml).unwrap();
    for path in ["/v1/runs", "/v1/runs/{id}/metrics", "/v1/runs/{id}/events", "/v1/runs/{id}/cancel"] {
        assert!(document["paths"].get(path).is_some(), "{path} is not documented");
    }
    let undeclared = keel_testkit::undeclared_path_parameters(&document);
    assert!(undeclared.is_empty(), "path parameters not declared: {undeclared:?}");
    let schema = run_spec_schema();
    check("run-spec.schema.json", &(serde_json::to_string_pretty(&schema).unwrap() + "\n"));
    for name in ["RunSpec", "GrpoSpec", "TrainingConfig", "EnvConfig", "DatasetSpec"] {
        assert!(schema["$defs"].get(name).is_some(), "{name} is missing from the run spec schema");
    }
    assert!(!serde_json::to_string(&schema).unwrap().contains("#/components/"), "a reference was not rewritten");
}
