//! A Hugging Face model directory's text side, without tensors: [`tokenizer`] reads
//! `tokenizer.json` with its special tokens and end-of-generation ids, and [`chat`] renders
//! chat templates as transformers does. The orchestrator uses it to build prompts; the
//! model crate (`keel-model`) re-exports it for the engines.

pub mod chat;
pub mod error;
pub mod tokenizer;

pub use error::{Error, Result};
pub use tokenizer::Tokenizer;
