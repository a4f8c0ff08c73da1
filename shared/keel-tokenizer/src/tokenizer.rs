//! A model directory's tokenizer: `tokenizer.json` through the `tokenizers` crate, special
//! tokens from `tokenizer_config.json` (else `special_tokens_map.json`), the chat template
//! from `chat_template.jinja` (where transformers v5 keeps it) or `tokenizer_config.json`,
//! and the ids that end generation from `generation_config.json`.

use std::path::Path;

use serde_json::{Map, Value, json};

use crate::chat::ChatTemplate;
use crate::error::{Error, Result};

pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
pub const SPECIAL_TOKENS_MAP_FILE: &str = "special_tokens_map.json";

#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Special token strings by name (`bos_token`, `eos_token`, `pad_token`, `unk_token`).
    special_tokens: Map<String, Value>,
    chat_template: Option<ChatTemplate>,
    eos_token_ids: Vec<i64>,
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(Error::io(path))?;
    serde_json::from_str(&text).map(Some).map_err(Error::json(path))
}

/// A special token is written either as a string or as an `AddedToken` object.
fn token_content(value: &Value) -> Option<&str> {
    value.as_str().or_else(|| value.get("content").and_then(Value::as_str))
}

/// An id or a list of ids.
fn id_list(value: Option<&Value>) -> Vec<i64> {
    match value {
        Some(Value::Array(items)) => items.iter().filter_map(Value::as_i64).collect(),
        Some(v) => v.as_i64().into_iter().collect(),
        None => Vec::new(),
    }
}

impl Tokenizer {
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join(TOKENIZER_FILE);
        if !path.is_file() {
            return Err(Error::Tokenizer(format!("{} not found", path.display())));
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config = read_json(&config_path)?.unwrap_or_else(|| json!({}));

        // tokenizer_config.json first, then special_tokens_map.json, as transformers merges them.
        let special_map = read_json(&dir.join(SPECIAL_TOKENS_MAP_FILE))?.unwrap_or_else(|| json!({}));
        let mut special_tokens = Map::new();
        for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
            if let Some(content) =
                config.get(key).and_then(token_content).or_else(|| special_map.get(key).and_then(token_content))
            {
                special_tokens.insert(key.into(), json!(content));
            }
        }

        let template_file = dir.join(CHAT_TEMPLATE_FILE);
        let template_source = if template_file.is_file() {
            Some(std::fs::read_to_string(&template_file).map_err(Error::io(&template_file))?)
        } else {
            match config.get("chat_template") {
                Some(Value::String(source)) => Some(source.clone()),
                // Several named templates: transformers uses the one named "default".
                Some(Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template").and_then(Value::as_str))
                    .map(str::to_string),
                _ => None,
            }
        };
        let chat_template = template_source.as_deref().map(ChatTemplate::new).transpose()?;

        let generation = read_json(&dir.join(GENERATION_CONFIG_FILE))?;
        let mut eos_token_ids = id_list(generation.as_ref().and_then(|g| g.get("eos_token_id")));
        if eos_token_ids.is_empty()
            && let Some(id) = special_tokens.get("eos_token").and_then(Value::as_str).and_then(|t| inner.token_to_id(t))
        {
            eos_token_ids.push(i64::from(id));
        }
        Ok(Self { inner, special_tokens, chat_template, eos_token_ids })
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (BOS
    /// for tokenizers that add one), as transformers' `encode` does by default.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self.inner.encode(text, add_special_tokens).map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| Error::Tokenizer(e.to_string()))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Ids that end generation (from `generation_config.json`, else the eos token).
    pub fn eos_token_ids(&self) -> &[i64] {
        &self.eos_token_ids
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders the conversation with the model's chat template, with the special tokens
    /// (`bos_token`, `eos_token`, ...) in scope as transformers provides them.
    pub fn apply_chat_template(&self, messages: &Value, add_generation_prompt: bool) -> Result<String> {
        self.apply_chat_template_with(messages, add_generation_prompt, &Map::new())
    }

    /// As [`Self::apply_chat_template`], with extra template variables (`tools`, ...).
    pub fn apply_chat_template_with(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
        extra: &Map<String, Value>,
    ) -> Result<String> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or_else(|| Error::ChatTemplate("the tokenizer has no chat_template".into()))?;
        let mut vars = self.special_tokens.clone();
        vars.extend(extra.clone());
        template.render(messages, add_generation_prompt, &Value::Object(vars))
    }

    /// A conversation cut where the model speaks: alternately the text that leads up to an
    /// assistant turn (everything the template renders before it, with the generation
    /// prompt) and the assistant turn as the template renders it (its content and the
    /// template's end of turn), for every assistant turn. Messages after the last assistant
    /// turn are left out. A template that does not render each turn as an extension of the
    /// conversation before it (one that rewrites earlier turns) is refused: its turns have
    /// no fixed place to train on.
    pub fn chat_segments(&self, messages: &[Value]) -> Result<Vec<Segment>> {
        let mut segments = Vec::new();
        let mut done = String::new();
        for (i, message) in messages.iter().enumerate() {
            if message.get("role").and_then(Value::as_str) != Some("assistant") {
                continue;
            }
            let before = self.apply_chat_template(&Value::Array(messages[..i].to_vec()), true)?;
            let through = self.apply_chat_template(&Value::Array(messages[..=i].to_vec()), false)?;
            if !before.starts_with(&done) || !through.starts_with(&before) {
                return Err(Error::ChatTemplate(format!(
                    "the template does not render assistant turn {i} as an extension of the conversation before it"
                )));
            }
            segments.push(Segment { text: before[done.len()..].to_string(), assistant: false });
            segments.push(Segment { text: through[before.len()..].to_string(), assistant: true });
            done = through;
        }
        Ok(segments)
    }
}

/// A piece of a rendered conversation ([`Tokenizer::chat_segments`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub text: String,
    /// An assistant turn (what a model trained on the conversation learns to produce).
    pub assistant: bool,
}
