//! A run spec file as `keel run submit` and `keel run validate` send it: read as YAML (or
//! JSON when the file ends in `.json`), every `${VAR}` in a string value filled in from the
//! environment, then each `--set path.to.key=value` applied, and sent to the API as JSON.
//!
//! - `${VAR}` is the variable's value; an unset variable is an error naming it (every unset
//!   one at once, with the field it is in). `${VAR:-default}` gives `default` when `VAR` is
//!   unset or empty. `$${` is a literal `${`.
//! - A value that is one reference and nothing else (`max_num_steps: ${STEPS}`) takes the
//!   type its text has in YAML, as if it had been written there: `600` is a number, `true`
//!   a boolean. Anything around the reference keeps it a string.
//! - References work anywhere a value or key can be written, flow mappings included
//!   (`{steps: ${STEPS}}`); one in a comment is ignored.
//! - `--set` paths are dot-separated keys; a number indexes a list (`.0`, or one past its end
//!   to append). The value is YAML: `--set training.optimizer.lr=1e-5`,
//!   `--set data.train='{kind: arithmetic, size: 100}'`. Missing maps on the way are created.
//!   Overrides are applied in order, after the expansion, and are not expanded themselves.
//! - A JSONL or Parquet dataset (`data.train`, `data.validation`) whose `path` is a file
//!   here — relative to the spec file's directory, else to the working directory — is
//!   uploaded to the orchestrator (`POST /v1/datasets`) and sent as the path it answers, so
//!   a spec and its data travel together wherever the orchestrator runs. A path that is no
//!   file here (a directory, or a path on the orchestrator's disk) is sent as written.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde_json::Value;

/// The spec in `file`, expanded and overridden.
pub fn load_value(file: &Path, sets: &[String]) -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    let json = file.extension().is_some_and(|e| e == "json");
    resolve(&text, json, sets, &|name| std::env::var(name).ok()).with_context(|| format!("spec {}", file.display()))
}

/// The dataset files of `spec` that are here: each as the JSON pointer of its `path`, the
/// file (a relative path is looked for in `base`, the spec file's directory, then in the
/// working directory) and its `kind` (`jsonl`, `parquet`).
pub fn local_datasets(spec: &Value, base: &Path) -> Vec<(String, PathBuf, String)> {
    let mut found = Vec::new();
    for split in ["train", "validation"] {
        let dataset = &spec["data"][split];
        let kind = dataset["kind"].as_str().unwrap_or_default();
        let Some(path) = dataset["path"].as_str().filter(|_| kind == "jsonl" || kind == "parquet") else { continue };
        let written = Path::new(path);
        let candidates = if written.is_absolute() {
            vec![written.to_path_buf()]
        } else {
            vec![base.join(written), written.to_path_buf()]
        };
        if let Some(file) = candidates.into_iter().find(|c| c.is_file()) {
            found.push((format!("/data/{split}/path"), file, kind.to_string()));
        }
    }
    found
}

/// `text` parsed, expanded from `env` and overridden by `sets`.
///
/// Each `${...}` (and `$${`) is first replaced by a marker that is a plain scalar in any
/// YAML context (`{path: ${DIR}}` is not valid YAML as written), the text parsed, then the
/// markers in its values and keys filled in. A reference in a comment goes with the comment.
pub fn resolve(text: &str, json: bool, sets: &[String], env: &dyn Fn(&str) -> Option<String>) -> anyhow::Result<Value> {
    let (marked, references) = mark(text);
    let mut spec: Value = if json {
        serde_json::from_str(&marked).context("not valid JSON")?
    } else {
        serde_yaml_ng::from_str(&marked).context("not valid YAML")?
    };
    let mut unset = Vec::new();
    let mut fill = |text: &str, at: &str| -> Option<(String, bool)> {
        match expand(text, &references, env) {
            Ok(found) => Some(found),
            Err(Missing(names)) => {
                for name in names {
                    unset.push(format!("{at}: ${{{name}}} is not set (export {name}=… or write ${{{name}:-default}})"));
                }
                None
            }
        }
    };
    expand_values(&mut spec, "spec", &mut fill);
    if !unset.is_empty() {
        bail!("{}", unset.join("; "));
    }
    for set in sets {
        apply(&mut spec, set)?;
    }
    Ok(spec)
}

/// What a marker stands for.
#[derive(Debug, Clone, PartialEq)]
enum Reference {
    /// `${NAME}` or `${NAME:-default}`.
    Variable { name: String, default: Option<String> },
    /// `$${`: a literal `${`.
    Literal,
}

/// The marker for reference number `i`: letters, digits and underscores only.
fn marker(i: usize) -> String {
    format!("__keel_ref_{i}__")
}

