//! The `math` answer verifier: decides whether a model's final answer equals the ground truth by
//! mathematical equivalence, not string equality.
//!
//! # Pipeline
//! 1. **Extraction** ([`extract_answer`]): the last `\boxed{…}` / `\fbox{…}` (nested braces matched,
//!    `\{`/`\}` escaped; `\boxed 5` with a single token too). An unbalanced or empty last box means no
//!    answer. Without a box, the last match of [`MathConfig::answer_pattern`] (first capture group). A
//!    ground truth is used as written unless it contains a box itself.
//! 2. **Normalisation**: unicode (`−`, `×`, `π`, `∞`, `√`, `°`, `∪`), `\left`/`\right`/`\big…`, spacing
//!    (`\!`, `\,`, `\;`, `\:`, `\ `, `~`, `\quad`), `$`, `\$`, `\displaystyle`, `\dfrac`/`\tfrac`/`\cfrac`,
//!    `\text{…}`/`\textbf`/`\mathrm`/`\mbox`/`\operatorname` (content kept, or dropped when it is a trailing
//!    unit after a number such as `5\text{ cm}`), degree signs (`^\circ`, `^{\circ}`, `\degree`, `°`: dropped,
//!    so `30^\circ` = `30`), plain trailing unit words after a number (`5 cm`, `12 meters`, `4 cm^2`,
//!    `5cm` for a fixed list of short units), `\mathbb{R}` = `(-\infty, \infty)`, `\%` = `%`.
//! 3. **Structure**: unordered lists of answers (`2, 3`, `2; 3`, `2 and 3`, `x=2 or x=3`), unions
//!    (`A \cup B`, unordered), sets `\{…\}` (unordered; `\emptyset`), tuples and intervals `(…)`, `[…)`
//!    (ordered, brackets significant except next to an infinite endpoint, so `[-\infty, 3)` = `(-\infty, 3)`),
//!    labelled answers `x = 3`, `f(x) = …`, `(x, y) = (1, 2)`, `x \in [0, 1]` (the label is ignored
//!    against an unlabelled side, and must match against a labelled one), `a \pm b` (= the list of both),
//!    general equations (`x^2+y^2=1`, same sides or swapped), a single expression, or text.
//! 4. **Expressions**: `\frac{a}{b}`, `\frac12`, `a/b`, mixed numbers (`3\frac{1}{2}` = 3.5 when both parts
//!    are integer literals), `\sqrt{…}`, `\sqrt[n]{…}`, `\sqrt2`, powers `^{…}`/`**`, `\cdot`, `\times`,
//!    `\div`, implicit multiplication (`2x`, `3\sqrt{2}`, `2(x+1)`, `2\pi`), `\pi`/`pi`, `e`, `\infty`,
//!    `|x|`, `n!`, `\binom{n}{k}`, `\sin`…`\tanh`, `\ln`, `\log` (natural) and `\log_b`, `\exp`, subscripted
//!    and Greek variables, decimals and `1.5e3`.
//! 5. **Comparison**: both sides exact rationals (integers, decimals, fractions, integer powers, perfect
//!    roots) compare exactly — unless a side contains a decimal literal with fraction digits, which is
//!    then compared with [`MathConfig::relative_tolerance`] (absolute 1e-9 near zero). Otherwise `f64` with
//!    the same tolerance. With free variables both sides are evaluated at 24 seeded random points (both
//!    signs); every point where either side is defined must agree (within at least 1e-9 relative) and at
//!    least 4 points must be defined. If neither side is math, normalised text is compared
//!    case-insensitively (`\text{Monday}` = `monday`).
//!
//! # Choices
//! - **Percent**: `50\%` equals both `50` and `0.5` (the comparison is tried with `%` dropped and with
//!   `%` read as `/100`, applied to both sides alike, so `50\%` = `50%` too).
//! - **Thousands**: outside brackets, a comma-joined digit run without spaces whose first group has 1–3
//!   digits and every later group exactly 3 (`1,000,000`, `12,345`) is one number; `1{,}000` always is.
//!   `1,2`, `10, 20`, `1, 000` and anything inside `(…)`, `[…]`, `\{…\}` are lists/tuples.
//! - **Trailing zeros**: `2.50` = `2.5`, `3.0` = `3` (exact rationals).
//! - `e` is Euler's number; `i` is an ordinary variable (so `3+4i` = `4i+3` symbolically).
//! - Answers made only of letters and spaces (`No`, `Monday`, `B`) are also compared
//!   case-insensitively, so a lone `A` equals `a` even though variables are otherwise case-sensitive.
//! - Inequalities and other relations are not parsed: they are compared as normalised text
//!   (`\leq` = `\le`), so `x \le 3` = `x \leq 3` but `x \le 3` ≠ `3 \ge x`.
//!
//! # Limits
//! Answers longer than [`MAX_ANSWER_CHARS`] characters are not compared; parser nesting, structure
//! nesting, exact-number size (16 384 bits, e.g. `2^{10^{10}}` falls back to `f64`, where it overflows and is
//! undefined), factorials and roots are bounded, and the deadline ([`MathConfig::time_limit_ms`]) is
//! checked in every loop and recursion. Nothing panics on any `&str`.
//!
//! # Knowingly not covered
//! Matrices (compared as normalised text only), inequalities beyond text (`x > 3` vs `(3, \infty)`), degrees vs
//! radians (`30^\circ` ≠ `\frac{\pi}{6}`), complex arithmetic beyond symbolic `i`, `\log` as base 10,
//! multi-letter variables other than known words (three or more loose letters make an answer text, so
//! `xyz` is text and `xy` is `x·y`), trigonometric-identity checks that need more than random points,
//! units in general (only dropped, never converted), and `x^{p/q}` for even `q` of negatives.

