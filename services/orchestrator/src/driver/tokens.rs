//! Records as token ids, with the model's own tokenizer and chat template. Token ids are
//! made once here and kept to the end: a rollout's prompt, generated tokens and
//! observations are concatenated ids, never text tokenised again.
//!
//! A target (an SFT answer, a chosen or rejected response) is tokenised on its own and put
//! after the prompt's ids, followed by the first end-of-sequence id, exactly as a generator
//! would have produced it; the loss mask covers the target and that end token. An SFT
//! conversation (`messages`) trains every assistant turn: the conversation is cut where the
//! chat template renders each assistant turn, each piece tokenised on its own, and the mask
//! covers every assistant turn up to and including its end-of-turn token.

use std::path::Path;

use keel_protocol::reward::Message;
use keel_protocol::run::PromptSpec;
use keel_tokenizer::Tokenizer;
use keel_tokenizer::tokenizer::Segment;
use serde_json::json;

use super::{Result, Stop};
use crate::data::Record;

/// A conversation without a chat template, cut at its assistant turns: the messages before
/// each joined by newlines (as [`Prompting::prompt_text`] joins a prompt), then the turn.
fn plain_segments(messages: &[Message]) -> Vec<Segment> {
    let end = messages.iter().rposition(|m| m.role == "assistant").map_or(0, |last| last + 1);
    let mut segments = Vec::new();
    let mut context: Vec<&str> = Vec::new();
    for message in &messages[..end] {
        if message.role != "assistant" {
            context.push(&message.content);
            continue;
        }
        let lead = if segments.is_empty() { "" } else { "\n" };
        segments.push(Segment { text: format!("{lead}{}", context.join("\n")), assistant: false });
        segments.push(Segment { text: message.content.clone(), assistant: true });
        context.clear();
    }
    segments
}

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

    /// An SFT example: the record's answer after its prompt, or its conversation with every
    /// assistant turn trained ([`Self::conversation_row`]).
    pub fn sft_row(&self, record: &Record) -> Result<Row> {
        if let Some(messages) = &record.messages {
            return self.conversation_row(messages);
        }
        let target = record.response.as_ref().ok_or_else(|| Stop::Failed("an SFT record has no answer".into()))?;
        Ok(self.row(self.prompt_ids(&self.messages(record))?, self.target_ids(target)?))
    }

    /// A conversation with every assistant turn trained: its ids as the chat template renders
    /// it, the mask on each assistant turn's tokens up to and including the first
    /// end-of-sequence id (what the model produces to end its turn; a template's text after
    /// it, such as a newline, is context), the row ending at the last one. Without a chat
    /// template, messages are joined by newlines and each assistant turn is its content and
    /// the end-of-sequence id, as [`Self::target_ids`] makes an answer.
    fn conversation_row(&self, messages: &[Message]) -> Result<Row> {
        if !messages.iter().any(|m| m.role == "assistant") {
            return Err(Stop::Failed("an SFT conversation has no assistant turn".into()));
        }
        let segments = if self.spec.use_chat_template {
            let turns: Vec<_> = messages.iter().map(|m| json!(m)).collect();
            self.tokenizer.chat_segments(&turns).map_err(failed("chat template"))?
        } else {
            plain_segments(messages)
        };
        let eos = self.tokenizer.eos_token_ids();
        let (mut ids, mut mask, mut end) = (Vec::new(), Vec::new(), 0);
        for (k, segment) in segments.iter().enumerate() {
            let first = k == 0 && !self.spec.use_chat_template;
            let mut piece = to_i64(self.tokenizer.encode(&segment.text, first).map_err(failed("tokenizer"))?);
            let trained = if !segment.assistant {
                0
            } else if self.spec.use_chat_template {
                piece.iter().position(|id| eos.contains(id)).map_or(piece.len(), |at| at + 1)
            } else {
                piece.extend(eos.first());
                piece.len()
            };
            mask.extend(std::iter::repeat_n(1.0, trained));
            mask.extend(std::iter::repeat_n(0.0, piece.len() - trained));
            if segment.assistant {
                end = ids.len() + trained;
            }
            ids.extend(piece);
        }
        ids.truncate(end.min(self.max_len));
        mask.truncate(end.min(self.max_len));
        Ok(Row { ids, mask })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn message(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: content.into() }
    }

    /// The runs of masked tokens, decoded with their special tokens.
    fn trained(tokenizer: &Tokenizer, row: &Row) -> Vec<String> {
        let mut runs: Vec<Vec<u32>> = Vec::new();
        for (i, (&id, &m)) in row.ids.iter().zip(&row.mask).enumerate() {
            match (m > 0.0, i > 0 && row.mask[i - 1] > 0.0) {
                (true, true) => runs.last_mut().unwrap().push(id as u32),
                (true, false) => runs.push(vec![id as u32]),
                (false, _) => {}
            }
        }
        runs.iter().map(|ids| tokenizer.decode(ids, false).unwrap()).collect()
    }

    /// A three-turn conversation trains all three assistant turns, each through its
    /// end-of-turn token, and nothing else; the row is the template's rendering of it.
    #[test]
    fn chat_sft_trains_every_assistant_turn() {
        let dir = tempfile::tempdir().unwrap();
        keel_testkit::keel_model_init(dir.path());
        let conversation = [
            message("system", "You add numbers."),
            message("user", "What is 2 + 3?"),
            message("assistant", "5"),
            message("user", "And 5 + 4?"),
            message("assistant", "9"),
            message("user", "Then 9 + 9?"),
            message("assistant", "18"),
            message("user", "Thanks"),
        ];
        let tokenizer = Tokenizer::load(dir.path()).unwrap();
        let spec = PromptSpec { use_chat_template: true, ..PromptSpec::default() };
        let prompting = Prompting::load(dir.path(), &spec, 512).unwrap();
        let row = prompting.conversation_row(&conversation).unwrap();
        assert_eq!(row.ids.len(), row.mask.len());
        assert_eq!(trained(&tokenizer, &row), ["5<|im_end|>", "9<|im_end|>", "18<|im_end|>"]);
        let rendered = tokenizer.apply_chat_template(&json!(conversation[..7]), false).unwrap();
        let ids: Vec<u32> = row.ids.iter().map(|&id| id as u32).collect();
        assert_eq!(tokenizer.decode(&ids, false).unwrap(), rendered.trim_end_matches('\n'));
        // The row ends as a single answer's row always has: the answer's ids and the EOS id.
        let answer = prompting.target_ids("18").unwrap();
        assert_eq!(row.ids[row.ids.len() - answer.len()..], answer[..]);

        // Without a chat template: newline-joined context, each turn ended by the EOS id.
        let plain = Prompting::load(dir.path(), &PromptSpec { use_chat_template: false, ..PromptSpec::default() }, 512)
            .unwrap()
            .conversation_row(&conversation)
            .unwrap();
        assert_eq!(trained(&tokenizer, &plain), ["5<|im_end|>", "9<|im_end|>", "18<|im_end|>"]);

        // Cut to the maximum length like any row; a conversation without an assistant turn
        // has nothing to train.
        let short = Prompting::load(dir.path(), &spec, 20).unwrap().conversation_row(&conversation).unwrap();
        assert_eq!((short.ids.len(), short.mask.len()), (20, 20));
        let err = prompting.conversation_row(&conversation[..2]).unwrap_err();
        assert!(err.to_string().contains("no assistant turn"), "{err}");
    }
}
