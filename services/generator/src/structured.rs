//! Structured output: `response_format` (`json_object`, `json_schema`), vLLM's
//! `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` and its newer
//! `structured_outputs` ({`json` | `regex` | `choice` | `grammar`}), each compiled by
//! llguidance (the grammar engine vLLM and SGLang use) into a constraint that the engine
//! applies to every sample's logits at every step ([`keel_generation::guide`]). The output
//! parses under the schema, regex or grammar unless `max_tokens` cuts it first.
//!
//! Logprobs of a constrained sample are those of the masked distribution. The same engine
//! makes `tool_choice` `required` and named functions write a call that parses.

use std::path::Path;

use keel_generation::guide::{Constraint, ConstraintError, Guide};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Map, Value, json};

use crate::tools::ToolParser;

/// The grammar engine for one model's tokenizer.
pub struct Guides {
    factory: ParserFactory,
}

impl std::fmt::Debug for Guides {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Guides")
    }
}

impl Guides {
    /// The engine for the tokenizer in `tokenizer_json` over a vocabulary of `vocab` tokens
    /// (the model's; a tokenizer may have fewer), ending with `eos`.
    pub fn load(tokenizer_json: &Path, vocab: usize, eos: u32) -> Result<Self, String> {
        let text = std::fs::read_to_string(tokenizer_json).map_err(|e| format!("{}: {e}", tokenizer_json.display()))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", tokenizer_json.display()))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| e.to_string())?;
        words.resize(vocab.max(words.len()), Vec::new());
        let vocab = u32::try_from(words.len()).map_err(|e| e.to_string())?;
        let trie = TokTrie::from(&TokRxInfo::new(vocab, eos), &words);
        let env = std::sync::Arc::new(ApproximateTokEnv::new(trie));
        let factory = ParserFactory::new_simple(&(env as llguidance::toktrie::TokEnv)).map_err(|e| e.to_string())?;
        Ok(Self { factory })
    }

    /// A constraint that makes the model write one call of `tools` (of the one named `name`,
    /// when given) in `parser`'s format, its arguments under the tool's parameter schema:
    /// `tool_choice` `required` or a named function.
    pub fn tool_call(&self, parser: ToolParser, tools: &Value, name: Option<&str>) -> Result<Guide, String> {
        let key = match parser {
            ToolParser::Hermes | ToolParser::Granite => "arguments",
            ToolParser::Llama3Json => "parameters",
        };
        let calls: Vec<Value> = tools
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|tool| {
                let tool_name = tool.pointer("/function/name")?.as_str()?;
                if name.is_some_and(|n| n != tool_name) {
                    return None;
                }
                let parameters = tool.pointer("/function/parameters").cloned().unwrap_or(json!({"type": "object"}));
                Some(json!({"type": "object", "properties": {"name": {"const": tool_name}, key: parameters},
                    "required": ["name", key], "additionalProperties": false}))
            })
            .collect();
        let mut schema = match calls.len() {
            0 => return Err("no tool to call".into()),
            1 => calls.into_iter().next().unwrap_or_default(),
            _ => json!({"anyOf": calls}),
        };
        schema["x-guidance"] = compact();
        let grammar = match parser {
            ToolParser::Hermes => TopLevelGrammar::from_lark(format!(
                "start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: %json {schema}"
            )),
            ToolParser::Llama3Json => TopLevelGrammar::from_json_schema(schema),
            ToolParser::Granite => {
                let mut list = json!({"type": "array", "items": schema, "minItems": 1, "maxItems": 1});
                list["x-guidance"] = compact();
                TopLevelGrammar::from_lark(format!("start: \"<|tool_call|>\" calls\ncalls: %json {list}"))
            }
        };
        self.guide(grammar)
    }

    /// A constraint for `grammar`, or why it cannot be compiled.
    fn guide(&self, grammar: TopLevelGrammar) -> Result<Guide, String> {
        let parser = self.factory.create_parser(grammar).map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(error);
        }
        Ok(Guide::new(Box::new(Llg(matcher))))
    }
}

struct Llg(Matcher);

impl Constraint for Llg {
    /// Once the grammar is complete, only the end of sequence.
    fn allowed(&mut self) -> Result<Vec<u32>, ConstraintError> {
        self.0.compute_mask_or_eos().map(|mask| mask.as_slice().to_vec()).map_err(|e| ConstraintError(e.to_string()))
    }

    fn consume(&mut self, token: i64) -> Result<(), ConstraintError> {
        if self.0.is_stopped() {
            // The end of sequence after a complete grammar.
            return Ok(());
        }
        let token = u32::try_from(token).map_err(|e| ConstraintError(format!("token {token}: {e}")))?;
        self.0.consume_token(token).map_err(|e| ConstraintError(e.to_string()))
    }

