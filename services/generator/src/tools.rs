//! Tool calls, as vLLM serves them: the request's `tools` go to the model's chat template
//! (which writes them into the prompt in the model's own format), and the calls the model
//! writes are parsed from its output by the parser the settings name (`tool_call_parser`,
//! vLLM's `--tool-call-parser`). Output that does not parse as calls is returned as content.
//!
//! `tool_choice` `auto` lets the model choose; `none` renders no tools and parses nothing;
//! `required` and a named function constrain sampling to a call in the parser's format
//! ([`crate::structured::Guides::tool_call`]).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::wire::{ToolCall, ToolFunction};

/// How the model writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolParser {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call, after
    /// any text (Hermes, Qwen 2.5 and 3).
    Hermes,
    /// The whole output one or more JSON objects `{"name": ..., "parameters": {...}}`,
    /// separated by `;`, optionally after `<|python_tag|>` (Llama 3.1 to 3.3).
    Llama3Json,
    /// `<|tool_call|>` and a JSON list of `{"name": ..., "arguments": {...}}`, after any text
    /// (Granite 3).
    Granite,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const GRANITE_TAG: &str = "<|tool_call|>";

/// An output split into content and calls.
#[derive(Debug, Default, PartialEq)]
pub struct Parsed {
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
}

impl Parsed {
    fn content(text: &str) -> Self {
        Self { content: Some(text.to_string()), calls: Vec::new() }
    }
}

impl ToolParser {
    /// Where a call starts in `text`, if one does: streaming shows the text before it only.
    pub fn start(self, text: &str) -> Option<usize> {
        match self {
            Self::Hermes => text.find(HERMES_OPEN),
            Self::Granite => text.find(GRANITE_TAG),
            Self::Llama3Json => {
                let at = text.len() - text.trim_start().len();
                let rest = &text[at..];
                (rest.starts_with('{') || rest.starts_with(PYTHON_TAG)).then_some(at)
            }
        }
    }

    /// How much of `text`, a sample's output so far, may be streamed as content: what comes
    /// before a call, less any tail that may be the start of one.
    pub fn shown(self, text: &str) -> usize {
        if let Some(at) = self.start(text) {
            return at;
        }
        match self {
            Self::Hermes | Self::Granite => {
                let tag = if self == Self::Hermes { HERMES_OPEN } else { GRANITE_TAG };
                let partial = (1..tag.len()).rev().find(|&n| text.ends_with(&tag[..n]));
                text.len() - partial.unwrap_or(0)
            }
            Self::Llama3Json => {
                let at = text.len() - text.trim_start().len();
                if PYTHON_TAG.starts_with(&text[at..]) { at } else { text.len() }
            }
        }
    }

    /// The calls in `text` and the content around them; text that does not parse as calls is
    /// all content.
    pub fn parse(self, text: &str) -> Parsed {
        let Some(start) = self.start(text) else { return Parsed::content(text) };
        let calls = match self {
            Self::Hermes => hermes_calls(&text[start..]),
            Self::Llama3Json => llama3_calls(text[start..].trim_start_matches(PYTHON_TAG)),
            Self::Granite => granite_calls(&text[start + GRANITE_TAG.len()..]),
        };
        match calls {
            Some(calls) if !calls.is_empty() => {
                let before = text[..start].trim();
                Parsed { content: (!before.is_empty()).then(|| before.to_string()), calls }
            }
            _ => Parsed::content(text),
        }
    }
}

/// The calls of `<tool_call>` blocks (the last may lack its closing tag when the output
/// ended there); `None` if any block is not a call.
fn hermes_calls(text: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find(HERMES_OPEN) {
        if !rest[..open].trim().is_empty() && !calls.is_empty() {
            return None;
        }
        let body = &rest[open + HERMES_OPEN.len()..];
        let (block, after) = match body.find(HERMES_CLOSE) {
            Some(close) => (&body[..close], &body[close + HERMES_CLOSE.len()..]),
            None => (body, ""),
        };
        calls.push(call(&serde_json::from_str(block.trim()).ok()?, "arguments")?);
        rest = after;
    }
    rest.trim().is_empty().then_some(calls)
}

/// The JSON objects of a Llama 3 output, separated by `;`; `None` unless all are calls.
fn llama3_calls(text: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let value = values.next()?.ok()?;
        calls.push(call(&value, "parameters")?);
        rest = rest[values.byte_offset()..].trim_start().trim_start_matches(';').trim_start();
    }
    Some(calls)
}

/// The calls of a Granite output after its `<|tool_call|>`: one JSON list of calls (a single
/// call object is read as a list of one); `None` unless all are calls and nothing follows.
fn granite_calls(text: &str) -> Option<Vec<ToolCall>> {
    let mut values = serde_json::Deserializer::from_str(text.trim()).into_iter::<Value>();
    let value = values.next()?.ok()?;
    if !text.trim()[values.byte_offset()..].trim().is_empty() {
        return None;
    }
    match value {
        Value::Array(items) => items.iter().map(|item| call(item, "arguments")).collect(),
        object @ Value::Object(_) => Some(vec![call(&object, "arguments")?]),
        _ => None,
    }
}

