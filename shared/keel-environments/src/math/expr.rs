//! Expression tree and recursive-descent parser (fractions, roots, powers, implicit multiplication,
//! functions, absolute values, factorials, percent).

use num_bigint::BigInt;
use num_rational::BigRational;
use num_traits::Zero;

use super::lex::{Func, Tok, tokenize};
use super::limits::{Budget, MAX_PARSE_DEPTH, Stop};

#[derive(Debug, Clone)]
pub(crate) enum Expr {
    /// A literal; `decimal` when it was written with fraction digits (`2.5`, not `3` or `3.0`).
    Num {
        value: BigRational,
        decimal: bool,
    },
    Var(String),
    Pi,
    E,
    Inf,
    /// Terms with a `negated` flag.
    Sum(Vec<(bool, Expr)>),
    /// Factors with a `divided` flag.
    Product(Vec<(bool, Expr)>),
    Neg(Box<Expr>),
    Pow(Box<Expr>, Box<Expr>),
    /// `(index, radicand)`.
    Root(Box<Expr>, Box<Expr>),
    Func(Func, Box<Expr>),
    /// `(base, argument)`.
    Log(Box<Expr>, Box<Expr>),
    Factorial(Box<Expr>),
    Abs(Box<Expr>),
    Binom(Box<Expr>, Box<Expr>),
}

/// How `%` is read: dropped (`50%` = 50) or as a factor 1/100 (`50%` = 0.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Percent {
    Drop,
    Scale,
}

/// Parses a whole expression; `Stop::Fail` when `s` is not a single well-formed expression.
pub(crate) fn parse_expr(s: &str, percent: Percent, budget: Budget) -> Result<Expr, Stop> {
    let toks = tokenize(s, budget)?;
    let mut parser = Parser { toks, pos: 0, depth: 0, in_abs: false, percent, budget };
    let expr = parser.sum()?;
    if parser.pos == parser.toks.len() { Ok(expr) } else { Err(Stop::Fail) }
}

/// Exact value of a decimal literal such as `2.50`, `.5` or `1.5e3`.
fn literal(text: &str) -> Result<Expr, Stop> {
    let (mantissa, exponent) = match text.find(['e', 'E']) {
        Some(at) => (&text[..at], text[at + 1..].parse::<i32>().map_err(|_| Stop::Fail)?),
        None => (text, 0),
    };
    if exponent.unsigned_abs() > 400 {
        return Err(Stop::Fail);
    }
    let (int_part, frac_part) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{int_part}{frac_part}");
    let numer: BigInt = if digits.is_empty() { BigInt::zero() } else { digits.parse().map_err(|_| Stop::Fail)? };
    let scale = i32::try_from(frac_part.len()).map_err(|_| Stop::Fail)? - exponent;
    let ten = BigInt::from(10u8);
    let value = if scale >= 0 {
        BigRational::new(numer, num_traits::pow(ten, scale.unsigned_abs() as usize))
    } else {
        BigRational::from_integer(numer * num_traits::pow(ten, scale.unsigned_abs() as usize))
    };
    let decimal = frac_part.trim_end_matches('0').chars().any(|c| c.is_ascii_digit()) || exponent < 0;
    Ok(Expr::Num { value, decimal })
}

fn integer(n: u32) -> Expr {
    Expr::Num { value: BigRational::from_integer(n.into()), decimal: false }
}

fn is_integer_literal(e: &Expr) -> bool {
    matches!(e, Expr::Num { value, decimal: false } if value.is_integer())
}

