//! Equivalence of parsed answers: exact rationals, `f64` with tolerance, random-point testing of
//! expressions with variables, and structural matching of tuples, sets, intervals and lists.

use std::collections::BTreeSet;

use super::eval::{approx, exact};
use super::expr::{Expr, collect_vars, has_decimal};
use super::limits::{Budget, Stop};
use super::normalize::text_key;
use super::structure::Answer;

/// Random points tried for expressions with variables.
const TRIALS: usize = 24;
/// Points at which both sides must be defined (and agree) for symbolic equality.
const REQUIRED_POINTS: usize = 4;
/// Seed of the deterministic point generator.
const SEED: u64 = 0x6b65_656c_6d61_7468;
/// Absolute tolerance near zero.
const ABSOLUTE_TOLERANCE: f64 = 1e-9;

/// How two answers are compared.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Comparer {
    pub(crate) relative_tolerance: f64,
    pub(crate) budget: Budget,
}

fn optional<T>(r: Result<T, Stop>) -> Result<Option<T>, Stop> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(Stop::Fail) => Ok(None),
        Err(Stop::Timeout) => Err(Stop::Timeout),
    }
}

impl Comparer {
    pub(crate) fn answers(&self, a: &Answer, b: &Answer) -> Result<bool, Stop> {
        self.budget.check()?;
        Ok(match (a, b) {
            (Answer::Labeled(la, va), Answer::Labeled(lb, vb)) => la == lb && self.answers(va, vb)?,
            (Answer::Labeled(_, v), other) | (other, Answer::Labeled(_, v)) => self.answers(v, other)?,
            (Answer::Expr(x), Answer::Expr(y)) => self.exprs(x, y)?,
            (Answer::Equation(la, ra), Answer::Equation(lb, rb)) => {
                (self.exprs(la, lb)? && self.exprs(ra, rb)?) || (self.exprs(la, rb)? && self.exprs(ra, lb)?)
            }
            (Answer::Seq { open: oa, close: ca, items: ia }, Answer::Seq { open: ob, close: cb, items: ib }) => {
                ia.len() == ib.len()
                    && self.bracket_ok(*oa, *ob, ia.first(), ib.first())?
                    && self.bracket_ok(*ca, *cb, ia.last(), ib.last())?
                    && self.ordered(ia, ib)?
            }
            (Answer::Set(x) | Answer::List(x), Answer::Set(y) | Answer::List(y)) => self.unordered(x, y)?,
            (Answer::Seq { open: '(', close: ')', items }, Answer::List(list))
            | (Answer::List(list), Answer::Seq { open: '(', close: ')', items }) => self.ordered(items, list)?,
            (Answer::Union(x), Answer::Union(y)) => self.unordered(x, y)?,
            (Answer::Text(x), Answer::Text(y)) => text_key(x) == text_key(y),
            _ => false,
        })
    }

    fn ordered(&self, a: &[Answer], b: &[Answer]) -> Result<bool, Stop> {
        if a.len() != b.len() {
            return Ok(false);
        }
        for (x, y) in a.iter().zip(b) {
            if !self.answers(x, y)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Multiset equality, matching greedily.
    fn unordered(&self, a: &[Answer], b: &[Answer]) -> Result<bool, Stop> {
        if a.len() != b.len() {
            return Ok(false);
        }
        let mut used = vec![false; b.len()];
        for x in a {
            let mut matched = false;
            for (j, y) in b.iter().enumerate() {
                if !used[j] && self.answers(x, y)? {
                    used[j] = true;
                    matched = true;
                    break;
                }
            }
            if !matched {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Brackets must agree, except next to an infinite endpoint (`[-\infty` is read as `(-\infty`).
    fn bracket_ok(&self, a: char, b: char, end_a: Option<&Answer>, end_b: Option<&Answer>) -> Result<bool, Stop> {
        Ok(a == b || (self.infinite(end_a)? && self.infinite(end_b)?))
    }

    fn infinite(&self, end: Option<&Answer>) -> Result<bool, Stop> {
        let Some(Answer::Expr(e)) = end else { return Ok(false) };
        Ok(optional(approx(e, &[], self.budget))?.is_some_and(f64::is_infinite))
    }

    fn close(&self, x: f64, y: f64) -> bool {
        if x == y {
            return true;
        }
        if !x.is_finite() || !y.is_finite() {
            return false;
        }
        (x - y).abs() <= (self.relative_tolerance * x.abs().max(y.abs())).max(ABSOLUTE_TOLERANCE)
    }

    /// Exact when both sides are exact rationals written without decimals; otherwise within tolerance,
    /// at random points when there are variables.
    fn exprs(&self, a: &Expr, b: &Expr) -> Result<bool, Stop> {
        let (xa, xb) = (optional(exact(a, self.budget))?, optional(exact(b, self.budget))?);
        if let (Some(x), Some(y)) = (&xa, &xb) {
            if x == y {
                return Ok(true);
            }
            if !has_decimal(a) && !has_decimal(b) {
                return Ok(false);
            }
        }
        let mut vars = BTreeSet::new();
        collect_vars(a, &mut vars);
        collect_vars(b, &mut vars);
        if vars.is_empty() {
            let (x, y) = (optional(approx(a, &[], self.budget))?, optional(approx(b, &[], self.budget))?);
            return Ok(matches!((x, y), (Some(x), Some(y)) if self.close(x, y)));
        }
        self.at_random_points(a, b, &vars)
    }

    fn at_random_points(&self, a: &Expr, b: &Expr, vars: &BTreeSet<String>) -> Result<bool, Stop> {
        let symbolic = Comparer { relative_tolerance: self.relative_tolerance.max(1e-9), ..*self };
        let mut rng = SplitMix(SEED);
        let mut agreed = 0;
        for _ in 0..TRIALS {
            self.budget.check()?;
            let point: Vec<(String, f64)> = vars.iter().map(|v| (v.clone(), rng.sample())).collect();
            let x = optional(approx(a, &point, self.budget))?;
            let y = optional(approx(b, &point, self.budget))?;
            match (x, y) {
                (None, None) => {}
                (Some(x), Some(y)) if symbolic.close(x, y) => agreed += 1,
                _ => return Ok(false),
            }
        }
        Ok(agreed >= REQUIRED_POINTS)
    }
}

/// A tiny deterministic generator (splitmix64) for evaluation points.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A value in ±[0.35, 2.85]: away from 0, both signs (so `\sqrt{x^2}` differs from `x`).
    fn sample(&mut self) -> f64 {
        let unit = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        let magnitude = 0.35 + 2.5 * unit;
        if self.next() & 1 == 0 { magnitude } else { -magnitude }
    }
}
