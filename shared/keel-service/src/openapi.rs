//! What every Keel OpenAPI document shares.
//!
//! - [`ErrorResponses`]: what every operation can answer besides its own responses — 400 (a
//!   query, path or body that does not parse), 401 (a token is configured and the request
//!   lacks it), 404 (an operation with path parameters: no such resource) and 422 (an
//!   operation with a body: it does not fit) — and a body for every error status an
//!   operation lists, the service's JSON error body; so a client generated from the
//!   document, or a fuzzer checking it, meets no status or body it was not told about.
//! - [`BearerAuth`]: the `bearer` security scheme, for the services that take a token.
//! - [`document`]: the document as committed: the variants of tagged unions made
//!   satisfiable, and what utoipa writes in forms some generators cannot read rewritten into
//!   standard ones.

use utoipa::openapi::schema::{ObjectBuilder, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{ContentBuilder, OpenApi, Ref, RefOr, ResponseBuilder, Schema};

/// The name of the Keel error body's schema (`{"error": {"type", "message"}}`).
pub const KEEL_ERROR: &str = "KeelError";

/// The name of the security scheme [`BearerAuth`] declares.
pub const BEARER: &str = "bearer";

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

/// What an error status means when an operation does not say.
fn error_description(status: &str) -> &'static str {
    match status {
        "400" => "The request does not parse: a query or path parameter, or the body",
        "401" => "A token is configured and the request does not carry it: send `Authorization: Bearer <token>`",
        "404" => "No such resource",
        "409" => "The resource is not in a state that allows this",
        "413" => "The body is larger than allowed",
        "416" => "The range is not satisfiable",
        "422" => "The body does not fit; the message names the field",
        "429" => "Too many requests: retry after `Retry-After` seconds",
        "500" => "An internal error (the service's log has the details)",
        "502" => "A service this one depends on failed",
        "503" => "Busy: retry after `Retry-After` seconds",
        "507" => "The store is full",
        _ => "An error",
    }
}

/// Adds the statuses above to every operation of `openapi` that does not document them, and
/// gives every error status (4xx, 5xx) an operation lists without a body the body `schema`
/// (a component's name), as JSON.
pub fn add_error_responses(openapi: &mut OpenApi, schema: &str) {
    let content = || ContentBuilder::new().schema(Some(Ref::from_schema_name(schema))).build();
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
            let mut statuses = vec!["400", "401"];
            if path.contains('{') {
                statuses.push("404");
            }
            if operation.request_body.is_some() {
                statuses.push("422");
            }
            for status in statuses {
                operation.responses.responses.entry(status.to_string()).or_insert_with(|| {
                    let response = ResponseBuilder::new().description(error_description(status));
                    RefOr::T(response.content("application/json", content()).build())
                });
            }
            for (status, response) in operation.responses.responses.iter_mut() {
                let RefOr::T(response) = response else { continue };
                if !(status.starts_with('4') || status.starts_with('5')) || !response.content.is_empty() {
                    continue;
                }
                if response.description.is_empty() {
                    response.description = error_description(status).to_string();
                }
                response.content.insert("application/json".to_string(), content());
            }
        }
    }
}

/// Declares the `bearer` security scheme and asks every operation for it: for the services
/// that take a token (`api_token`, the generator's `api_key`). Without one configured, a
/// service asks for none.
#[derive(Debug)]
pub struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut OpenApi) {
        let scheme = HttpBuilder::new().scheme(HttpAuthScheme::Bearer).description(Some(
            "`Authorization: Bearer <token>` (the scheme's name in any case) when the service is configured \
             with a token; without one, no credentials are asked for.",
        ));
        let components = openapi.components.get_or_insert_with(Default::default);
        components.security_schemes.insert(BEARER.to_string(), SecurityScheme::Http(scheme.build()));
        openapi.security = Some(vec![SecurityRequirement::new(BEARER, Vec::<String>::new())]);
    }
}

/// Makes the variants of internally tagged enums (`#[serde(tag = "name")]` over structs that
/// deny unknown fields) satisfiable: utoipa writes each as `allOf: [the struct, {name}]`,
/// which no value can match when the struct forbids properties it does not list (`name`
/// among them). Each such `allOf` becomes the struct's schema with the tag property added.
/// ([`document`] does this on the JSON: utoipa cannot read back every schema it writes, such
/// as a `serde_json::Value` field's.)
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

