//! Records as token ids, with the model's own tokenizer and chat template. Token ids are
//! made once here and kept to the end: a rollout's prompt, generated tokens and
//! observations are concatenated ids, never text tokenised again.
//!
//! A target (an SFT answer, a chosen or rejected response) is tokenised on its own and put
//! after the prompt's ids, followed by the first end-of-sequence id, exactly as a generator
//! would have produced it; the loss mask covers the target and that end token.

use std::path::Path;

use keel_protocol::reward::Message;
use keel_protocol::run::PromptSpec;
use keel_tokenizer::Tokenizer;
use serde_json::json;

use super::{Result, Stop};
use crate::data::Record;

/// One training row: ids and the loss mask.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub ids: Vec<i64>,
    pub mask: Vec<f32>,
}

#[derive(Debug)]
pub struct Prompting {
    tokenizer: Tokenizer,
    spec: PromptSpec,
    max_len: usize,
}

fn failed(what: &str) -> impl Fn(keel_tokenizer::Error) -> Stop + '_ {
    move |e| Stop::Failed(format!("{what}: {e}"))
}

fn to_i64(ids: Vec<u32>) -> Vec<i64> {
    ids.into_iter().map(i64::from).collect()
}

impl Prompting {
    pub fn load(model_dir: &Path, spec: &PromptSpec, max_len: usize) -> Result<Self> {
        let tokenizer = Tokenizer::load(model_dir).map_err(failed("tokenizer"))?;
        if spec.use_chat_template && !tokenizer.has_chat_template() {
            return Err(Stop::Failed(format!(
                "prompt.use_chat_template: the model in {} has no chat template",
                model_dir.display()
            )));
        }
        Ok(Self { tokenizer, spec: spec.clone(), max_len })
    }

    pub fn eos_token_ids(&self) -> Vec<i64> {
        self.tokenizer.eos_token_ids().to_vec()
    }

    /// The conversation a record opens with: its messages up to the last assistant turn, or
    /// the system message and the templated prompt.
    pub fn messages(&self, record: &Record) -> Vec<Message> {
        if let Some(messages) = &record.messages {
            let end = messages.iter().rposition(|m| m.role == "assistant").unwrap_or(messages.len());
            return messages[..end].to_vec();
        }
        let mut messages = Vec::new();
        if let Some(system) = &self.spec.system {
            messages.push(Message { role: "system".into(), content: system.clone() });
        }
        let prompt = record.prompt.as_deref().unwrap_or_default();
        messages.push(Message { role: "user".into(), content: self.spec.template.replace("{prompt}", prompt) });
        messages
    }

    /// The text the model is prompted with.
    pub fn prompt_text(&self, messages: &[Message]) -> Result<String> {
        if self.spec.use_chat_template {
            self.tokenizer.apply_chat_template(&json!(messages), true).map_err(failed("chat template"))
        } else {
            Ok(messages.iter().map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n"))
        }
    }

    pub fn prompt_ids(&self, messages: &[Message]) -> Result<Vec<i64>> {
        let text = self.prompt_text(messages)?;
        let ids = self.tokenizer.encode(&text, !self.spec.use_chat_template).map_err(failed("tokenizer"))?;
        Ok(to_i64(ids))
    }

    /// A response's ids followed by the end-of-sequence id.
    fn target_ids(&self, text: &str) -> Result<Vec<i64>> {
        let mut ids = to_i64(self.tokenizer.encode(text, false).map_err(failed("tokenizer"))?);
        ids.extend(self.tokenizer.eos_token_ids().first());
        Ok(ids)
    }

    /// Prompt then target, cut to the maximum length; the mask covers the target.
    fn row(&self, prompt: Vec<i64>, target: Vec<i64>) -> Row {
        let mut mask = vec![0.0; prompt.len()];
        mask.extend(std::iter::repeat_n(1.0, target.len()));
        let mut ids = prompt;
        ids.extend(target);
        ids.truncate(self.max_len);
        mask.truncate(self.max_len);
        Row { ids, mask }
    }

    /// An SFT example: the record's answer (or last assistant message) after its prompt.
    pub fn sft_row(&self, record: &Record) -> Result<Row> {
        let target = match &record.messages {
            Some(messages) => messages.iter().rev().find(|m| m.role == "assistant").map(|m| m.content.clone()),
            None => record.response.clone(),
        };
        let target = target.ok_or_else(|| Stop::Failed("an SFT record has no answer".into()))?;
        Ok(self.row(self.prompt_ids(&self.messages(record))?, self.target_ids(&target)?))
    }

    /// A preference pair: (chosen row, rejected row).
    pub fn pair_rows(&self, record: &Record) -> Result<(Row, Row)> {
        let prompt = self.prompt_ids(&self.messages(record))?;
        let (Some(chosen), Some(rejected)) = (&record.chosen, &record.rejected) else {
            return Err(Stop::Failed("a preference record lacks chosen or rejected".into()));
        };
        Ok((self.row(prompt.clone(), self.target_ids(chosen)?), self.row(prompt, self.target_ids(rejected)?)))
    }

    /// The ids of an environment's observation as the next turn of the conversation, with
    /// the prompt for the model's answer after it.
    pub fn observation_ids(&self, message: &Message) -> Result<Vec<i64>> {
        let text = if self.spec.use_chat_template {
            self.tokenizer.apply_chat_template(&json!([message]), true).map_err(failed("chat template"))?
        } else {
            format!("\n{}\n", message.content)
        };
        Ok(to_i64(self.tokenizer.encode(&text, false).map_err(failed("tokenizer"))?))
    }

    /// Generated ids as text, special tokens left out.
    pub fn decode(&self, ids: &[i64]) -> String {
        let ids: Vec<u32> = ids.iter().filter_map(|&id| u32::try_from(id).ok()).collect();
        self.tokenizer.decode(&ids, true).unwrap_or_default()
    }
}
