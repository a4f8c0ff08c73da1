//! keel-environments: environments and the scorer, with no HTTP server. The reward service
//! (`services/reward`) serves the [`scoring::Scorer`] over REST and NATS; `keel reward bench`
//! runs it in-process.
//!
//! Layout:
//! - [`envs`]: the [`envs::Environment`] trait (a batched step: observation, reward or named
//!   rewards, termination, stop strings, metadata), the text helpers environments share, and
//!   the built-in environments: `math`, `code`, `sliding_puzzle`, `exact_match`, `regex`,
//!   `multiple_choice`, `http` (a user's reward service), `reward_model`.
//! - [`registry`]: builds an environment from its typed configuration, and caches it.
//! - [`math`]: answer extraction and mathematical equivalence.
//! - [`sandbox`]: bubblewrap-isolated runs of untrusted programs with resource limits.
//! - [`scoring`]: validation, the `on_error` policy, batch metrics and counters.

pub mod envs;
pub mod math;
pub mod registry;
pub mod sandbox;
pub mod scoring;