struct Parser {
    toks: Vec<Tok>,
    pos: usize,
    depth: usize,
    in_abs: bool,
    percent: Percent,
    budget: Budget,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }

    fn eat(&mut self, tok: &Tok) -> bool {
        let hit = self.peek() == Some(tok);
        self.pos += usize::from(hit);
        hit
    }

    fn require(&mut self, tok: &Tok) -> Result<(), Stop> {
        if self.eat(tok) { Ok(()) } else { Err(Stop::Fail) }
    }

    fn next(&mut self) -> Result<Tok, Stop> {
        let tok = self.toks.get(self.pos).cloned().ok_or(Stop::Fail)?;
        self.pos += 1;
        Ok(tok)
    }

    /// Runs `f` one nesting level deeper, failing past the depth limit.
    fn nested<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T, Stop>) -> Result<T, Stop> {
        self.budget.check()?;
        if self.depth >= MAX_PARSE_DEPTH {
            return Err(Stop::Fail);
        }
        self.depth += 1;
        let result = f(self);
        self.depth -= 1;
        result
    }

    fn sum(&mut self) -> Result<Expr, Stop> {
        let mut terms = vec![(false, self.product()?)];
        loop {
            self.budget.check()?;
            let negated = match self.peek() {
                Some(Tok::Op('+')) => false,
                Some(Tok::Op('-')) => true,
                _ => break,
            };
            self.pos += 1;
            terms.push((negated, self.product()?));
        }
        Ok(if terms.len() == 1 { terms.remove(0).1 } else { Expr::Sum(terms) })
    }

    fn starts_factor(&self) -> bool {
        match self.peek() {
            Some(Tok::Num(_) | Tok::Var(_) | Tok::Pi | Tok::E | Tok::Inf | Tok::Func(_)) => true,
            Some(Tok::Frac | Tok::Sqrt | Tok::Binom | Tok::Open(_)) => true,
            Some(Tok::Bar) => !self.in_abs,
            _ => false,
        }
    }

    fn product(&mut self) -> Result<Expr, Stop> {
        let mut factors = vec![(false, self.unary()?)];
        loop {
            self.budget.check()?;
            match self.peek() {
                Some(Tok::Op(op @ ('*' | '/'))) => {
                    let divided = *op == '/';
                    self.pos += 1;
                    factors.push((divided, self.unary()?));
                }
                _ if self.starts_factor() => factors.push((false, self.power()?)),
                _ => break,
            }
        }
        Ok(if factors.len() == 1 { factors.remove(0).1 } else { Expr::Product(factors) })
    }

    fn unary(&mut self) -> Result<Expr, Stop> {
        self.nested(|p| {
            if p.eat(&Tok::Op('-')) {
                Ok(Expr::Neg(Box::new(p.unary()?)))
            } else if p.eat(&Tok::Op('+')) {
                p.unary()
            } else {
                p.power()
            }
        })
    }

    fn power(&mut self) -> Result<Expr, Stop> {
        let base = self.postfix()?;
        if self.eat(&Tok::Op('^')) {
            let exponent = self.single_arg_or(Self::unary)?;
            return Ok(Expr::Pow(Box::new(base), Box::new(exponent)));
        }
        Ok(base)
    }

    fn postfix(&mut self) -> Result<Expr, Stop> {
        let mut e = self.primary()?;
        loop {
            if self.eat(&Tok::Op('!')) {
                e = Expr::Factorial(Box::new(e));
            } else if self.eat(&Tok::Op('%')) {
                if self.percent == Percent::Scale {
                    e = Expr::Product(vec![(false, e), (true, integer(100))]);
                }
            } else {
                return Ok(e);
            }
        }
    }

    /// A LaTeX argument: `{…}`, else one character of a number (`\frac12`, `x^23`), else `fallback`.
    fn single_arg_or(&mut self, fallback: fn(&mut Self) -> Result<Expr, Stop>) -> Result<Expr, Stop> {
        match self.peek() {
            Some(Tok::Open('{')) => {
                self.pos += 1;
                let e = self.nested(Self::sum)?;
                self.require(&Tok::Close('}'))?;
                Ok(e)
            }
            Some(Tok::Num(text)) if text.chars().count() > 1 => {
                let mut chars = text.chars();
                let first = chars.next().ok_or(Stop::Fail)?;
                let rest: String = chars.collect();
                self.toks[self.pos] = Tok::Num(rest);
                literal(&first.to_string())
            }
            _ => fallback(self),
        }
    }

    fn arg(&mut self) -> Result<Expr, Stop> {
        self.single_arg_or(Self::primary)
    }

    fn primary(&mut self) -> Result<Expr, Stop> {
        self.nested(Self::primary_inner)
    }

    fn primary_inner(&mut self) -> Result<Expr, Stop> {
        match self.next()? {
            Tok::Num(text) => {
                let n = literal(&text)?;
                if is_integer_literal(&n) && self.peek() == Some(&Tok::Frac) {
                    // mixed number: 3\frac{1}{2} = 3 + 1/2 when the fraction is of integer literals
                    let frac = self.primary()?;
                    let mixed = matches!(&frac, Expr::Product(f) if f.iter().all(|(_, e)| is_integer_literal(e)));
                    let parts = vec![(false, n), (false, frac)];
                    return Ok(if mixed { Expr::Sum(parts) } else { Expr::Product(parts) });
                }
                Ok(n)
            }
            Tok::Var(name) => self.subscripted(name),
            Tok::Pi => Ok(Expr::Pi),
            Tok::E => Ok(Expr::E),
            Tok::Inf => Ok(Expr::Inf),
            Tok::Open(open) => {
                let close = match open {
                    '(' => ')',
                    '[' => ']',
                    _ => '}',
                };
                let saved = std::mem::replace(&mut self.in_abs, false);
                let e = self.sum();
                self.in_abs = saved;
                let e = e?;
                self.require(&Tok::Close(close))?;
                Ok(e)
            }
            Tok::Bar if !self.in_abs => {
                self.in_abs = true;
                let e = self.sum();
                self.in_abs = false;
                let e = e?;
                self.require(&Tok::Bar)?;
                Ok(Expr::Abs(Box::new(e)))
            }
            Tok::Frac => {
                let numer = self.arg()?;
                let denom = self.arg()?;
                Ok(Expr::Product(vec![(false, numer), (true, denom)]))
            }
            Tok::Sqrt => {
                let index = if self.eat(&Tok::Open('[')) {
                    let index = self.sum()?;
                    self.require(&Tok::Close(']'))?;
                    index
                } else {
                    integer(2)
                };
                Ok(Expr::Root(Box::new(index), Box::new(self.arg()?)))
            }
            Tok::Binom => {
                let n = self.arg()?;
                let k = self.arg()?;
                Ok(Expr::Binom(Box::new(n), Box::new(k)))
            }
            Tok::Func(func) => self.function(func),
            _ => Err(Stop::Fail),
        }
    }

    /// `x_1`, `x_{12}`, `a_n`: a subscripted variable is one variable.
    fn subscripted(&mut self, name: String) -> Result<Expr, Stop> {
        if !self.eat(&Tok::Op('_')) {
            return Ok(Expr::Var(name));
        }
        let braced = self.eat(&Tok::Open('{'));
        let mut sub = String::new();
        loop {
            match self.next()? {
                Tok::Num(text) if !braced => {
                    let mut chars = text.chars();
                    sub.extend(chars.next());
                    let rest: String = chars.collect();
                    if !rest.is_empty() {
                        self.pos -= 1;
                        self.toks[self.pos] = Tok::Num(rest);
                    }
                }
                Tok::Num(text) | Tok::Var(text) => sub.push_str(&text),
                Tok::Close('}') if braced && !sub.is_empty() => break,
                _ => return Err(Stop::Fail),
            }
            if !braced {
                break;
            }
        }
        Ok(Expr::Var(format!("{name}_{sub}")))
    }

    /// `\sin x`, `\sin(x)`, `\sin^2 x`, `\log_2 8`, `\ln|x|`.
    fn function(&mut self, func: Func) -> Result<Expr, Stop> {
        let base = if func == Func::Log && self.eat(&Tok::Op('_')) { Some(self.arg()?) } else { None };
        let power = if self.eat(&Tok::Op('^')) { Some(self.single_arg_or(Self::unary)?) } else { None };
        let argument = match self.peek() {
            Some(Tok::Open(_)) => self.primary()?,
            _ => self.power()?,
        };
        let applied = match base {
            Some(base) => Expr::Log(Box::new(base), Box::new(argument)),
            None => Expr::Func(func, Box::new(argument)),
        };
        Ok(match power {
            Some(p) => Expr::Pow(Box::new(applied), Box::new(p)),
            None => applied,
        })
    }
}

