//! Top-level shape of an answer: lists of answers, tuples and intervals, sets, unions, labelled values
//! (`x = 3`), equations, single expressions, or plain text.

use super::expr::{Expr, Percent, parse_expr};
use super::limits::{Budget, MAX_STRUCTURE_DEPTH, Stop};

#[derive(Debug, Clone)]
pub(crate) enum Answer {
    Expr(Expr),
    /// `x = 3`, `f(x) = 2x`, `(x, y) = (1, 2)`, `x \in [0, 1]`: a value with a name in front.
    Labeled(String, Box<Answer>),
    /// An equation whose left side is not a plain name: `x^2 + y^2 = 1`.
    Equation(Expr, Expr),
    /// Ordered, with its brackets: tuples `(1, 2)`, intervals `[0, 1)`.
    Seq {
        open: char,
        close: char,
        items: Vec<Answer>,
    },
    /// `\{1, 2\}`, unordered.
    Set(Vec<Answer>),
    /// Several bare answers `2, 3` / `2 and 3` / `x=2 or x=3`, unordered.
    List(Vec<Answer>),
    /// `A \cup B`, unordered.
    Union(Vec<Answer>),
    Text(String),
}

/// Parses a normalised answer. Only a timeout is an error; anything unparseable becomes `Text`.
pub(crate) fn parse_answer(s: &str, percent: Percent, budget: Budget) -> Result<Answer, Stop> {
    parse_at(s.trim(), percent, budget, 0)
}

fn parse_at(s: &str, percent: Percent, budget: Budget, depth: usize) -> Result<Answer, Stop> {
    budget.check()?;
    if depth > MAX_STRUCTURE_DEPTH || s.is_empty() {
        return Ok(Answer::Text(s.to_owned()));
    }
    let parse_all = |parts: Vec<&str>| -> Result<Vec<Answer>, Stop> {
        parts.into_iter().map(|p| parse_at(p.trim(), percent, budget, depth + 1)).collect()
    };
    if matches!(s, "\\emptyset" | "\\varnothing" | "\\{\\}" | "\\{ \\}") {
        return Ok(Answer::Set(Vec::new()));
    }
    let parts = split_top(s, &[",", ";", " and ", " or "]);
    if parts.len() > 1 {
        return Ok(Answer::List(parse_all(parts)?));
    }
    let parts = split_top(s, &["\\cup"]);
    if parts.len() > 1 {
        return Ok(Answer::Union(parse_all(parts)?));
    }
    if let Some(inner) = s.strip_prefix("\\{").and_then(|r| r.strip_suffix("\\}")).filter(|_| wraps(s)) {
        let items = split_top(inner, &[","]);
        return Ok(Answer::Set(if inner.trim().is_empty() { Vec::new() } else { parse_all(items)? }));
    }
    if let (Some(open @ ('(' | '[')), Some(close @ (')' | ']'))) = (s.chars().next(), s.chars().last())
        && wraps(s)
    {
        let inner = &s[1..s.len() - 1];
        let items = split_top(inner, &[","]);
        if items.len() > 1 {
            return Ok(Answer::Seq { open, close, items: parse_all(items)? });
        }
    }
    if let Some((left, right)) = plus_minus(s) {
        return Ok(Answer::List(vec![
            parse_at(&left, percent, budget, depth + 1)?,
            parse_at(&right, percent, budget, depth + 1)?,
        ]));
    }
    let sides = split_top(s, &["=", "\\in "]);
    if sides.len() == 2 {
        let (lhs, rhs) = (sides[0].trim(), sides[1].trim());
        if is_label(lhs) {
            let label: String = lhs.chars().filter(|c| !c.is_whitespace()).collect();
            return Ok(Answer::Labeled(label, Box::new(parse_at(rhs, percent, budget, depth + 1)?)));
        }
        return match (expr(lhs, percent, budget)?, expr(rhs, percent, budget)?) {
            (Some(l), Some(r)) => Ok(Answer::Equation(l, r)),
            _ => Ok(Answer::Text(s.to_owned())),
        };
    }
    if sides.len() > 2 {
        return Ok(Answer::Text(s.to_owned()));
    }
    Ok(match expr(s, percent, budget)? {
        Some(e) => Answer::Expr(e),
        None => Answer::Text(s.to_owned()),
    })
}