/// The document as committed: `openapi` as JSON with the variants of tagged unions made
/// satisfiable (`merge_tagged_variants`) and three rewrites, so that every generator reads
/// it as the service means it (`openapi-python-client` is run over `openapi/keel.yaml` by
/// the orchestrator's tests):
///
/// - a `oneOf` or `allOf` of one reference (how utoipa writes a referenced field with a
///   default) becomes the reference with the default beside it, as JSON Schema 2020-12
///   allows; generators that turn every `oneOf` into a union, or refuse an object default on
///   a union, read it as the referenced type;
/// - each variant of a component's `oneOf` that has a `title` becomes a component of that
///   name, referenced from the union: inline variants get generated names that can collide
///   (`RunEvent_type_1`) and their own inline objects are generated twice;
/// - integer ranges are the Rust types' own: utoipa (with `non_strict_integers`) writes
///   `format: u-int32` and the like, which no generator or validator knows, and without that
///   feature writes `u32` as `int32`, half its range. They become the standard `int32` or
///   `int64` with the type's `minimum` and `maximum` (`u64` stays `int64` from 0).
pub fn document(openapi: &OpenApi) -> serde_json::Value {
    let mut document = serde_json::to_value(openapi).unwrap_or_default();
    let schemas = document["components"]["schemas"].clone();
    merge_tagged_variants(&mut document, &schemas);
    lift_titled_variants(&mut document);
    rewrite(&mut document, &|node| {
        inline_single_reference(node);
        standard_integer(node);
    });
    document
}

/// Applies `f` to `node` and to everything inside it, parents first.
fn rewrite(node: &mut serde_json::Value, f: &dyn Fn(&mut serde_json::Value)) {
    use serde_json::Value;
    f(node);
    match node {
        Value::Object(map) => map.values_mut().for_each(|v| rewrite(v, f)),
        Value::Array(items) => items.iter_mut().for_each(|v| rewrite(v, f)),
        _ => {}
    }
}

/// `{oneOf: [{$ref, description?}], default?, description?}` (or `allOf`) as
/// `{$ref, description?, default?}`.
fn inline_single_reference(node: &mut serde_json::Value) {
    const BESIDE: [&str; 6] = ["default", "description", "title", "deprecated", "readOnly", "writeOnly"];
    let Some(map) = node.as_object_mut() else { return };
    for keyword in ["oneOf", "allOf"] {
        let single = match map.get(keyword).and_then(|v| v.as_array()).map(Vec::as_slice) {
            Some([only]) if only.get("$ref").is_some() => only.clone(),
            _ => continue,
        };
        if map.keys().any(|key| key != keyword && !BESIDE.contains(&key.as_str())) {
            continue;
        }
        let Some(mut merged) = single.as_object().cloned() else { continue };
        map.remove(keyword);
        merged.extend(std::mem::take(map));
        *map = merged;
        return;
    }
}

/// Each titled inline variant of a component's `oneOf` as a component of its title.
fn lift_titled_variants(document: &mut serde_json::Value) {
    let Some(schemas) = document.pointer_mut("/components/schemas").and_then(|s| s.as_object_mut()) else {
        return;
    };
    let mut lifted = Vec::new();
    for schema in schemas.values_mut() {
        let Some(variants) = schema.get_mut("oneOf").and_then(|v| v.as_array_mut()) else { continue };
        for variant in variants {
            let Some(title) = variant.get("title").and_then(|t| t.as_str()).map(str::to_string) else { continue };
            if variant.get("$ref").is_some() {
                continue;
            }
            let reference = serde_json::json!({"$ref": format!("#/components/schemas/{title}")});
            lifted.push((title, std::mem::replace(variant, reference)));
        }
    }
    for (title, variant) in lifted {
        let previous = schemas.insert(title.clone(), variant);
        assert!(previous.is_none(), "a variant's title `{title}` is also a component's name");
    }
}

