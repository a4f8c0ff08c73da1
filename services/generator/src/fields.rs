//! The request fields of OpenAI's completions and chat APIs, and vLLM's extensions, that the
//! generator does not serve. None is ignored in silence: a field whose value would change the
//! output is refused (400, naming the field) unless it holds its neutral value (`null`,
//! `logit_bias: {}`, `repetition_penalty: 1`, ...); fields that never change the output
//! (`user`, `metadata`, ...) are taken and have no effect. A field neither API has is
//! logged and ignored, as vLLM ignores it.

use serde_json::{Map, Value};

/// What the generator does with a field it does not serve.
#[derive(Clone, Copy)]
enum Rule {
    /// Refused unless `neutral(value)`; `served` says what is served instead.
    Refused { neutral: fn(&Value) -> bool, served: &'static str },
    /// Taken; it changes nothing the generator computes.
    NoEffect,
    /// Served, read from the request's other fields elsewhere ([`crate::structured`],
    /// `logit_bias` in [`crate::openai`]).
    Served,
}

fn null(value: &Value) -> bool {
    value.is_null()
}

fn null_or_false(value: &Value) -> bool {
    value.is_null() || *value == Value::Bool(false)
}

fn null_or_true(value: &Value) -> bool {
    value.is_null() || *value == Value::Bool(true)
}

fn null_or_one(value: &Value) -> bool {
    value.is_null() || value.as_f64() == Some(1.0)
}

fn null_or_empty(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Object(map) => map.is_empty(),
        Value::Array(list) => list.is_empty(),
        Value::String(text) => text.is_empty(),
        _ => false,
    }
}

fn no_tool(value: &Value) -> bool {
    value.is_null() || value.as_str() == Some("none")
}

fn text_modality(value: &Value) -> bool {
    value.is_null() || *value == serde_json::json!(["text"])
}

const TOOLS: &str = "tools are served on /v1/chat/completions";

/// Every field of either API (or vLLM's) that the request types do not take.
const FIELDS: &[(&str, Rule)] = &[
    ("tools", Rule::Refused { neutral: null_or_empty, served: TOOLS }),
    ("tool_choice", Rule::Refused { neutral: no_tool, served: TOOLS }),
    ("functions", Rule::Refused { neutral: null_or_empty, served: "use tools (functions is deprecated)" }),
    ("function_call", Rule::Refused { neutral: no_tool, served: "use tool_choice (function_call is deprecated)" }),
    ("parallel_tool_calls", Rule::NoEffect),
    ("response_format", Rule::Served),
    ("guided_json", Rule::Served),
    ("guided_regex", Rule::Served),
    ("guided_choice", Rule::Served),
    ("guided_grammar", Rule::Served),
    ("guided_decoding_backend", Rule::NoEffect),
    (
        "guided_whitespace_pattern",
        Rule::Refused { neutral: null, served: "the JSON grammar's own whitespace is served" },
    ),
    ("structured_outputs", Rule::Served),
    ("logit_bias", Rule::Served),
    ("allowed_token_ids", Rule::Refused { neutral: null, served: "restricting the vocabulary is not served" }),
    ("suffix", Rule::Refused { neutral: null_or_empty, served: "insertion (suffix) is not served" }),
    ("repetition_penalty", Rule::Refused { neutral: null_or_one, served: "only repetition_penalty 1 is served" }),
    ("length_penalty", Rule::Refused { neutral: null_or_one, served: "beam search is not served" }),
    ("use_beam_search", Rule::Refused { neutral: null_or_false, served: "beam search is not served" }),
    (
        "truncate_prompt_tokens",
        Rule::Refused { neutral: null, served: "prompts are not truncated: an over-long prompt is a 400" },
    ),
    ("logits_processors", Rule::Refused { neutral: null_or_empty, served: "logits processors are not served" }),
    (
        "skip_special_tokens",
        Rule::Refused { neutral: null_or_true, served: "special tokens are always left out of the text" },
    ),
    (
        "spaces_between_special_tokens",
        Rule::Refused { neutral: null_or_true, served: "only the tokenizer's own decoding is served" },
    ),
    (
        "return_tokens_as_token_ids",
        Rule::Refused { neutral: null_or_false, served: "use return_token_ids for the token ids" },
    ),
    (
        "continue_final_message",
        Rule::Refused { neutral: null_or_false, served: "continuing the final message is not served" },
    ),
    ("echo", Rule::Refused { neutral: null_or_false, served: "echo is served on /v1/completions only" }),
    ("chat_template", Rule::Refused { neutral: null, served: "the model's own chat template is served, no other" }),
    ("documents", Rule::Refused { neutral: null_or_empty, served: "documents for the chat template are not served" }),
    ("audio", Rule::Refused { neutral: null, served: "audio output is not served" }),
    ("modalities", Rule::Refused { neutral: text_modality, served: "text is the only modality served" }),
    ("prediction", Rule::Refused { neutral: null, served: "predicted outputs are not served" }),
    ("web_search_options", Rule::Refused { neutral: null, served: "web search is not served" }),
    (
        "reasoning_effort",
        Rule::Refused {
            neutral: null,
            served: "use chat_template_kwargs (e.g. enable_thinking) for reasoning templates",
        },
    ),
    ("mm_processor_kwargs", Rule::Refused { neutral: null_or_empty, served: "multimodal input is not served" }),
    ("user", Rule::NoEffect),
    ("metadata", Rule::NoEffect),
    ("store", Rule::NoEffect),
    ("service_tier", Rule::NoEffect),
    ("request_id", Rule::NoEffect),
    ("cache_salt", Rule::NoEffect),
    ("priority", Rule::NoEffect),
    ("kv_transfer_params", Rule::Refused { neutral: null, served: "disaggregated serving is not served" }),
    ("vllm_xargs", Rule::Refused { neutral: null_or_empty, served: "vLLM's extra arguments are not served" }),
];