/// True when some literal was written with fraction digits (`0.5`): such answers are compared with tolerance.
pub(crate) fn has_decimal(e: &Expr) -> bool {
    match e {
        Expr::Num { decimal, .. } => *decimal,
        Expr::Var(_) | Expr::Pi | Expr::E | Expr::Inf => false,
        Expr::Sum(parts) | Expr::Product(parts) => parts.iter().any(|(_, e)| has_decimal(e)),
        Expr::Neg(a) | Expr::Func(_, a) | Expr::Factorial(a) | Expr::Abs(a) => has_decimal(a),
        Expr::Pow(a, b) | Expr::Root(a, b) | Expr::Log(a, b) | Expr::Binom(a, b) => has_decimal(a) || has_decimal(b),
    }
}

/// Collects the free variables of `e`.
pub(crate) fn collect_vars(e: &Expr, out: &mut std::collections::BTreeSet<String>) {
    match e {
        Expr::Var(name) => {
            out.insert(name.clone());
        }
        Expr::Num { .. } | Expr::Pi | Expr::E | Expr::Inf => {}
        Expr::Sum(parts) | Expr::Product(parts) => parts.iter().for_each(|(_, e)| collect_vars(e, out)),
        Expr::Neg(a) | Expr::Func(_, a) | Expr::Factorial(a) | Expr::Abs(a) => collect_vars(a, out),
        Expr::Pow(a, b) | Expr::Root(a, b) | Expr::Log(a, b) | Expr::Binom(a, b) => {
            collect_vars(a, out);
            collect_vars(b, out);
        }
    }
}
