//! Evaluation of expression trees: exactly over big rationals, or approximately over `f64` with variables.

use num_bigint::BigInt;
use num_rational::BigRational;
use num_traits::{One, Signed, ToPrimitive, Zero};

use super::expr::Expr;
use super::lex::Func;
use super::limits::{Budget, MAX_BITS, Stop};

/// Largest `n` for which `n!` / `binom(n, k)` are computed.
const MAX_FACTORIAL: u32 = 300;
/// Largest root index (`\sqrt[n]{…}`, `x^{p/q}`) tried exactly.
const MAX_ROOT: u32 = 64;

fn bits(r: &BigRational) -> u64 {
    r.numer().bits() + r.denom().bits()
}

fn bounded(r: BigRational) -> Result<BigRational, Stop> {
    if bits(&r) > MAX_BITS { Err(Stop::Fail) } else { Ok(r) }
}

fn small_int(r: &BigRational) -> Option<i64> {
    if r.is_integer() { r.to_integer().to_i64() } else { None }
}

/// The exact rational value of `e`; `Stop::Fail` when it is irrational, symbolic, undefined or too large.
pub(crate) fn exact(e: &Expr, budget: Budget) -> Result<BigRational, Stop> {
    budget.check()?;
    match e {
        Expr::Num { value, .. } => Ok(value.clone()),
        Expr::Var(_) | Expr::Pi | Expr::E | Expr::Inf | Expr::Func(..) | Expr::Log(..) => Err(Stop::Fail),
        Expr::Sum(terms) => {
            let mut acc = BigRational::zero();
            for (negated, term) in terms {
                let v = exact(term, budget)?;
                acc = bounded(if *negated { acc - v } else { acc + v })?;
            }
            Ok(acc)
        }
        Expr::Product(factors) => {
            let mut acc = BigRational::one();
            for (divided, factor) in factors {
                let v = exact(factor, budget)?;
                if *divided && v.is_zero() {
                    return Err(Stop::Fail);
                }
                acc = bounded(if *divided { acc / v } else { acc * v })?;
            }
            Ok(acc)
        }
        Expr::Neg(a) => Ok(-exact(a, budget)?),
        Expr::Abs(a) => Ok(exact(a, budget)?.abs()),
        Expr::Pow(base, exponent) => {
            let base = exact(base, budget)?;
            let exponent = exact(exponent, budget)?;
            let q = exponent.denom().to_u32().filter(|q| *q <= MAX_ROOT).ok_or(Stop::Fail)?;
            let rooted = if q == 1 { base } else { exact_root(&base, q)? };
            let p = exponent.numer().to_i64().ok_or(Stop::Fail)?;
            int_power(&rooted, p)
        }
        Expr::Root(index, radicand) => {
            let n = small_int(&exact(index, budget)?).ok_or(Stop::Fail)?;
            let n = u32::try_from(n).ok().filter(|n| (1..=MAX_ROOT).contains(n)).ok_or(Stop::Fail)?;
            exact_root(&exact(radicand, budget)?, n)
        }
        Expr::Factorial(a) => {
            let n = small_int(&exact(a, budget)?).and_then(|n| u32::try_from(n).ok()).ok_or(Stop::Fail)?;
            if n > MAX_FACTORIAL {
                return Err(Stop::Fail);
            }
            Ok(BigRational::from_integer((1..=n).map(BigInt::from).product()))
        }
        Expr::Binom(n, k) => {
            let n = small_int(&exact(n, budget)?).ok_or(Stop::Fail)?;
            let k = small_int(&exact(k, budget)?).ok_or(Stop::Fail)?;
            if !(0..=i64::from(MAX_FACTORIAL)).contains(&n) || k < 0 {
                return Err(Stop::Fail);
            }
            if k > n {
                return Ok(BigRational::zero());
            }
            let mut acc = BigInt::one();
            for i in 0..k {
                acc = acc * BigInt::from(n - i) / BigInt::from(i + 1);
            }
            Ok(BigRational::from_integer(acc))
        }
    }
}

/// `base^p` for an integer `p`, refusing results beyond the size limit.
fn int_power(base: &BigRational, p: i64) -> Result<BigRational, Stop> {
    if base.is_zero() {
        return match p {
            0 => Ok(BigRational::one()),
            p if p > 0 => Ok(BigRational::zero()),
            _ => Err(Stop::Fail),
        };
    }
    if base.abs().is_one() {
        return Ok(if p % 2 == 0 { BigRational::one() } else { base.clone() });
    }
    let magnitude = p.unsigned_abs();
    if bits(base).saturating_mul(magnitude) > MAX_BITS {
        return Err(Stop::Fail);
    }
    let exp = i32::try_from(p).map_err(|_| Stop::Fail)?;
    Ok(num_traits::Pow::pow(base, exp))
}

