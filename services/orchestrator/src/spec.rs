//! A submitted run spec, checked once at the edge: parsed from YAML or JSON (a shape error
//! names its field path), then every semantic problem listed at once
//! ([`RunSpec::problems`]), then what only this service can check: that the model and the
//! datasets exist and hold what the algorithm needs.

use std::path::Path;

use keel_client::checkpoint::CheckpointClient;
use keel_protocol::FieldError;
use keel_protocol::run::RunSpec;

use crate::data;

/// Whether the body is YAML: by content type, else by its first character.
fn is_yaml(body: &[u8], content_type: Option<&str>) -> bool {
    match content_type.map(|c| c.split(';').next().unwrap_or_default().trim().to_ascii_lowercase()) {
        Some(c) if c.contains("yaml") => true,
        Some(c) if c.contains("json") => false,
        _ => body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{'),
    }
}

fn path_of(path: &serde_path_to_error::Path) -> String {
    match path.to_string().as_str() {
        "." => "spec".to_string(),
        other => other.to_string(),
    }
}

/// The spec, or the one shape problem the parser found.
pub fn parse(body: &[u8], content_type: Option<&str>) -> Result<RunSpec, FieldError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(FieldError::new("spec", "the body is empty: send a run spec in YAML or JSON"));
    }
    if is_yaml(body, content_type) {
        let deserializer = serde_yaml::Deserializer::from_slice(body);
        serde_path_to_error::deserialize(deserializer)
            .map_err(|e| FieldError::new(path_of(e.path()), e.inner().to_string()))
    } else {
        let mut deserializer = serde_json::Deserializer::from_slice(body);
        serde_path_to_error::deserialize(&mut deserializer)
            .map_err(|e| FieldError::new(path_of(e.path()), e.inner().to_string()))
    }
}

/// Every problem of a parsed spec.
pub async fn problems(spec: &RunSpec, checkpoints: &CheckpointClient) -> Vec<FieldError> {
    let mut problems = spec.problems();
    if let Some(path) = &spec.model.path {
        let dir = Path::new(path);
        if !dir.join("config.json").is_file() {
            problems
                .push(FieldError::new("model.path", format!("{path} is not a model directory (no config.json there)")));
        }
    }
    if let Some(id) = spec.model.checkpoint {
        match checkpoints.get(id).await {
            Ok(c) if c.status == "complete" => {}
            Ok(_) => problems.push(FieldError::new("model.checkpoint", format!("checkpoint {id} is not committed"))),
            Err(e) => problems.push(FieldError::new("model.checkpoint", format!("checkpoint {id}: {e}"))),
        }
    }
    let train = std::iter::once(("data.train", &spec.data.train));
    for (field, dataset) in train.chain(spec.data.validation.iter().map(|d| ("data.validation", d))) {
        let needs = if field == "data.validation" { keel_protocol::run::Algorithm::Eval } else { spec.algorithm };
        if let Err(problem) = data::load_async(dataset, needs, field).await {
            problems.push(problem);
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_errors_name_their_field() {
        let yaml = b"algorithm: grpo\nmodel: {path: /m}\ndata: {train: {kind: arithmetic}}\ngrpo:\n  num_generations_per_prompt: many\n";
        let e = parse(yaml, None).unwrap_err();
        assert_eq!(e.field, "grpo.num_generations_per_prompt", "{e}");
        let json =
            br#"{"algorithm": "sft", "model": {"path": "/m"}, "data": {"train": {"kind": "arithmetic"}}, "colour": 1}"#;
        let e = parse(json, Some("application/json")).unwrap_err();
        assert!(e.message.contains("colour"), "{e}");
        let e = parse(b"algorithm: [unclosed", Some("application/yaml")).unwrap_err();
        assert!(e.message.contains("line"), "{e}");
    }
}
