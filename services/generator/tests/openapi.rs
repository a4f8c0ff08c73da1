//! `openapi/generator.json` is generated from the code: this test fails when they drift.
//! Regenerate with `KEEL_UPDATE_OPENAPI=1 cargo nextest run -p keel-generator --test openapi`.

#![allow(clippy::unwrap_used)]

use keel_generator::openai::ApiDoc;
use utoipa::OpenApi;

#[test]
fn the_committed_openapi_document_matches_the_code() {
    let generated = serde_json::to_string_pretty(&keel_service::openapi::document(&ApiDoc::openapi())).unwrap() + "\n";
    let path = keel_testkit::workspace_root().join("openapi/generator.json");
    if std::env::var_os("KEEL_UPDATE_OPENAPI").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} is out of date: run KEEL_UPDATE_OPENAPI=1 cargo nextest run -p keel-generator --test openapi",
        path.display()
    );
    let document: serde_json::Value = serde_json::from_str(&generated).unwrap();
    for path in [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/metrics",
    ] {
        assert!(document["paths"].get(path).is_some(), "{path} is not documented");
    }
}
