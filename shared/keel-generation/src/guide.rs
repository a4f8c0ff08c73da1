//! Constrained sampling (structured output): a sample whose request carries a [`Guide`] may
//! only draw the tokens its constraint allows at each step (a JSON schema, a regex, a
//! grammar: the generator builds them), and each token drawn moves the constraint on. The
//! engine masks the constrained rows of a step's logits in one batched operation on the
//! device; the constraint itself (the grammar engine) runs on the host.

use std::sync::{Mutex, PoisonError};

/// What a grammar engine reported: a token it cannot take, or a failure of its own.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConstraintError(pub String);

/// What a grammar engine does for one sample.
pub trait Constraint: Send {
    /// The tokens allowed next, as a bitset: token t is bit t % 32 of word t / 32.
    fn allowed(&mut self) -> Result<Vec<u32>, ConstraintError>;
    /// Moves past `token`, which was drawn.
    fn consume(&mut self, token: i64) -> Result<(), ConstraintError>;
    /// An independent copy in the same state (a request's n samples each get one).
    fn fork(&self) -> Box<dyn Constraint>;
}

/// One sample's constraint; cloning forks it.
pub struct Guide(Mutex<Box<dyn Constraint>>);

impl Guide {
    pub fn new(constraint: Box<dyn Constraint>) -> Self {
        Self(Mutex::new(constraint))
    }

    pub fn allowed(&self) -> Result<Vec<u32>, ConstraintError> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).allowed()
    }

    pub fn consume(&self, token: i64) -> Result<(), ConstraintError> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).consume(token)
    }
}

impl Clone for Guide {
    fn clone(&self) -> Self {
        Self::new(self.0.lock().unwrap_or_else(PoisonError::into_inner).fork())
    }
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Guide")
    }
}

/// `allowed` bitsets of `vocab` tokens as one bool mask [rows, vocab] (true: allowed).
pub(crate) fn mask(allowed: &[Vec<u32>], vocab: usize) -> Vec<bool> {
    let mut out = Vec::with_capacity(allowed.len() * vocab);
    for bits in allowed {
        out.extend((0..vocab).map(|t| bits.get(t / 32).is_some_and(|word| (word >> (t % 32)) & 1 == 1)));
    }
    out
}