/// A call from `{"name": ..., <arguments>: {...}}` (`arguments` or `parameters` either way).
fn call(value: &Value, arguments: &str) -> Option<ToolCall> {
    let name = value.get("name")?.as_str()?.to_string();
    let args = value.get(arguments).or_else(|| value.get("arguments")).or_else(|| value.get("parameters"));
    let arguments = match args {
        None => "{}".to_string(),
        Some(Value::String(text)) => text.clone(),
        Some(other) => other.to_string(),
    };
    Some(ToolCall {
        id: format!("call_{:024x}", rand::random::<u128>() >> 32),
        kind: "function".into(),
        function: ToolFunction { name, arguments },
    })
}

/// The `tools` of a request as the template and the checks need them: each a function with
/// a name. `None` for no tools.
pub fn tool_names(tools: &Value) -> Result<Vec<String>, String> {
    let Some(list) = tools.as_array() else { return Err("tools must be a list".into()) };
    list.iter()
        .map(|tool| {
            if tool.get("type").and_then(Value::as_str).is_some_and(|t| t != "function") {
                return Err("only tools of type function are served".into());
            }
            tool.pointer("/function/name")
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| "every tool needs function.name".to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn calls(parsed: &Parsed) -> Vec<(String, Value)> {
        parsed
            .calls
            .iter()
            .map(|c| (c.function.name.clone(), serde_json::from_str(&c.function.arguments).unwrap()))
            .collect()
    }

    #[test]
    fn hermes_blocks_become_calls_and_anything_else_stays_content() {
        let parser = ToolParser::Hermes;
        let text = "Let me add.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 4, \"b\": 5}}\n</tool_call>\n\
                    <tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>";
        let parsed = parser.parse(text);
        assert_eq!(parsed.content.as_deref(), Some("Let me add."));
        assert_eq!(
            calls(&parsed),
            [("add".to_string(), serde_json::json!({"a": 4, "b": 5})), ("now".to_string(), serde_json::json!({}))]
        );
        assert!(parsed.calls[0].id.starts_with("call_") && parsed.calls[0].id != parsed.calls[1].id);
        // Unterminated at the end (the stop token ended it), or with string arguments.
        let parsed = parser.parse("<tool_call>{\"name\": \"add\", \"arguments\": \"{\\\"a\\\": 1}\"}");
        assert_eq!(calls(&parsed), [("add".to_string(), serde_json::json!({"a": 1}))]);
        assert_eq!(parsed.content, None);
        for broken in ["<tool_call>{\"name\": \"add\", \"argu", "<tool_call>[1, 2]</tool_call>", "no call at all"] {
            assert_eq!(parser.parse(broken), Parsed::content(broken), "{broken}");
        }
        assert_eq!(parser.start("abc <tool_call>"), Some(4));
        assert_eq!((parser.shown("abc <tool_c"), parser.shown("abc <"), parser.shown("abc <b>")), (4, 4, 7));
    }

    #[test]
    fn llama3_json_objects_become_calls_and_anything_else_stays_content() {
        let parser = ToolParser::Llama3Json;
        let text =
            "<|python_tag|>{\"name\": \"add\", \"parameters\": {\"a\": 4}}; {\"name\": \"now\", \"parameters\": {}}";
        let parsed = parser.parse(text);
        assert_eq!(parsed.content, None);
        assert_eq!(
            calls(&parsed),
            [("add".to_string(), serde_json::json!({"a": 4})), ("now".to_string(), serde_json::json!({}))]
        );
        assert_eq!(calls(&parser.parse(" {\"name\": \"f\", \"arguments\": {\"x\": [1]}}")).len(), 1);
        for broken in ["The answer is 9.", "{\"name\": \"add\", \"parameters\": {\"a\"", "{\"a\": 1}", "{\"name\": 3}"]
        {
            assert_eq!(parser.parse(broken), Parsed::content(broken), "{broken}");
        }
        assert_eq!(parser.start("The answer"), None);
        assert_eq!((parser.shown(" <|pyth"), parser.shown("The answer"), parser.shown("")), (1, 10, 0));
    }

    #[test]
    fn granite_lists_become_calls_and_anything_else_stays_content() {
        let parser = ToolParser::Granite;
        let text = "Adding.<|tool_call|>[{\"name\": \"add\", \"arguments\": {\"a\": 4}}, {\"name\": \"now\", \"arguments\": {}}]";
        let parsed = parser.parse(text);
        assert_eq!(parsed.content.as_deref(), Some("Adding."));
        assert_eq!(
            calls(&parsed),
            [("add".to_string(), serde_json::json!({"a": 4})), ("now".to_string(), serde_json::json!({}))]
        );
        let one = parser.parse("<|tool_call|>{\"name\": \"now\", \"arguments\": {}}");
        assert_eq!(calls(&one), [("now".to_string(), serde_json::json!({}))]);
        for broken in ["<|tool_call|>[{\"name\": \"add\"", "<|tool_call|>[1]", "<|tool_call|>[] and more", "plain"] {
            assert_eq!(parser.parse(broken), Parsed::content(broken), "{broken}");
        }
        assert_eq!((parser.shown("abc <|tool"), parser.shown("abc")), (4, 3));
    }
}