fn expr(s: &str, percent: Percent, budget: Budget) -> Result<Option<Expr>, Stop> {
    match parse_expr(s, percent, budget) {
        Ok(e) => Ok(Some(e)),
        Err(Stop::Fail) => Ok(None),
        Err(Stop::Timeout) => Err(Stop::Timeout),
    }
}

/// Bracket nesting change of the bracket starting at byte `i`, and its length in bytes.
fn bracket_at(s: &str, i: usize) -> Option<(isize, usize)> {
    let rest = &s[i..];
    if rest.starts_with("\\{") {
        Some((1, 2))
    } else if rest.starts_with("\\}") {
        Some((-1, 2))
    } else if rest.starts_with("\\\\") {
        Some((0, 2))
    } else {
        match rest.as_bytes().first() {
            Some(b'(' | b'[' | b'{') => Some((1, 1)),
            Some(b')' | b']' | b'}') => Some((-1, 1)),
            _ => None,
        }
    }
}

/// Splits `s` at any of `seps` outside all brackets.
fn split_top<'a>(s: &'a str, seps: &[&str]) -> Vec<&'a str> {
    let mut parts = Vec::new();
    let mut depth = 0isize;
    let mut start = 0;
    let mut i = 0;
    while i < s.len() {
        if let Some((delta, len)) = bracket_at(s, i) {
            depth += delta;
            i += len;
            continue;
        }
        if depth == 0
            && let Some(sep) = seps.iter().find(|sep| s[i..].starts_with(**sep))
        {
            parts.push(&s[start..i]);
            i += sep.len();
            start = i;
            continue;
        }
        i += s[i..].chars().next().map_or(1, char::len_utf8);
    }
    parts.push(&s[start..]);
    parts
}

/// True when the bracket opening `s` closes exactly at its end.
fn wraps(s: &str) -> bool {
    let mut depth = 0isize;
    let mut i = 0;
    while i < s.len() {
        if let Some((delta, len)) = bracket_at(s, i) {
            depth += delta;
            i += len;
            if depth <= 0 {
                return i == s.len();
            }
            continue;
        }
        i += s[i..].chars().next().map_or(1, char::len_utf8);
    }
    false
}

/// `a \pm b` → (`a + b`, `a - b`) when there is exactly one `\pm` / `\mp`.
fn plus_minus(s: &str) -> Option<(String, String)> {
    let pm = ["\\pm", "\\mp"];
    let hits: usize = pm.iter().map(|p| s.matches(p).count()).sum();
    if hits != 1 || s.contains("\\pmod") {
        return None;
    }
    let (at, sign) = pm.iter().zip(['+', '-']).find_map(|(p, sign)| s.find(p).map(|at| (at, sign)))?;
    let (head, tail) = (&s[..at], &s[at + 3..]);
    let other = if sign == '+' { '-' } else { '+' };
    Some((format!("{head}{sign}{tail}"), format!("{head}{other}{tail}")))
}

/// A name on the left of `=`: `x`, `x_1`, `y_{2}`, `f(x)`, `\theta`, `AB`, or a tuple of such `(x, y)`.
fn is_label(s: &str) -> bool {
    let t: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    if let Some(inner) = t.strip_prefix('(').and_then(|r| r.strip_suffix(')')) {
        return !inner.is_empty() && inner.split(',').all(is_simple_label);
    }
    is_simple_label(&t)
}

fn is_simple_label(t: &str) -> bool {
    let body = t.strip_prefix('\\').unwrap_or(t);
    body.len() <= 16
        && body.starts_with(|c: char| c.is_ascii_alphabetic())
        && body.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '{' | '}' | '(' | ')' | '\'' | ','))
}
