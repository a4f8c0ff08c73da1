//! A submitted run spec, checked once at the edge: parsed from YAML or JSON (a shape error
//! names its field path), then every semantic problem listed at once
//! ([`RunSpec::problems`]), then what only this service can check: that the model and the
//! datasets exist and hold what the algorithm needs.

use std::path::Path;

use keel_client::checkpoint::CheckpointClient;
use keel_protocol::FieldError;
use keel_protocol::run::RunSpec;
use keel_service::paths::PathRoots;

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

/// Deepest nesting of `[` and `{` a spec may have (a real one has fewer than ten levels);
/// deeper bodies are refused before the parser sees them. The parsers' own recursion limit
/// (128 levels, block YAML included) refuses them too, but only after libyaml has scanned
/// the whole flow: 100,000 levels of `[` took it 40 s of CPU.
const MAX_NESTING: usize = 64;

/// How deep `[`/`{` nest in `body`, ignoring brackets inside quoted strings.
fn nesting(body: &[u8]) -> usize {
    let (mut depth, mut deepest, mut quote, mut escaped) = (0usize, 0usize, None, false);
    for &b in body {
        match quote {
            Some(q) => {
                if escaped {
                    escaped = false;
                } else if b == b'\\' && q == b'"' {
                    escaped = true;
                } else if b == q {
                    quote = None;
                }
            }
            None => match b {
                b'"' | b'\'' => quote = Some(b),
                b'[' | b'{' => {
                    depth += 1;
                    deepest = deepest.max(depth);
                }
                b']' | b'}' => depth = depth.saturating_sub(1),
                _ => {}
            },
        }
    }
    deepest
}

/// The spec, or the one shape problem the parser found. Run it off the async workers
/// ([`parse_async`]): parsing a large body takes a while.
pub fn parse(body: &[u8], content_type: Option<&str>) -> Result<RunSpec, FieldError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(FieldError::new("spec", "the body is empty: send a run spec in YAML or JSON"));
    }
    let depth = nesting(body);
    if depth > MAX_NESTING {
        return Err(FieldError::new("spec", format!("nested {depth} levels deep; at most {MAX_NESTING} are allowed")));
    }
    // Both formats are read as a value first, YAML's within a budget of its own length: its
    // aliases can make a few kilobytes stand for gigabytes (a 2 MB spec of them once took
    // this service to 1.9 GB), and with the budget they cost at most what the text would.
    let value = if is_yaml(body, content_type) {
        keel_service::json::bounded_value(serde_yaml_ng::Deserializer::from_slice(body), body.len() + YAML_SLACK)
            .map_err(|e| FieldError::new("spec", e.to_string()))?
    } else {
        serde_json::from_slice(body).map_err(|e| FieldError::new("spec", e.to_string()))?
    };
    let parsed =
        serde_path_to_error::deserialize(&value).map_err(|e: serde_path_to_error::Error<serde_json::Error>| {
            FieldError::new(path_of(e.path()), e.inner().to_string())
        });
    parsed.or_else(|refused| with_integral_numbers(value).ok_or(refused))
}

/// Units a YAML spec may expand to beyond its length (see [`keel_service::json::bounded_value`]):
/// room for the odd short alias in a small spec.
const YAML_SLACK: usize = 4096;

/// The spec, when it was refused only for an integer written with a zero fraction (`2.0`),
/// which JSON Schema's `integer` (and so the run spec's schema) allows: one pass over the
/// value already read, no second parse.
fn with_integral_numbers(mut value: serde_json::Value) -> Option<RunSpec> {
    if !keel_service::json::integral_numbers(&mut value) {
        return None;
    }
    serde_json::from_value(value).ok()
}

/// The directory of the model `name` (a Hub id) at `revision` in this host's Hugging Face
/// cache, or why there is none.
pub fn model_by_name(name: &str, revision: Option<&str>) -> Result<std::path::PathBuf, keel_service::hub::NotCached> {
    keel_service::hub::snapshot(&keel_service::hub::cache_dir(), name, revision)
}

