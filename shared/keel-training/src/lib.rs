//! keel-training: the training engine, with no NATS and no HTTP. The trainer service
//! (`services/trainer`) drives it for runs; `keel train bench` drives it in-process.
//!
//! Layout:
//! - [`trainer`]: the [`Trainer`]: one engine, or one per tensor-parallel rank on its own
//!   thread, run in lockstep.
//! - [`actor`]: the engine thread that owns a [`Trainer`] (tch never runs on async workers).
//! - [`engine`]: policy, reference, value head, optimiser; logprobs, training, saving.
//! - [`critic`]: PPO's critic (a value model trained beside the policy).
//! - [`batch`]: wire batches checked and padded into tensors; global/micro batch slicing.
//! - [`loss`]: clipped policy gradient, NLL, DPO, Bradley–Terry, PPO's value loss (exact text
//!   in `LOSSES.md`).
//! - [`optim`] and [`schedule`]: AdamW with f32 master weights, gradient clipping, warm-up
//!   and decay.
//! - [`checkpoint`]: the checkpoint directory (HF weights + optimiser and trainer state).
//! - [`metrics`]: metrics accumulated over microbatches.
//! - [`dp`]: data parallelism: row shards, gradient buckets and metrics summed over the ranks.
//! - [`error`]: one error type, each variant with the stable `type` code of a reply.

pub mod actor;
pub mod batch;
pub mod checkpoint;
pub mod critic;
pub mod dp;
pub mod engine;
pub mod error;
pub mod loss;
pub mod metrics;
pub mod optim;
pub mod schedule;
pub mod trainer;

pub use engine::Engine;
pub use error::{Error, Result};
pub use trainer::Trainer;