/// `text` with every reference replaced by its marker, and the references in order.
fn mark(text: &str) -> (String, Vec<Reference>) {
    let (mut out, mut references) = (String::with_capacity(text.len()), Vec::new());
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        if let Some(escaped) = tail.strip_prefix("$${") {
            out.push_str(&marker(references.len()));
            references.push(Reference::Literal);
            rest = escaped;
        } else if let Some(open) = tail.strip_prefix("${")
            && let Some(close) = open.find('}')
        {
            let inner = &open[..close];
            let (name, default) = match inner.split_once(":-") {
                Some((name, default)) => (name, Some(default.to_string())),
                None => (inner, None),
            };
            out.push_str(&marker(references.len()));
            references.push(Reference::Variable { name: name.to_string(), default });
            rest = &open[close + 1..];
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    (out, references)
}

/// Fills in one string's markers (`text`, at field path `at`): the result and whether it was
/// one variable alone, or None when a variable is unset (noted by the filler).
type Fill<'a> = dyn FnMut(&str, &str) -> Option<(String, bool)> + 'a;

/// Fills in the markers of every string (and key) under `value`; `at` is its field path. A
/// string that was one variable alone takes the type its value has in YAML.
fn expand_values(value: &mut Value, at: &str, fill: &mut Fill<'_>) {
    match value {
        Value::String(text) if text.contains("__keel_ref_") => {
            if let Some((expanded, whole)) = fill(text, at) {
                *value = if whole { scalar(&expanded) } else { Value::String(expanded) };
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                expand_values(item, &format!("{at}[{i}]"), fill);
            }
        }
        Value::Object(fields) => {
            let keys: Vec<String> = fields.keys().filter(|k| k.contains("__keel_ref_")).cloned().collect();
            for key in keys {
                if let Some((expanded, _)) = fill(&key, &format!("{at}.{key}"))
                    && let Some(item) = fields.remove(&key)
                {
                    fields.insert(expanded, item);
                }
            }
            for (key, item) in fields.iter_mut() {
                expand_values(item, &format!("{at}.{key}"), fill);
            }
        }
        _ => {}
    }
}

/// Variables a string names that are not set.
#[derive(Debug, PartialEq)]
struct Missing(Vec<String>);

/// `text` with its markers filled in from `env`, and whether it was one variable alone.
fn expand(
    text: &str,
    references: &[Reference],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(String, bool), Missing> {
    let mut out = String::with_capacity(text.len());
    let mut missing = Vec::new();
    let (mut rest, mut found) = (text, Vec::new());
    while let Some(at) = rest.find("__keel_ref_") {
        let after = &rest[at + "__keel_ref_".len()..];
        let digits = after.chars().take_while(char::is_ascii_digit).count();
        let index = after[..digits].parse::<usize>().ok().filter(|_| after[digits..].starts_with("__"));
        let Some((index, reference)) = index.and_then(|i| Some((i, references.get(i)?))) else {
            out.push_str(&rest[..at + 1]);
            rest = &rest[at + 1..];
            continue;
        };
        out.push_str(&rest[..at]);
        match reference {
            Reference::Literal => out.push_str("${"),
            Reference::Variable { name, default } => {
                match (env(name).filter(|v| default.is_none() || !v.is_empty()), default) {
                    (Some(value), _) => out.push_str(&value),
                    (None, Some(default)) => out.push_str(default),
                    (None, None) => missing.push(name.clone()),
                }
            }
        }
        found.push(index);
        rest = &after[digits + 2..];
    }
    out.push_str(rest);
    if !missing.is_empty() {
        return Err(Missing(missing));
    }
    let alone = match found.as_slice() {
        [index] => matches!(references[*index], Reference::Variable { .. }) && text == marker(*index),
        _ => false,
    };
    Ok((out, alone))
}

/// `text` as YAML reads a plain scalar: a number, a boolean or null, else the string itself.
fn scalar(text: &str) -> Value {
    match serde_yaml_ng::from_str::<Value>(text) {
        Ok(value @ (Value::Number(_) | Value::Bool(_))) => value,
        _ => Value::String(text.to_string()),
    }
}

/// Applies one `path.to.key=value` override.
fn apply(spec: &mut Value, set: &str) -> anyhow::Result<()> {
    let Some((path, text)) = set.split_once('=') else {
        bail!("--set `{set}`: write it as path.to.key=value");
    };
    if path.is_empty() || path.split('.').any(str::is_empty) {
        bail!("--set `{set}`: `{path}` is not a dot-separated path of keys");
    }
    let value: Value =
        serde_yaml_ng::from_str(text).with_context(|| format!("--set `{set}`: the value is not valid YAML"))?;
    let mut here = spec;
    let mut walked = String::new();
    let keys: Vec<&str> = path.split('.').collect();
    for (i, key) in keys.iter().enumerate() {
        let last = i + 1 == keys.len();
        let place = if walked.is_empty() { "the spec".to_string() } else { format!("`{walked}`") };
        here = match here {
            Value::Object(fields) => {
                if last {
                    fields.insert((*key).to_string(), value);
                    return Ok(());
                }
                fields.entry(*key).or_insert_with(|| Value::Object(Default::default()))
            }
            Value::Array(items) => {
                let index: usize = key
                    .parse()
                    .map_err(|_| anyhow::anyhow!("--set `{set}`: {place} is a list; `{key}` is not an index"))?;
                if index > items.len() {
                    bail!("--set `{set}`: {place} has {} items; index {index} is past its end", items.len());
                }
                if index == items.len() {
                    items.push(if last { Value::Null } else { Value::Object(Default::default()) });
                }
                if last {
                    items[index] = value;
                    return Ok(());
                }
                &mut items[index]
            }
            other => bail!("--set `{set}`: {place} is {}, not a map or a list", kind(other)),
        };
        walked = if walked.is_empty() { (*key).to_string() } else { format!("{walked}.{key}") };
    }
    unreachable!("the loop returns at the last key")
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a map",
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "MODEL_DIR" => Some("/models/small".into()),
            "STEPS" => Some("600".into()),
            "EMPTY" => Some(String::new()),
            _ => None,
        }
    }

    fn resolved(text: &str, sets: &[&str]) -> anyhow::Result<Value> {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        resolve(text, false, &sets, &env)
    }

    #[test]
    fn references_are_filled_in_and_a_lone_reference_keeps_its_yaml_type() {
        let spec = resolved(
            "# ${NOT_SET} in a comment is left alone\nmodel: {path: ${MODEL_DIR}}\nmax_num_steps: ${STEPS}\n\
             name: run-${STEPS}\nprompt: {template: 'costs $5 ${X:-or less} $${literal}'}\nseed: ${EMPTY:-7}\n\
             scheduler: {total_steps: ${STEPS}}\n",
            &[],
        )
        .unwrap();
        assert_eq!(
            spec,
            json!({"model": {"path": "/models/small"}, "max_num_steps": 600, "name": "run-600",
                   "prompt": {"template": "costs $5 or less ${literal}"}, "seed": 7,
                   "scheduler": {"total_steps": 600}})
        );
    }

    #[test]
    fn every_unset_variable_is_named_with_its_field() {
        let error = resolved("model: {path: ${MODEL}}\nmax_num_steps: ${STEPS}\nname: ${A}-${B}\n", &[]).unwrap_err();
        let message = error.to_string();
        for part in ["spec.model.path: ${MODEL} is not set", "spec.name: ${A} is not set", "spec.name: ${B} is not set"]
        {
            assert!(message.contains(part), "{message}");
        }
        assert!(!message.contains("STEPS"), "{message}");
    }

    #[test]
    fn overrides_set_values_create_maps_and_index_lists() {
        let spec = resolved(
            "training: {optimizer: {lr: 0.1}}\nvalidation: {pass_at_k: [1, 4]}\n",
            &[
                "training.optimizer.lr=1e-5",
                "training.scheduler.warmup_steps=10",
                "validation.pass_at_k.1=8",
                "validation.pass_at_k.2=16",
                "data.train={kind: arithmetic, size: 100}",
                "name=sweep",
            ],
        )
        .unwrap();
        assert_eq!(
            spec,
            json!({"training": {"optimizer": {"lr": 1e-5}, "scheduler": {"warmup_steps": 10}},
                   "validation": {"pass_at_k": [1, 8, 16]},
                   "data": {"train": {"kind": "arithmetic", "size": 100}}, "name": "sweep"})
        );
    }

    #[test]
    fn bad_overrides_say_what_is_wrong() {
        let spec = "name: x\nvalidation: {pass_at_k: [1]}\n";
        for (set, wanted) in [
            ("name", "write it as path.to.key=value"),
            ("a..b=1", "not a dot-separated path"),
            ("name.first=1", "`name` is a string, not a map or a list"),
            ("validation.pass_at_k.x=1", "`validation.pass_at_k` is a list; `x` is not an index"),
            ("validation.pass_at_k.5=1", "has 1 items; index 5 is past its end"),
            ("name=[unclosed", "the value is not valid YAML"),
        ] {
            let error = format!("{:#}", resolved(spec, &[set]).unwrap_err());
            assert!(error.contains(wanted), "{set}: {error}");
        }
    }

    /// Dataset files here are found beside the spec file first, then in the working
    /// directory; directories, paths that are not here and other kinds are left alone.
    #[test]
    fn the_dataset_files_a_spec_names_here_are_found() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("train.jsonl"), "{}\n").unwrap();
        std::fs::create_dir(dir.path().join("hf")).unwrap();
        let spec = json!({"data": {
            "train": {"kind": "jsonl", "path": "train.jsonl"},
            "validation": {"kind": "parquet", "path": "hf"},
        }});
        let found = local_datasets(&spec, dir.path());
        assert_eq!(found, [("/data/train/path".to_string(), dir.path().join("train.jsonl"), "jsonl".to_string())]);
        let elsewhere = json!({"data": {"train": {"kind": "jsonl", "path": "/var/lib/keel/nowhere.jsonl"},
            "validation": {"kind": "arithmetic", "size": 4}}});
        assert!(local_datasets(&elsewhere, dir.path()).is_empty());
    }

    #[test]
    fn json_specs_are_read_as_json() {
        let spec = resolve(r#"{"max_num_steps": "${STEPS}"}"#, true, &[], &env).unwrap();
        assert_eq!(spec, json!({"max_num_steps": 600}));
        assert!(resolve("max_num_steps: 1", true, &[], &env).is_err());
    }
}