mod compare;
mod config;
mod eval;
mod expr;
mod extract;
mod lex;
mod limits;
mod normalize;
mod structure;

use keel_protocol::FieldError;
use std::fmt;
use std::time::{Duration, Instant};

use regex::Regex;

pub use config::{MAX_TIME_LIMIT_MS, MathConfig};
pub use extract::extract_answer;
pub use limits::MAX_ANSWER_CHARS;

use compare::Comparer;
use expr::Percent;
use limits::{Budget, Stop};
use normalize::{normalize, text_key};
use structure::{Answer, parse_answer};

/// The outcome of checking one response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub correct: bool,
    /// The answer extracted from the response, if any.
    pub extracted: Option<String>,
    /// Why it is wrong when not correct: "no answer found", "time limit exceeded", "not equivalent",
    /// "unparseable answer", "answer too long (…)", "empty ground truth".
    pub reason: Option<String>,
}

/// Why two answers could not be compared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MathError {
    /// The deadline passed during the comparison.
    TimedOut,
    /// `what` ("answer" or "ground truth") has `chars` characters, more than [`MAX_ANSWER_CHARS`].
    TooLong { what: &'static str, chars: usize },
    /// `what` is empty after normalisation.
    Empty { what: &'static str },
    /// The ground truth is math but the answer does not parse as math.
    Unparseable,
}

impl fmt::Display for MathError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TimedOut => f.write_str("time limit exceeded"),
            Self::TooLong { what, chars } => {
                write!(f, "{what} too long ({chars} chars, limit {MAX_ANSWER_CHARS})")
            }
            Self::Empty { what } => write!(f, "empty {what}"),
            Self::Unparseable => f.write_str("unparseable answer"),
        }
    }
}

impl std::error::Error for MathError {}

impl From<Stop> for MathError {
    fn from(_: Stop) -> Self {
        // Parsing and comparison absorb `Stop::Fail`; only a timeout escapes them.
        Self::TimedOut
    }
}

/// A compiled checker (regex compiled once).
#[derive(Debug, Clone)]
pub struct MathVerifier {
    pattern: Option<Regex>,
    relative_tolerance: f64,
    time_limit: Duration,
}

impl MathVerifier {
    /// Validates `config` and compiles its pattern.
    pub fn new(config: &MathConfig) -> Result<Self, FieldError> {
        Ok(Self {
            pattern: config::check(config)?,
            relative_tolerance: config.relative_tolerance,
            time_limit: Duration::from_millis(config.time_limit_ms),
        })
    }

    /// Extracts the final answer from `response` and compares it with `ground_truth` (which may itself be
    /// plain or contain `\boxed{...}`).
    pub fn verify(&self, response: &str, ground_truth: &str) -> Verdict {
        let start = Instant::now();
        let deadline = start.checked_add(self.time_limit).unwrap_or(start);
        let Some(extracted) = extract_answer(response, self.pattern.as_ref()) else {
            return Verdict { correct: false, extracted: None, reason: Some("no answer found".to_owned()) };
        };
        let truth = extract_answer(ground_truth, None).unwrap_or_else(|| ground_truth.trim().to_owned());
        let reason = match equivalent(&extracted, &truth, self.relative_tolerance, deadline) {
            Ok(true) => None,
            Ok(false) => Some("not equivalent".to_owned()),
            Err(e) => Some(e.to_string()),
        };
        Verdict { correct: reason.is_none(), extracted: Some(extracted), reason }
    }
}

/// Plain words (`No`, `Monday`, `no solution`): compared case-insensitively even when short enough to
/// read as a product of variables.
fn is_words(s: &str) -> bool {
    s.chars().all(|c| c.is_alphabetic() || c == ' ')
}

/// Equivalence of two already-extracted answers.
pub fn equivalent(candidate: &str, truth: &str, relative_tolerance: f64, deadline: Instant) -> Result<bool, MathError> {
    for (what, text) in [("answer", candidate), ("ground truth", truth)] {
        let chars = text.chars().count();
        if chars > MAX_ANSWER_CHARS {
            return Err(MathError::TooLong { what, chars });
        }
    }
    let budget = Budget::new(deadline);
    budget.check()?;
    let (c, t) = (normalize(candidate), normalize(truth));
    if c.is_empty() {
        return Err(MathError::Empty { what: "answer" });
    }
    if t.is_empty() {
        return Err(MathError::Empty { what: "ground truth" });
    }
    if c == t || (is_words(&c) && is_words(&t) && text_key(&c) == text_key(&t)) {
        return Ok(true);
    }
    let comparer = Comparer { relative_tolerance, budget };
    let modes: &[Percent] =
        if c.contains('%') || t.contains('%') { &[Percent::Drop, Percent::Scale] } else { &[Percent::Drop] };
    let mut parsed = None;
    for &mode in modes {
        let (ca, ta) = (parse_answer(&c, mode, budget)?, parse_answer(&t, mode, budget)?);
        if comparer.answers(&ca, &ta)? {
            return Ok(true);
        }
        parsed = Some((ca, ta));
    }
    match parsed {
        Some((Answer::Text(_), truth)) if !matches!(truth, Answer::Text(_)) => Err(MathError::Unparseable),
        _ => Ok(false),
    }
}
