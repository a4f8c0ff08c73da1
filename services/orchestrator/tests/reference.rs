//! `docs/src/reference/run-spec.md` is generated from the run spec's JSON Schema (itself
//! generated from the code, `openapi/run-spec.schema.json`): every object the spec can hold,
//! each field with its type, default and description. This test fails when the page drifts
//! from the code; `KEEL_UPDATE_DOCS=1 cargo nextest run -p keel-orchestrator --test reference`
//! writes it.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeSet, VecDeque};

use keel_orchestrator::api::run_spec_schema;
use keel_testkit::docs::table_cell;
use serde_json::Value;

/// The definition a `$ref` names.
fn ref_name(value: &Value) -> Option<&str> {
    value.get("$ref")?.as_str()?.strip_prefix("#/$defs/")
}

/// The alternatives of a `oneOf`/`anyOf`/`allOf`, when `value` is one.
fn alternatives(value: &Value) -> Option<&Vec<Value>> {
    ["oneOf", "anyOf", "allOf"].iter().find_map(|k| value.get(*k)?.as_array())
}

/// A field's type as the reader needs it, with links to the objects it names; every
/// definition it names is queued for its own section.
fn type_of(value: &Value, queue: &mut VecDeque<String>) -> String {
    if let Some(name) = ref_name(value) {
        queue.push_back(name.to_string());
        return format!("[{name}](#{})", name.to_lowercase());
    }
    if let Some(list) = alternatives(value) {
        let (nulls, rest): (Vec<&Value>, Vec<&Value>) = list.iter().partition(|v| v["type"] == "null");
        let text: Vec<String> = rest.iter().map(|v| type_of(v, queue)).collect();
        let text = text.join(" or ");
        return if nulls.is_empty() { text } else { format!("{text} or null") };
    }
    if let Some(values) = value["enum"].as_array() {
        let names: Vec<String> =
            values.iter().map(|v| format!("`{}`", v.as_str().map_or(v.to_string(), String::from))).collect();
        return format!("one of {}", names.join(", "));
    }
    if let Some(constant) = value.get("const") {
        return format!("`{}`", constant.as_str().map_or(constant.to_string(), String::from));
    }
    let one = |kind: &str, queue: &mut VecDeque<String>| match kind {
        "array" => {
            let items = &value["items"];
            if items.is_object() { format!("list of {}", type_of(items, queue)) } else { "list".to_string() }
        }
        "object" => match value.get("additionalProperties") {
            Some(inner) if inner.is_object() => format!("map of string to {}", type_of(inner, queue)),
            _ => "object".to_string(),
        },
        other => other.to_string(),
    };
    match &value["type"] {
        Value::String(kind) => one(kind, queue),
        Value::Array(kinds) => {
            let kinds: Vec<String> = kinds.iter().filter_map(Value::as_str).map(|k| one(k, queue)).collect();
            kinds.join(" or ")
        }
        _ => "any".to_string(),
    }
}

/// A field's description: its own, or the one on the alternative that carries it.
fn description(value: &Value) -> String {
    if let Some(text) = value["description"].as_str() {
        return text.to_string();
    }
    alternatives(value)
        .and_then(|list| list.iter().find_map(|v| v["description"].as_str()))
        .map(String::from)
        .unwrap_or_default()
}

