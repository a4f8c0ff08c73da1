//! Bounds that keep a single verification cheap: input size, nesting depth, number size and the deadline.

use std::time::Instant;

/// Longest extracted answer or ground truth (in characters) that is compared at all.
pub const MAX_ANSWER_CHARS: usize = 2_000;
/// Deepest nesting the expression parser accepts (counted per nested unary/primary).
pub(crate) const MAX_PARSE_DEPTH: usize = 96;
/// Deepest nesting of brackets the structure parser looks into (tuples of tuples...).
pub(crate) const MAX_STRUCTURE_DEPTH: usize = 12;
/// Largest exact rational (numerator bits + denominator bits); beyond it evaluation falls back to `f64`.
pub(crate) const MAX_BITS: u64 = 16_384;

/// Why an internal parse or evaluation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// Not parseable as math / not exactly representable / undefined value.
    Fail,
    /// The per-sample deadline passed.
    Timeout,
}

/// The deadline of one verification, checked inside every loop and recursion.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Budget {
    deadline: Instant,
}

impl Budget {
    pub(crate) fn new(deadline: Instant) -> Self {
        Self { deadline }
    }

    pub(crate) fn check(&self) -> Result<(), Stop> {
        if Instant::now() >= self.deadline { Err(Stop::Timeout) } else { Ok(()) }
    }
}
