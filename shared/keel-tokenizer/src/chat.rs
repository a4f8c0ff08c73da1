//! Chat templates rendered with minijinja the way transformers renders them with Jinja2:
//! `trim_blocks` and `lstrip_blocks`, loop controls, Python string and dict methods,
//! `raise_exception`, `strftime_now`, and a `tojson` that writes what Python's
//! `json.dumps(ensure_ascii=False)` writes (insertion order, `", "` and `": "` separators).

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};

use crate::error::{Error, Result};

const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl ChatTemplate {
    pub fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| Error::ChatTemplate(format!("does not compile: {e}")))?;
        Ok(Self { env })
    }

    /// Renders `messages` (a JSON list of `{role, content, ...}`) with `extra` variables
    /// (special tokens, tools, ...) in scope.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        extra: &serde_json::Value,
    ) -> Result<String> {
        if !messages.is_array() {
            return Err(Error::ChatTemplate("messages must be a list".into()));
        }
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| Error::ChatTemplate(e.to_string()))?;
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            ..Value::from_serialize(extra)
        };
        template.render(ctx).map_err(|e| match e.kind() {
            ErrorKind::InvalidOperation if e.detail().is_some() => {
                Error::ChatTemplate(e.detail().unwrap_or_default().to_string())
            }
            _ => Error::ChatTemplate(format!("rendering failed: {e}")),
        })
    }
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> Result<String, minijinja::Error> {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    format_utc(secs, &format)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("strftime_now(`{format}`): {e}")))
}

/// `strftime` in UTC of `secs` since the Unix epoch (the codes chat templates use, %d %m %Y
/// %y %b %B %H %M %S %%, and the rest of jiff's); a code it does not know is an error.
pub fn format_utc(secs: i64, format: &str) -> Result<String, jiff::Error> {
    let at = jiff::Timestamp::from_second(secs)?.to_zoned(jiff::tz::TimeZone::UTC);
    jiff::fmt::strtime::format(format, &at)
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_python_json(&json, indent, sort_keys.unwrap_or(false), 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn write_python_json(
    value: &serde_json::Value,
    indent: Option<usize>,
    sort_keys: bool,
    depth: usize,
    out: &mut String,
) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * depth));
        }
    };
    let item_separator = if indent.is_some() { "," } else { ", " };
    match value {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                newline(out, depth + 1);
                write_python_json(item, indent, sort_keys, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            let mut entries: Vec<_> = map.iter().collect();
            if sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::Value::String(key.clone()).to_string());
                out.push_str(": ");
                write_python_json(item, indent, sort_keys, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        J::Array(_) => out.push_str("[]"),
        J::Object(_) => out.push_str("{}"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tojson_matches_python_separators_and_order() {
        let t = ChatTemplate::new("{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}").unwrap();
        let out = t.render(&json!([{"z": 1, "a": [1, "é\n"], "e": {}}]), false, &json!({})).unwrap();
        assert_eq!(
            out,
            "{\"z\": 1, \"a\": [1, \"é\\n\"], \"e\": {}}|{\n  \"z\": 1,\n  \"a\": [\n    1,\n    \"é\\n\"\n  ],\n  \"e\": {}\n}"
        );
    }

    #[test]
    fn raise_exception_message_comes_through() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}").unwrap();
        let err = t.render(&json!([]), false, &json!({})).unwrap_err();
        assert_eq!(err.to_string(), "chat template: roles must alternate");
    }

    #[test]
    fn strftime_formats_a_known_date() {
        // 2024-02-29 13:05:09 UTC
        assert_eq!(
            format_utc(1_709_211_909, "%d %b %Y %H:%M:%S %B %m %y %%").unwrap(),
            "29 Feb 2024 13:05:09 February 02 24 %"
        );
        assert!(format_utc(0, "%!").is_err(), "an unknown code is an error");
    }
}