/// [`parse`] on a blocking thread.
pub async fn parse_async(body: bytes::Bytes, content_type: Option<String>) -> Result<RunSpec, FieldError> {
    tokio::task::spawn_blocking(move || parse(&body, content_type.as_deref()))
        .await
        .unwrap_or_else(|e| Err(FieldError::new("spec", format!("the parser failed: {e}"))))
}

/// The field paths of every string in `value` that holds a NUL character (which Postgres
/// cannot store), e.g. `name` or `environments.default.name`.
fn nul_strings(value: &serde_json::Value, at: &str, out: &mut Vec<FieldError>) {
    let join = |key: &str| if at.is_empty() { key.to_string() } else { format!("{at}.{key}") };
    match value {
        serde_json::Value::String(s) if s.contains('\0') => {
            out.push(FieldError::new(if at.is_empty() { "spec" } else { at }, "must not contain a NUL character"));
        }
        serde_json::Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                nul_strings(item, &format!("{at}[{i}]"), out);
            }
        }
        serde_json::Value::Object(map) => {
            for (key, item) in map {
                if key.contains('\0') {
                    out.push(FieldError::new(join("<key>"), "a key must not contain a NUL character"));
                }
                nul_strings(item, &join(key), out);
            }
        }
        _ => {}
    }
}

