//! Keel's model core: decoder-only transformers in tch that load, run and save Hugging Face
//! checkpoints and compute what transformers computes.
//!
//! Layout:
//! - [`config`]: `config.json` → [`ModelConfig`] (Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE,
//!   Mixtral, Gemma 2 and 3, Phi-3, OLMo 2 and 3, GLM-4, Granite, SmolLM3): what each family
//!   changes in the one decoder is its [`config::Block`] and its rotary embeddings.
//! - [`model`]: the layers and [`CausalLm`] (training logprobs, cached inference forward);
//!   `prefix`: rows that share a prompt computed as one tree per prompt in those logprobs.
//! - [`rope`]: rotary embeddings (Llama 3, linear and LongRoPE scaling; partial, interleaved
//!   and per-layer ones).
//! - [`cache`]: the preallocated [`KvCache`] and the block pools of [`PagedCache`]
//!   (continuous batching).
//! - [`weights`] and [`pretrained`]: safetensors load (memory-mapped) and save (sharded);
//!   [`packing`]: weights as byte buckets for refits in memory.
//! - [`tokenizer`] and [`chat`]: `tokenizer.json`, special tokens, chat templates (the
//!   `keel-tokenizer` crate, re-exported).
//! - [`sampling`]: batched sampling on the device; single-sequence generation for the CLI.
//! - [`lora`]: LoRA adapters (training, merging, PEFT's directory layout).
//! - [`init`]: a new model directory with a trained tokenizer (`keel model init`), in the
//!   chat format of its family ([`chat_format`]).
//! - [`device`]: device and dtype names, CUDA probing without panics.
//! - [`cuda`]: CUDA kernels for inference (NVRTC, cudarc), each checked against its tch path
//!   at load and switched off when it cannot run.

mod attention;
pub mod cache;
pub mod chat_format;
pub mod config;
pub mod cuda;
pub mod device;
pub mod error;
pub mod init;
pub mod lora;
pub mod model;
pub mod packed;
pub mod packing;
mod prefix;
pub mod pretrained;
pub mod rope;
pub mod sampling;
pub mod weights;

/// The tokenizer and chat templates live in `keel-tokenizer` (no libtorch), re-exported here.
pub use keel_tokenizer::{chat, tokenizer};

pub use cache::{BLOCK_SIZE, KvCache, PagedCache, SeqChunk};
pub use config::{Architecture, ModelConfig};
pub use error::{Error, Result};
pub use model::decode::{DecodeBatch, DecodeGraphs};
pub use model::prompt::PromptLogprobs;
pub use model::{CausalLm, Init};
pub use tokenizer::Tokenizer;
pub use weights::SaveOptions;