/// An integer schema's format and range as the standard formats can say them.
fn standard_integer(node: &mut serde_json::Value) {
    use serde_json::Value;
    let Some(map) = node.as_object_mut() else { return };
    let (format, low, high): (&str, i64, Option<u64>) = match map.get("format").and_then(Value::as_str) {
        Some("int8") => ("int32", i8::MIN.into(), Some(i8::MAX as u64)),
        Some("int16") => ("int32", i16::MIN.into(), Some(i16::MAX as u64)),
        Some("u-int8" | "uint8") => ("int32", 0, Some(u8::MAX.into())),
        Some("u-int16" | "uint16") => ("int32", 0, Some(u16::MAX.into())),
        Some("u-int32" | "uint32") => ("int64", 0, Some(u32::MAX.into())),
        Some("u-int64" | "uint64") => ("int64", 0, None),
        _ => return,
    };
    map.insert("format".into(), format.into());
    let minimum = map.get("minimum").and_then(Value::as_f64).unwrap_or(f64::MIN);
    if minimum < low as f64 {
        map.insert("minimum".into(), low.into());
    }
    if let Some(high) = high
        && map.get("maximum").and_then(Value::as_f64).is_none_or(|maximum| maximum > high as f64)
    {
        map.insert("maximum".into(), high.into());
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;
    use utoipa::Modify;

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

    /// A referenced field with a default, a titled variant and a `u32` become what every
    /// generator reads; an untitled variant, a nullable reference and an `i64` stay as they are.
    #[test]
    fn the_document_is_written_in_forms_every_generator_reads() {
        let mut openapi: OpenApi = serde_json::from_value(json!({
            "openapi": "3.1.0",
            "info": {"title": "t", "version": "1"},
            "paths": {},
            "components": {"schemas": {
                "Inner": {"type": "object", "properties": {"on": {"type": "boolean", "default": false}}},
                "Outer": {"type": "object", "properties": {
                    "inner": {"oneOf": [{"$ref": "#/components/schemas/Inner", "description": "d"}],
                        "default": {"on": false}},
                    "maybe": {"oneOf": [{"type": "null"}, {"$ref": "#/components/schemas/Inner"}]},
                    "moves": {"type": "integer", "format": "u-int32", "minimum": 0},
                    "small": {"type": "integer", "format": "u-int8", "minimum": 1},
                    "step": {"type": "integer", "format": "u-int64", "minimum": 0},
                    "offset": {"type": "integer", "format": "int64"},
                }},
                "Event": {"oneOf": [
                    {"type": "object", "title": "EventA", "properties": {"kind": {"type": "string", "enum": ["a"]}}},
                    {"type": "object", "properties": {"kind": {"type": "string", "enum": ["b"]}}},
                ]},
            }},
        }))
        .unwrap();
        BearerAuth.modify(&mut openapi);
        let document = document(&openapi);
        let schemas = &document["components"]["schemas"];
        assert_eq!(
            schemas["Outer"]["properties"]["inner"],
            json!({"$ref": "#/components/schemas/Inner", "description": "d", "default": {"on": false}})
        );
        assert_eq!(
            schemas["Outer"]["properties"]["maybe"],
            json!({"oneOf": [{"type": "null"}, {"$ref": "#/components/schemas/Inner"}]})
        );
        assert_eq!(
            schemas["Outer"]["properties"]["moves"],
            json!({"type": "integer", "format": "int64", "minimum": 0, "maximum": 4_294_967_295u64})
        );
        assert_eq!(
            schemas["Outer"]["properties"]["small"],
            json!({"type": "integer", "format": "int32", "minimum": 1, "maximum": 255})
        );
        assert_eq!(schemas["Outer"]["properties"]["step"], json!({"type": "integer", "format": "int64", "minimum": 0}));
        assert_eq!(schemas["Outer"]["properties"]["offset"], json!({"type": "integer", "format": "int64"}));
        assert_eq!(schemas["Event"]["oneOf"][0], json!({"$ref": "#/components/schemas/EventA"}));
        assert_eq!(schemas["EventA"]["properties"]["kind"]["enum"], json!(["a"]));
        assert!(schemas["Event"]["oneOf"][1]["properties"].is_object());
        assert_eq!(document["components"]["securitySchemes"]["bearer"]["scheme"], "bearer");
        assert_eq!(document["security"], json!([{"bearer": []}]));
    }

    /// Every error status an operation lists gets the error body, with a description when it
    /// has none; the statuses every operation can answer are added.
    #[test]
    fn every_error_status_has_the_error_body() {
        let mut openapi: OpenApi = serde_json::from_value(json!({
            "openapi": "3.1.0",
            "info": {"title": "t", "version": "1"},
            "paths": {"/v1/things/{id}": {"post": {
                "requestBody": {"content": {"application/json": {"schema": {"type": "object"}}}},
                "responses": {
                    "200": {"description": "ok"},
                    "409": {"description": ""},
                    "503": {"description": "Busy", "content": {"text/plain": {"schema": {"type": "string"}}}},
                },
            }}},
        }))
        .unwrap();
        ErrorResponses.modify(&mut openapi);
        let document = serde_json::to_value(&openapi).unwrap();
        let responses = &document["paths"]["/v1/things/{id}"]["post"]["responses"];
        let body = json!({"application/json": {"schema": {"$ref": "#/components/schemas/KeelError"}}});
        for status in ["400", "401", "404", "409", "422"] {
            assert_eq!(responses[status]["content"], body, "{status}");
            assert!(!responses[status]["description"].as_str().unwrap().is_empty(), "{status}");
        }
        assert!(responses["200"].get("content").is_none());
        assert_eq!(responses["503"]["content"], json!({"text/plain": {"schema": {"type": "string"}}}));
    }
}
