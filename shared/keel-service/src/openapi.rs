//! What every operation of a Keel OpenAPI document can answer besides its own responses:
//! 400 (a query, path or body that does not parse), 401 (a token is configured and the
//! request lacks it), 404 (an operation with path parameters: no such resource) and 422 (an
//! operation with a body: it does not fit), each with the service's JSON error body — so a
//! client generated from the document, or a fuzzer checking it, meets no status it was not
//! told about.

use utoipa::openapi::schema::{ObjectBuilder, Type};
use utoipa::openapi::{ContentBuilder, OpenApi, Ref, RefOr, ResponseBuilder, Schema};

/// The name of the Keel error body's schema (`{"error": {"type", "message"}}`).
pub const KEEL_ERROR: &str = "KeelError";

/// Adds Keel's error body as a component and the statuses above to every operation.
#[derive(Debug)]
pub struct ErrorResponses;

impl utoipa::Modify for ErrorResponses {
    fn modify(&self, openapi: &mut OpenApi) {
        let detail = ObjectBuilder::new()
            .property(
                "type",
                ObjectBuilder::new().schema_type(Type::String).description(Some("A stable snake_case code")),
            )
            .property("message", ObjectBuilder::new().schema_type(Type::String))
            .required("type")
            .required("message");
        let body = ObjectBuilder::new().property("error", detail).required("error").build();
        let components = openapi.components.get_or_insert_with(Default::default);
        components.schemas.entry(KEEL_ERROR.to_string()).or_insert(RefOr::T(Schema::Object(body)));
        add_error_responses(openapi, KEEL_ERROR);
    }
}

/// Adds the statuses above to every operation of `openapi` that does not document them,
/// with the body `schema` (a component's name).
pub fn add_error_responses(openapi: &mut OpenApi, schema: &str) {
    let response = |description: &str| {
        let content = ContentBuilder::new().schema(Some(Ref::from_schema_name(schema))).build();
        RefOr::T(ResponseBuilder::new().description(description).content("application/json", content).build())
    };
    for (path, item) in openapi.paths.paths.iter_mut() {
        let operations = [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.options,
            &mut item.head,
            &mut item.patch,
            &mut item.trace,
        ];
        for operation in operations.into_iter().flatten() {
            let mut statuses = vec![
                ("400", "The request does not parse: a query or path parameter, or the body"),
                (
                    "401",
                    "A token is configured and the request does not carry it: send `Authorization: Bearer <token>`",
                ),
            ];
            if path.contains('{') {
                statuses.push(("404", "No such resource"));
            }
            if operation.request_body.is_some() {
                statuses.push(("422", "The body does not fit; the message names the field"));
            }
            for (status, description) in statuses {
                operation.responses.responses.entry(status.to_string()).or_insert_with(|| response(description));
            }
        }
    }
}

/// Makes the variants of internally tagged enums (`#[serde(tag = "name")]` over structs that
/// deny unknown fields) satisfiable: utoipa writes each as `allOf: [the struct, {name}]`,
/// which no value can match when the struct forbids properties it does not list (`name`
/// among them). Each such `allOf` becomes the struct's schema with the tag property added.
#[derive(Debug)]
pub struct TaggedVariants;

impl utoipa::Modify for TaggedVariants {
    fn modify(&self, openapi: &mut OpenApi) {
        let Ok(mut document) = serde_json::to_value(&*openapi) else { return };
        let schemas = document["components"]["schemas"].clone();
        merge_tagged_variants(&mut document, &schemas);
        if let Ok(merged) = serde_json::from_value(document) {
            *openapi = merged;
        }
    }
}

fn merge_tagged_variants(node: &mut serde_json::Value, schemas: &serde_json::Value) {
    use serde_json::Value;
    if let Some(merged) = merged_variant(node, schemas) {
        *node = merged;
    }
    match node {
        Value::Object(map) => map.values_mut().for_each(|v| merge_tagged_variants(v, schemas)),
        Value::Array(items) => items.iter_mut().for_each(|v| merge_tagged_variants(v, schemas)),
        _ => {}
    }
}

/// `{allOf: [{$ref: S}, {type: object, required: [tag], properties: {tag}}]}` where `S`
/// forbids additional properties, as one object schema.
fn merged_variant(node: &serde_json::Value, schemas: &serde_json::Value) -> Option<serde_json::Value> {
    let [reference, tag] = node.get("allOf")?.as_array()?.as_slice() else { return None };
    let name = reference.get("$ref")?.as_str()?.strip_prefix("#/components/schemas/")?;
    let mut base = schemas.get(name)?.clone();
    if base.get("additionalProperties") != Some(&serde_json::Value::Bool(false)) {
        return None;
    }
    let tag_properties = tag.get("properties")?.as_object()?;
    let properties = base.get_mut("properties")?.as_object_mut()?;
    for (key, value) in tag_properties {
        properties.insert(key.clone(), value.clone());
    }
    let required = tag.get("required").and_then(|r| r.as_array()).cloned().unwrap_or_default();
    let base_required = base
        .as_object_mut()?
        .entry("required")
        .or_insert_with(|| serde_json::Value::Array(Vec::new()))
        .as_array_mut()?;
    base_required.extend(required);
    Some(base)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;

    #[test]
    fn a_tagged_variant_of_a_closed_struct_becomes_one_satisfiable_object() {
        let schemas = json!({"Math": {"type": "object", "properties": {"tol": {"type": "number"}}, "additionalProperties": false}});
        let mut node = json!({"oneOf": [{"allOf": [{"$ref": "#/components/schemas/Math"},
            {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "enum": ["math"]}}}]}]});
        merge_tagged_variants(&mut node, &schemas);
        assert_eq!(
            node,
            json!({"oneOf": [{"type": "object", "properties": {"tol": {"type": "number"},
                "name": {"type": "string", "enum": ["math"]}}, "additionalProperties": false, "required": ["name"]}]})
        );
        // An open struct's allOf is satisfiable as it is, and left alone.
        let open = json!({"Open": {"type": "object", "properties": {}}});
        let mut node = json!({"allOf": [{"$ref": "#/components/schemas/Open"}, {"type": "object", "required": ["name"], "properties": {"name": {}}}]});
        let before = node.clone();
        merge_tagged_variants(&mut node, &open);
        assert_eq!(node, before);
    }
}
