//! Tokenizer for normalised LaTeX-style math (`\frac12`, `2\pi`, `x^{2}`, `sqrt(2)`, `1.5e3`).

use super::limits::{Budget, Stop};

/// Elementary functions understood by the parser.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Func {
    Sin,
    Cos,
    Tan,
    Cot,
    Sec,
    Csc,
    Asin,
    Acos,
    Atan,
    Sinh,
    Cosh,
    Tanh,
    Ln,
    Log,
    Exp,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Tok {
    /// A decimal literal as written (`12`, `2.50`, `.5`, `1.5e3`).
    Num(String),
    Var(String),
    Pi,
    E,
    Inf,
    Func(Func),
    Frac,
    Sqrt,
    Binom,
    /// One of `+ - * / ^ ! % _`.
    Op(char),
    /// One of `( [ {`.
    Open(char),
    /// One of `) ] }`.
    Close(char),
    Bar,
}

/// Words recognised without a backslash, longest first so that `arcsin` wins over `sin`.
const WORDS: [&str; 20] = [
    "infinity", "arcsin", "arccos", "arctan", "infty", "sinh", "cosh", "tanh", "sqrt", "sin", "cos", "tan", "cot",
    "sec", "csc", "exp", "log", "inf", "ln", "pi",
];

const GREEK: [&str; 22] = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "varepsilon",
    "zeta",
    "eta",
    "theta",
    "vartheta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "rho",
    "sigma",
    "tau",
    "phi",
    "varphi",
    "omega",
];

fn word_token(word: &str) -> Option<Tok> {
    let func = |f| Some(Tok::Func(f));
    match word {
        "pi" => Some(Tok::Pi),
        "infty" | "infin" | "inf" | "infinity" => Some(Tok::Inf),
        "sqrt" => Some(Tok::Sqrt),
        "sin" => func(Func::Sin),
        "cos" => func(Func::Cos),
        "tan" => func(Func::Tan),
        "cot" => func(Func::Cot),
        "sec" => func(Func::Sec),
        "csc" => func(Func::Csc),
        "arcsin" => func(Func::Asin),
        "arccos" => func(Func::Acos),
        "arctan" => func(Func::Atan),
        "sinh" => func(Func::Sinh),
        "cosh" => func(Func::Cosh),
        "tanh" => func(Func::Tanh),
        "ln" => func(Func::Ln),
        "log" => func(Func::Log),
        "exp" => func(Func::Exp),
        _ => None,
    }
}

fn command_token(name: &str) -> Option<Tok> {
    match name {
        "frac" => Some(Tok::Frac),
        "binom" | "choose" => Some(Tok::Binom),
        "cdot" | "times" | "ast" => Some(Tok::Op('*')),
        "div" => Some(Tok::Op('/')),
        _ if GREEK.contains(&name) => Some(Tok::Var(name.to_owned())),
        _ => word_token(name),
    }
}

/// Splits `s` into tokens; `Stop::Fail` on anything that is not math (unknown commands, relations, words).
pub(crate) fn tokenize(s: &str, budget: Budget) -> Result<Vec<Tok>, Stop> {
    let chars: Vec<char> = s.chars().collect();
    let mut toks = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        budget.check()?;
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        match c {
            c if c.is_whitespace() => i += 1,
            '0'..='9' | '.' => {
                let (len, num) = number_at(&chars[i..]).ok_or(Stop::Fail)?;
                toks.push(Tok::Num(num));
                i += len;
            }
            'a'..='z' | 'A'..='Z' => {
                let end = chars[i..].iter().position(|c| !c.is_ascii_alphabetic()).map_or(chars.len(), |p| i + p);
                let run: String = chars[i..end].iter().collect();
                split_letters(&run, &mut toks)?;
                i = end;
            }
            '\\' => {
                let end =
                    chars[i + 1..].iter().position(|c| !c.is_ascii_alphabetic()).map_or(chars.len(), |p| i + 1 + p);
                let name: String = chars[i + 1..end].iter().collect();
                toks.push(command_token(&name).ok_or(Stop::Fail)?);
                i = end;
            }
            '*' if next == Some('*') => {
                toks.push(Tok::Op('^'));
                i += 2;
            }
            '+' | '-' | '*' | '/' | '^' | '!' | '%' | '_' => {
                toks.push(Tok::Op(c));
                i += 1;
            }
            '(' | '[' | '{' => {
                toks.push(Tok::Open(c));
                i += 1;
            }
            ')' | ']' | '}' => {
                toks.push(Tok::Close(c));
                i += 1;
            }
            '|' => {
                toks.push(Tok::Bar);
                i += 1;
            }
            _ => return Err(Stop::Fail),
        }
    }
    Ok(toks)
}

/// A number literal at the start of `chars`: its length in chars and its text.
fn number_at(chars: &[char]) -> Option<(usize, String)> {
    let digits = |from: usize| chars[from..].iter().take_while(|c| c.is_ascii_digit()).count();
    let mut len = digits(0);
    if chars.get(len) == Some(&'.') {
        len += 1 + digits(len + 1);
    }
    if !chars[..len].iter().any(char::is_ascii_digit) {
        return None;
    }
    // scientific notation: 1.5e3, 2E-4
    if matches!(chars.get(len), Some('e' | 'E')) {
        let sign = usize::from(matches!(chars.get(len + 1), Some('+' | '-')));
        let exp_digits = digits(len + 1 + sign);
        if exp_digits > 0 {
            len += 1 + sign + exp_digits;
        }
    }
    Some((len, chars[..len].iter().collect()))
}

/// A run of letters: known words (`pi`, `sin`, …) and single-letter variables; three or more loose
/// letters mean a word, which is not math.
fn split_letters(run: &str, toks: &mut Vec<Tok>) -> Result<(), Stop> {
    let mut loose = 0;
    let mut rest = run;
    while !rest.is_empty() {
        if let Some(word) = WORDS.iter().find(|w| rest.starts_with(*w)) {
            toks.extend(word_token(word));
            rest = &rest[word.len()..];
            continue;
        }
        let letter = &rest[..1];
        toks.push(if letter == "e" { Tok::E } else { Tok::Var(letter.to_owned()) });
        rest = &rest[1..];
        loose += 1;
    }
    if loose >= 3 { Err(Stop::Fail) } else { Ok(()) }
}