/// The field table of one object schema (of the type `name`). Each field without a
/// description is added to `undescribed` as `Type.field`, but for a tagged union's tag
/// (`tag`), which the variant's heading names.
fn fields(
    object: &Value,
    name: &str,
    tag: Option<&str>,
    queue: &mut VecDeque<String>,
    undescribed: &mut Vec<String>,
) -> String {
    let Some(properties) = object["properties"].as_object() else {
        return String::new();
    };
    let required: BTreeSet<&str> =
        object["required"].as_array().map(|r| r.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    let mut out = String::from("| field | type | default | description |\n|---|---|---|---|\n");
    for (field_name, field) in properties {
        let default = match field.get("default") {
            Some(value) => format!("`{value}`"),
            None if required.contains(field_name.as_str()) => "required".to_string(),
            None => String::new(),
        };
        let text = description(field);
        if text.trim().is_empty() && tag != Some(field_name.as_str()) {
            undescribed.push(format!("{name}.{field_name}"));
        }
        out.push_str(&format!(
            "| `{field_name}` | {} | {} | {} |\n",
            table_cell(&type_of(field, queue)),
            table_cell(&default),
            table_cell(&text)
        ));
    }
    out
}

/// The tag that tells a tagged union's variant apart, as (key, value) (`kind`, `jsonl`), when
/// it has one.
fn variant_tag(variant: &Value) -> Option<(&str, &str)> {
    let properties = variant["properties"].as_object()?;
    properties.iter().find_map(|(name, field)| {
        let values = field["enum"].as_array().filter(|v| v.len() == 1)?;
        Some((name.as_str(), values[0].as_str()?))
    })
}

/// The page, and the fields on it (`Type.field`) that have no description.
fn render(schema: &Value) -> (String, Vec<String>) {
    let defs = schema["$defs"].as_object().unwrap();
    let mut queue: VecDeque<String> = VecDeque::from([ref_name(schema).unwrap_or("RunSpec").to_string()]);
    let mut seen = BTreeSet::new();
    let mut page = String::new();
    let mut undescribed = Vec::new();
    while let Some(name) = queue.pop_front() {
        if !seen.insert(name.clone()) {
            continue;
        }
        let def = &defs[&name];
        page.push_str(&format!("## {name}\n\n"));
        let text = description(def);
        if !text.is_empty() {
            page.push_str(&format!("{}\n\n", text.trim()));
        }
        if let Some(variants) = alternatives(def).filter(|_| def.get("properties").is_none()) {
            let objects: Vec<&Value> = variants.iter().filter(|v| v["properties"].is_object()).collect();
            if objects.is_empty() {
                page.push_str(&format!("{}\n\n", type_of(def, &mut queue)));
            }
            for variant in objects {
                let tag = variant_tag(variant);
                let title = tag.map_or_else(|| "variant".to_string(), |(key, value)| format!("`{key}: {value}`"));
                page.push_str(&format!("### {name} {title}\n\n"));
                if let Some(text) = variant["description"].as_str() {
                    page.push_str(&format!("{}\n\n", text.trim()));
                }
                page.push_str(&fields(variant, &name, tag.map(|(key, _)| key), &mut queue, &mut undescribed));
                page.push('\n');
            }
        } else if def["properties"].is_object() {
            page.push_str(&fields(def, &name, None, &mut queue, &mut undescribed));
            page.push('\n');
        } else {
            page.push_str(&format!("{}\n\n", type_of(def, &mut queue)));
        }
    }
    (page, undescribed)
}

#[test]
fn the_run_spec_reference_page_is_the_schema_of_every_field() {
    let (page, undescribed) = render(&run_spec_schema());
    for section in ["## RunSpec", "## GrpoSpec", "## TrainingConfig", "## DatasetSpec", "## GenerationSpec"] {
        assert!(page.contains(section), "{section} is on the page");
    }
    assert!(page.contains("| `max_new_tokens` | integer | `256` |"), "defaults are shown");
    keel_testkit::docs::check_reference_page(
        "run-spec.md",
        &page,
        "cargo nextest run -p keel-orchestrator --test reference",
    );
    assert!(
        undescribed.is_empty(),
        "fields of the run spec without a description (add a `///` comment to each): {}",
        undescribed.join(", ")
    );
}

/// The check above lists every field of the page without a description, in variants too,
/// and takes a variant's tag as described by its heading.
#[test]
fn fields_without_a_description_are_listed() {
    let schema = serde_json::json!({
        "$ref": "#/$defs/Spec",
        "$defs": {
            "Spec": {"type": "object", "properties": {
                "told": {"type": "integer", "description": "A count."},
                "untold": {"type": "integer"},
                "choice": {"$ref": "#/$defs/Choice"},
            }},
            "Choice": {"oneOf": [
                {"type": "object", "properties": {
                    "size": {"type": ["integer", "null"]},
                    "kind": {"type": "string", "enum": ["one"]},
                }},
                {"type": "object", "properties": {
                    "seed": {"oneOf": [{"type": "null"}, {"type": "integer", "description": "Seeds it."}]},
                    "kind": {"type": "string", "enum": ["two"]},
                }},
            ]},
            "Unreached": {"type": "object", "properties": {"loose": {"type": "string"}}},
        },
    });
    let (page, mut undescribed) = render(&schema);
    assert!(page.contains("### Choice `kind: one`"), "{page}");
    undescribed.sort();
    assert_eq!(undescribed, ["Choice.size", "Spec.choice", "Spec.untold"]);
}
