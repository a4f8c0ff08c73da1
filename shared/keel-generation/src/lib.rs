//! keel-generation: the generation engine, with no NATS and no HTTP. The generator service
//! (`services/generator`) puts the OpenAI API and NATS rollouts in front of it;
//! `keel generate bench` drives it in-process.
//!
//! Layout:
//! - [`engine`]: the scheduler thread — continuous batching over a paged KV cache with a
//!   token budget per step (chunked prefill, several prompts per pass), preemption and
//!   recomputation, prompt blocks shared by a request's n samples, the prefix cache,
//!   per-sample seeded sampling on the device, stops, refits and sleep/wake.
//! - [`blocks`]: the block manager (reference counts, prefix cache, LRU eviction).
//! - [`backend`]: the model (or tensor-parallel ranks) and its block pools.
//! - [`group`]: tensor-parallel ranks as processes of their own, led by rank 0.
//! - [`request`]: the validated request and the events the engine sends back.
//! - [`text`]: stop strings and what a stream may show.
//! - [`error`]: what the engine's calls can fail with.

pub mod backend;
pub mod blocks;
pub mod engine;
pub mod error;
pub mod group;
pub mod guide;
pub mod request;
pub mod served;
pub mod text;

pub use error::{Error, Result};