/// The exact `n`-th root of `r` when it is rational (odd roots of negatives included).
fn exact_root(r: &BigRational, n: u32) -> Result<BigRational, Stop> {
    if n == 0 {
        return Err(Stop::Fail);
    }
    if r.is_negative() {
        return if n % 2 == 1 { Ok(-exact_root(&-r, n)?) } else { Err(Stop::Fail) };
    }
    let root = |x: &BigInt| {
        let candidate = x.nth_root(n);
        if num_traits::pow(candidate.clone(), n as usize) == *x { Ok(candidate) } else { Err(Stop::Fail) }
    };
    Ok(BigRational::new(root(r.numer())?, root(r.denom())?))
}

/// A finite result, or `Fail` when the operation overflowed or left the real domain.
fn finite(v: f64, inputs_infinite: bool) -> Result<f64, Stop> {
    if v.is_nan() || (v.is_infinite() && !inputs_infinite) { Err(Stop::Fail) } else { Ok(v) }
}

/// The `f64` value of `e` with variables bound by `vars`; `Stop::Fail` when undefined, unbound or overflowing.
pub(crate) fn approx(e: &Expr, vars: &[(String, f64)], budget: Budget) -> Result<f64, Stop> {
    budget.check()?;
    let go = |x: &Expr| approx(x, vars, budget);
    match e {
        Expr::Num { value, .. } => value.to_f64().filter(|v| v.is_finite()).ok_or(Stop::Fail),
        Expr::Var(name) => vars.iter().find(|(n, _)| n == name).map(|(_, v)| *v).ok_or(Stop::Fail),
        Expr::Pi => Ok(std::f64::consts::PI),
        Expr::E => Ok(std::f64::consts::E),
        Expr::Inf => Ok(f64::INFINITY),
        Expr::Sum(terms) => {
            let mut acc = 0.0_f64;
            for (negated, term) in terms {
                let v = go(term)?;
                let inf = acc.is_infinite() || v.is_infinite();
                acc = finite(if *negated { acc - v } else { acc + v }, inf)?;
            }
            Ok(acc)
        }
        Expr::Product(factors) => {
            let mut acc = 1.0_f64;
            for (divided, factor) in factors {
                let v = go(factor)?;
                if *divided && v == 0.0 {
                    return Err(Stop::Fail);
                }
                let inf = acc.is_infinite() || v.is_infinite();
                acc = finite(if *divided { acc / v } else { acc * v }, inf)?;
            }
            Ok(acc)
        }
        Expr::Neg(a) => Ok(-go(a)?),
        Expr::Abs(a) => Ok(go(a)?.abs()),
        Expr::Pow(base, exponent) => {
            let (b, x) = (go(base)?, go(exponent)?);
            finite(real_power(b, x), b.is_infinite() || x.is_infinite())
        }
        Expr::Root(index, radicand) => {
            let (n, r) = (go(index)?, go(radicand)?);
            if n == 0.0 {
                return Err(Stop::Fail);
            }
            finite(real_power(r, 1.0 / n), r.is_infinite())
        }
        Expr::Func(func, a) => {
            let x = go(a)?;
            finite(apply(*func, x), false)
        }
        Expr::Log(base, a) => {
            let (b, x) = (go(base)?, go(a)?);
            if b <= 0.0 || b == 1.0 || x <= 0.0 {
                return Err(Stop::Fail);
            }
            finite(x.ln() / b.ln(), false)
        }
        Expr::Factorial(a) => {
            let n = go(a)?;
            if !(0.0..=170.0).contains(&n) || n.fract() != 0.0 {
                return Err(Stop::Fail);
            }
            Ok((1..=n as u32).map(f64::from).product())
        }
        Expr::Binom(n, k) => {
            let (n, k) = (go(n)?, go(k)?);
            if n < 0.0 || k < 0.0 || n > 1000.0 || n.fract() != 0.0 || k.fract() != 0.0 {
                return Err(Stop::Fail);
            }
            Ok((0..k as u32).fold(1.0, |acc, i| acc * (n - f64::from(i)) / f64::from(i + 1)))
        }
    }
}

/// `b^x` over the reals, with odd roots of negative numbers (`(-8)^{1/3} = -2`).
fn real_power(b: f64, x: f64) -> f64 {
    if b >= 0.0 || x.fract() == 0.0 {
        return b.powf(x);
    }
    for q in [3.0, 5.0, 7.0, 9.0] {
        let p = x * q;
        if (p - p.round()).abs() < 1e-9 {
            let magnitude = (-b).powf(x);
            return if p.round() % 2.0 == 0.0 { magnitude } else { -magnitude };
        }
    }
    f64::NAN
}

fn apply(func: Func, x: f64) -> f64 {
    match func {
        Func::Sin => x.sin(),
        Func::Cos => x.cos(),
        Func::Tan => x.tan(),
        Func::Cot => 1.0 / x.tan(),
        Func::Sec => 1.0 / x.cos(),
        Func::Csc => 1.0 / x.sin(),
        Func::Asin => x.asin(),
        Func::Acos => x.acos(),
        Func::Atan => x.atan(),
        Func::Sinh => x.sinh(),
        Func::Cosh => x.cosh(),
        Func::Tanh => x.tanh(),
        Func::Ln | Func::Log if x <= 0.0 => f64::NAN,
        Func::Ln | Func::Log => x.ln(),
        Func::Exp => x.exp(),
    }
}