/// Every problem of a parsed spec. Datasets are read only when their own fields have no
/// problem, and record by record, keeping none ([`data::check`]): a dataset of any size costs
/// the orchestrator no memory at submit.
pub async fn problems(
    spec: &RunSpec,
    checkpoints: &CheckpointClient,
    roots: &PathRoots,
    mlflow: &crate::loggers::TrackingServers,
) -> Vec<FieldError> {
    let mut problems = spec.problems();
    // An MLflow server on a private address must be one the operator trusts.
    if spec.logger.mlflow_enabled
        && let Some(uri) = &spec.logger.mlflow.tracking_uri
        && let Err(e) = mlflow.check(uri)
    {
        problems.push(e);
    }
    if let Ok(value) = serde_json::to_value(spec) {
        nul_strings(&value, "", &mut problems);
    }
    // Files the orchestrator (and the trainer and generators) would read for this run must
    // be inside the roots it is configured with.
    let datasets = std::iter::once(("data.train.path", &spec.data.train))
        .chain(spec.data.validation.iter().map(|d| ("data.validation.path", d)));
    let dataset_paths = datasets.filter_map(|(field, d)| match d {
        keel_protocol::run::DatasetSpec::Jsonl { path, .. } | keel_protocol::run::DatasetSpec::Parquet { path, .. } => {
            Some((field, path))
        }
        _ => None,
    });
    let log_dir = spec.logger.log_dir.iter().map(|p| ("logger.log_dir", p));
    // The models: the run's, a distillation's teacher and a PPO critic.
    let models: Vec<(&str, &keel_protocol::run::ModelRef)> = std::iter::once(("model", &spec.model))
        .chain(spec.distillation.iter().map(|d| ("distillation.teacher", &d.teacher)))
        .chain(spec.ppo.iter().filter_map(|p| p.critic.as_ref().map(|c| ("ppo.critic", c))))
        .collect();
    let mut model: Vec<(String, String)> = Vec::new();
    for (field, m) in &models {
        if let Some(path) = &m.path {
            model.push((format!("{field}.path"), path.clone()));
        }
        // A model named by its Hub id is its snapshot in the Hugging Face cache.
        if let Some(name) = &m.name {
            match model_by_name(name, m.revision.as_deref()) {
                Ok(dir) => model.push((format!("{field}.name"), dir.display().to_string())),
                Err(e) => problems.push(FieldError::new(format!("{field}.name"), e.to_string())),
            }
        }
    }
    let model_paths = model.iter().map(|(field, path)| (field.as_str(), path));
    for (field, path) in model_paths.clone().chain(dataset_paths).chain(log_dir) {
        if let Err(e) = roots.inside(path) {
            problems.push(FieldError::new(field, e.to_string()));
        }
    }
    for (field, path) in model_paths {
        if problems.iter().any(|p| p.field == field) {
            continue;
        }
        let dir = Path::new(path);
        // A model directory, or LoRA adapters in PEFT's layout (loaded on their base).
        if !dir.join("config.json").is_file() && !dir.join("adapter_config.json").is_file() {
            problems.push(FieldError::new(
                field,
                format!(
                    "{path} is not a model directory (no config.json there, nor LoRA adapters' adapter_config.json)"
                ),
            ));
        }
    }
    for (field, m) in &models {
        let Some(id) = m.checkpoint else { continue };
        let field = format!("{field}.checkpoint");
        match checkpoints.get(id).await {
            Ok(c) if c.status == "complete" => {}
            Ok(_) => problems.push(FieldError::new(field, format!("checkpoint {id} is not committed"))),
            Err(e) => problems.push(FieldError::new(field, format!("checkpoint {id}: {e}"))),
        }
    }
    let train = std::iter::once(("data.train", &spec.data.train));
    for (field, dataset) in train.chain(spec.data.validation.iter().map(|d| ("data.validation", d))) {
        if problems.iter().any(|p| p.field.starts_with(field)) {
            continue;
        }
        let needs = if field == "data.validation" { data::validation_algorithm(spec) } else { spec.algorithm };
        if let Err(problem) = data::check_async(dataset, needs, field).await {
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

    /// An integer written `2.0` is taken, in JSON and in YAML, as the spec's schema allows; a
    /// true fraction is still refused under its field.
    #[test]
    fn integers_may_be_written_with_a_zero_fraction() {
        let json =
            br#"{"algorithm": "sft", "model": {"path": "/m"}, "data": {"train": {"kind": "arithmetic", "size": 8.0}},
            "max_num_steps": 2.0, "seed": 1e1}"#;
        let spec = parse(json, Some("application/json")).unwrap();
        assert_eq!((spec.max_num_steps, spec.seed), (2, 10));
        let yaml = "algorithm: sft\nmodel: {path: /m}\ndata: {train: {kind: arithmetic}}\nmax_num_steps: 3.0\n";
        assert_eq!(parse(yaml.as_bytes(), Some("application/yaml")).unwrap().max_num_steps, 3);
        let e = parse(yaml.replace("3.0", "3.5").as_bytes(), Some("application/yaml")).unwrap_err();
        assert_eq!(e.field, "max_num_steps", "{e}");
    }

    /// Specs of YAML aliases are refused with a 422's message as soon as they have expanded
    /// past their own length: one that names a 2,000-item list 100,000 times (600 kB standing
    /// for 200 million values, the kind that took this service to 1.9 GB), and one whose
    /// levels each name the one below ten times (a few kilobytes standing for 10^16). A spec
    /// that uses an anchor for a small value is read.
    #[test]
    fn yaml_aliases_expand_no_further_than_the_text() {
        let head = "algorithm: sft\nmodel: {path: /m}\ndata: {train: {kind: arithmetic}}\n";
        let wide = format!("{head}x: &x [{}]\ny: [{}]\n", vec!["a"; 2000].join(", "), vec!["*x"; 100_000].join(", "));
        let mut deep = format!("{head}x0: &x0 [a, a, a, a, a, a, a, a, a, a]\n");
        for level in 1..16 {
            deep.push_str(&format!("x{level}: &x{level} [{}]\n", vec![format!("*x{}", level - 1); 10].join(", ")));
        }
        for bomb in [wide, deep] {
            let e = parse(bomb.as_bytes(), Some("application/yaml")).unwrap_err();
            assert_eq!(e.field, "spec");
            assert!(e.message.contains("without anchors and aliases"), "{e}");
        }
        let reused =
            "algorithm: sft\nmax_num_steps: &n 7\nseed: *n\nmodel: {path: /m}\ndata: {train: {kind: arithmetic}}\n";
        let spec = parse(reused.as_bytes(), Some("application/yaml")).unwrap();
        assert_eq!((spec.max_num_steps, spec.seed), (7, 7));
    }
}