/// A field refused, with why.
#[derive(Debug, PartialEq, Eq)]
pub struct Refusal {
    pub field: &'static str,
    pub message: String,
}

/// Checks the fields a request carries beyond those its type takes (`extra`), and `best_of`
/// against `n`; unknown fields are logged.
pub fn check(extra: &Map<String, Value>, n: usize) -> Result<(), Refusal> {
    let mut unknown = Vec::new();
    for (name, value) in extra {
        if name == "best_of" {
            if !value.is_null() && value.as_u64() != Some(n as u64) {
                let message = format!("best_of must equal n ({n}): choosing the best of more samples is not served");
                return Err(Refusal { field: "best_of", message });
            }
            continue;
        }
        match FIELDS.iter().find(|(field, _)| field == name) {
            Some((field, Rule::Refused { neutral, served })) if !neutral(value) => {
                return Err(Refusal { field, message: format!("{field} is not supported: {served}") });
            }
            Some(_) => {}
            None => unknown.push(name.as_str()),
        }
    }
    if !unknown.is_empty() {
        tracing::warn!(fields = ?unknown, "fields present in the request but not part of the API were ignored");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn extra(value: Value) -> Map<String, Value> {
        value.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn neutral_values_pass_and_others_are_refused_by_name() {
        let neutral = json!({"tools": [], "tool_choice": "none", "logit_bias": {}, "suffix": null,
            "repetition_penalty": 1.0, "response_format": {"type": "json_object"}, "best_of": 2, "user": "u-1",
            "skip_special_tokens": true, "modalities": ["text"], "metadata": {"a": "b"}, "something_else": 3});
        assert_eq!(check(&extra(neutral), 2), Ok(()));
        for (field, value) in [
            ("tools", json!([{"type": "function", "function": {"name": "f"}}])),
            ("tool_choice", json!("required")),
            ("suffix", json!("end")),
            ("repetition_penalty", json!(1.2)),
            ("use_beam_search", json!(true)),
            ("echo", json!(true)),
            ("best_of", json!(3)),
        ] {
            let refusal = check(&extra(json!({ field: value })), 2).expect_err(field);
            assert_eq!(refusal.field, field);
            assert!(refusal.message.starts_with(field), "{}", refusal.message);
        }
    }
}