    fn fork(&self) -> Box<dyn Constraint> {
        Box::new(Llg(self.0.deep_clone()))
    }
}

/// The request fields that ask for structured output (read from the fields the request types
/// do not name; see [`crate::fields`]).
pub const FIELDS: [&str; 6] =
    ["response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"];

/// A refusal: the field and why.
pub type Refusal = (&'static str, String);

/// The grammar a request asks for, if any: at most one of [`FIELDS`] may ask.
pub fn requested(extra: &Map<String, Value>) -> Result<Option<TopLevelGrammar>, Refusal> {
    let mut found = None;
    for field in FIELDS {
        let Some(value) = extra.get(field).filter(|v| !v.is_null()) else { continue };
        let grammar = match field {
            "response_format" => response_format(value),
            "structured_outputs" => structured_outputs(value),
            _ => guided(field.trim_start_matches("guided_"), value),
        }
        .map_err(|e| (field, e))?;
        if let Some(grammar) = grammar {
            if found.is_some() {
                return Err((field, "ask for one kind of structured output only".into()));
            }
            found = Some(grammar);
        }
    }
    Ok(found)
}

/// OpenAI's `response_format`: `text` (nothing), `json_object` or `json_schema`.
fn response_format(value: &Value) -> Result<Option<TopLevelGrammar>, String> {
    match value.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json_schema(serde_json::json!({"type": "object"})))),
        Some("json_schema") => {
            let schema = value.pointer("/json_schema/schema").ok_or("json_schema needs json_schema.schema")?;
            Ok(Some(json_schema(schema.clone())))
        }
        _ => Err("type is text, json_object or json_schema".into()),
    }
}

/// vLLM's `structured_outputs`: one of `json`, `regex`, `choice`, `grammar`.
fn structured_outputs(value: &Value) -> Result<Option<TopLevelGrammar>, String> {
    let Some(map) = value.as_object() else { return Err("an object with json, regex, choice or grammar".into()) };
    let mut asked = map.iter().filter(|(_, v)| !v.is_null());
    match (asked.next(), asked.next()) {
        (Some((kind, value)), None) => guided(kind, value),
        (None, _) => Ok(None),
        (Some(_), Some(_)) => Err("ask for one of json, regex, choice or grammar".into()),
    }
}

/// One guided kind: `json` (a schema, or its text), `regex`, `choice` (strings) or `grammar`
/// (Lark, llguidance's dialect).
fn guided(kind: &str, value: &Value) -> Result<Option<TopLevelGrammar>, String> {
    let text = || value.as_str().map(str::to_string).ok_or_else(|| format!("{kind} must be a string"));
    Ok(Some(match kind {
        "json" => match value {
            Value::String(text) => {
                json_schema(serde_json::from_str(text).map_err(|e| format!("the schema is not JSON: {e}"))?)
            }
            schema => json_schema(schema.clone()),
        },
        "regex" => TopLevelGrammar::from_regex(&text()?),
        "choice" => {
            let choices: Vec<&str> = value
                .as_array()
                .and_then(|list| list.iter().map(Value::as_str).collect())
                .filter(|list: &Vec<&str>| !list.is_empty())
                .ok_or("choice must be a non-empty list of strings")?;
            let alternatives: Vec<String> = choices.iter().map(|c| escape(c)).collect();
            TopLevelGrammar::from_regex(&format!("({})", alternatives.join("|")))
        }
        "grammar" => TopLevelGrammar::from_lark(text()?),
        other => return Err(format!("{other} is not a kind of structured output (json, regex, choice, grammar)")),
    }))
}

/// llguidance's JSON options: `", "` between items and `": "` after keys (as Python's
/// `json.dumps` and chat templates' `tojson` write JSON), no other whitespace: with
/// whitespace free, a model can spend its whole budget on it.
fn compact() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// The grammar of JSON under `schema`, written compactly (see [`compact`]).
fn json_schema(schema: Value) -> TopLevelGrammar {
    let mut schema = schema;
    if let Some(map) = schema.as_object_mut() {
        map.entry("x-guidance").or_insert_with(compact);
    }
    TopLevelGrammar::from_json_schema(schema)
}

/// `text` as a regex that matches it literally.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The constraint for a request's structured output, if it asks for one.
pub fn guide(guides: Option<&Guides>, extra: &Map<String, Value>) -> Result<Option<Guide>, Refusal> {
    let Some(grammar) = requested(extra)? else { return Ok(None) };
    let field = FIELDS.into_iter().find(|f| extra.get(*f).is_some_and(|v| !v.is_null())).unwrap_or("response_format");
    let guides = guides.ok_or((field, "structured output is not available for this model's tokenizer".to_string()))?;
    guides.guide(grammar).map(Some).map_err(|e| (field, format!("cannot compile it: {e}")))
}
