//! String-level clean-up of an extracted answer before it is parsed: unicode, spacing and sizing commands,
//! `\text{…}` wrappers, trailing units, degree signs, dollar signs and thousands separators.

use super::extract::balanced_prefix;

/// Commands whose braced argument is kept as plain text (or dropped when it is a trailing unit).
const TEXT_COMMANDS: [&str; 17] = [
    "text",
    "textbf",
    "textit",
    "textrm",
    "textnormal",
    "textsf",
    "texttt",
    "mathrm",
    "mathbf",
    "mathit",
    "mathsf",
    "mathtt",
    "mbox",
    "hbox",
    "operatorname",
    "boldsymbol",
    "bm",
];

/// Words that are math, never a unit.
const MATH_WORDS: [&str; 24] = [
    "pi", "sqrt", "sin", "cos", "tan", "cot", "sec", "csc", "ln", "log", "exp", "infty", "inf", "infinity", "and",
    "or", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "frac", "cup",
];

/// Units recognised even when written directly after a number without a space (`5cm`).
const ATTACHED_UNITS: [&str; 22] = [
    "cm", "mm", "km", "kg", "mg", "ml", "mL", "ft", "in", "yd", "mi", "hr", "hrs", "min", "lb", "lbs", "oz", "mph",
    "cents", "dollars", "degrees", "units",
];

/// Normalises an answer string; the result has single spaces and no leading/trailing whitespace.
pub(crate) fn normalize(raw: &str) -> String {
    let s = replace_unicode(raw);
    let s = s.replace("\\mathbb{R}", "(-\\infty,\\infty)").replace("\\mathbb R", "(-\\infty,\\infty)");
    let s = unwrap_text_commands(&s);
    let s = rewrite_commands(&s);
    let s = collapse_whitespace(&s.replace("{,}", ""));
    let s = s.trim_end_matches(['.', ' ']).to_owned();
    let s = strip_trailing_units(&s);
    collapse_whitespace(&join_thousands(&s))
}

/// Text used when neither side is math: lower case, no braces or backslashes, single spaces.
pub(crate) fn text_key(s: &str) -> String {
    let cleaned: String = s.chars().filter(|c| !matches!(c, '{' | '}' | '\\')).collect();
    collapse_whitespace(&cleaned.to_lowercase()).trim_end_matches('.').trim().to_owned()
}

fn collapse_whitespace(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn replace_unicode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\u{2212}' | '\u{2013}' | '\u{2012}' | '\u{fe63}' | '\u{ff0d}' => out.push('-'),
            '\u{d7}' | '\u{b7}' | '\u{22c5}' | '\u{2217}' => out.push('*'),
            '\u{f7}' => out.push('/'),
            '\u{3c0}' => out.push_str("\\pi "),
            '\u{221e}' => out.push_str("\\infty "),
            '\u{221a}' => out.push_str("\\sqrt"),
            '\u{b0}' => {}
            '\u{222a}' => out.push_str("\\cup "),
            '\u{2264}' => out.push_str("\\le "),
            '\u{2265}' => out.push_str("\\ge "),
            '\u{2260}' => out.push_str("\\ne "),
            '\u{2208}' => out.push_str("\\in "),
            '\u{2205}' => out.push_str("\\emptyset "),
            '\u{ff0c}' => out.push(','),
            '\u{200b}' | '\u{feff}' => {}
            c if c.is_whitespace() => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// Replaces `\text{…}`-like commands by their content, or drops them when they are a trailing unit
/// (`5\text{ cm}`, `10\mbox{ inches}^2`).
fn unwrap_text_commands(s: &str) -> String {
    let mut s = s.to_owned();
    for _ in 0..64 {
        let Some((start, name_len)) = last_text_command(&s) else { break };
        let body_start = start + name_len;
        let Some(content) = balanced_prefix(&s[body_start..]) else { break };
        let content = content.to_owned();
        let rest = s[body_start + content.len() + 1..].to_owned();
        let prefix = &s[..start];
        let rest_core = strip_power_suffix(rest.trim()).trim_end_matches('.').trim();
        let trailing_unit =
            rest_core.is_empty() && prefix.chars().any(|c| c.is_ascii_digit()) && is_unit_like(&content);
        s = if trailing_unit { prefix.to_owned() } else { format!("{prefix} {content} {rest}") };
    }
    s
}

/// Position of the last `\name{` of a text command, and the length of `\name{`.
fn last_text_command(s: &str) -> Option<(usize, usize)> {
    TEXT_COMMANDS
        .iter()
        .filter_map(|name| {
            let needle = format!("\\{name}{{");
            s.rfind(&needle).map(|at| (at, needle.len()))
        })
        .max_by_key(|&(at, _)| at)
}

fn is_unit_like(content: &str) -> bool {
    let t = content.trim().to_lowercase();
    !t.is_empty()
        && t.chars().any(|c| c.is_alphabetic())
        && t.chars().all(|c| c.is_alphabetic() || c.is_ascii_digit() || matches!(c, ' ' | '.' | '/' | '^' | '-'))
        && !matches!(t.as_str(), "and" | "or" | "e" | "i")
}

/// `cm^2`, `m^{3}` → the part before the exponent.
fn strip_power_suffix(s: &str) -> &str {
    for suffix in ["^2", "^3", "^{2}", "^{3}"] {
        if let Some(core) = s.strip_suffix(suffix) {
            return core.trim_end();
        }
    }
    s
}

/// Drops sizing/spacing commands, `$`, degree signs; maps `\dfrac`/`\tfrac` to `\frac`, `\%` to `%`.
fn rewrite_commands(s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    let mut skip_brace = false;
    while i < chars.len() {
        let c = chars[i];
        i += 1;
        if skip_brace && !c.is_whitespace() {
            skip_brace = false;
            if c == '}' {
                continue;
            }
        }
        match c {
            '$' => {}
            '~' => out.push(' '),
            '\\' => {
                let start = i;
                while i < chars.len() && chars[i].is_ascii_alphabetic() {
                    i += 1;
                }
                if start == i {
                    // `\` + one non-letter character
                    let Some(&next) = chars.get(i) else { break };
                    i += 1;
                    match next {
                        '!' | '$' => {}
                        ',' | ';' | ':' | ' ' => out.push(' '),
                        '%' => out.push('%'),
                        other => {
                            out.push('\\');
                            out.push(other);
                        }
                    }
                    continue;
                }
                let name: String = chars[start..i].iter().collect();
                match name.as_str() {
                    "left" | "right" | "big" | "Big" | "bigg" | "Bigg" | "bigl" | "bigr" | "Bigl" | "Bigr"
                    | "biggl" | "biggr" | "middle" => {
                        if chars.get(i) == Some(&'.') {
                            i += 1;
                        }
                    }
                    "displaystyle" | "textstyle" | "scriptstyle" | "limits" | "quad" | "qquad" | "hfill" => {
                        out.push(' ')
                    }
                    "dfrac" | "tfrac" | "cfrac" => out.push_str("\\frac"),
                    "dbinom" | "tbinom" => out.push_str("\\binom"),
                    "circ" | "degree" => {
                        let kept = out.trim_end().len();
                        out.truncate(kept);
                        if out.ends_with("^{") {
                            out.truncate(out.len() - 2);
                            skip_brace = true;
                        } else if out.ends_with('^') {
                            out.truncate(out.len() - 1);
                        }
                    }
                    "lbrace" => out.push_str("\\{"),
                    "rbrace" => out.push_str("\\}"),
                    "langle" => out.push('('),
                    "rangle" => out.push(')'),
                    "lvert" | "rvert" | "vert" => out.push('|'),
                    "infin" => out.push_str("\\infty"),
                    "in" => out.push_str(" \\in "),
                    "leq" | "leqslant" => out.push_str("\\le"),
                    "geq" | "geqslant" => out.push_str("\\ge"),
                    "neq" => out.push_str("\\ne"),
                    _ => {
                        out.push('\\');
                        out.push_str(&name);
                    }
                }
                // keep a command separated from a following letter (`\pi x`)
                if chars.get(i).is_some_and(|c| c.is_ascii_alphabetic()) {
                    out.push(' ');
                }
            }
            c => out.push(c),
        }
    }
    out
}

/// Drops unit words after a number: `5 cm`, `12 meters`, `3 square feet`, `5cm`, `4 cm^2`.
fn strip_trailing_units(s: &str) -> String {
    let mut s = s.to_owned();
    for _ in 0..8 {
        let core = strip_power_suffix(s.trim_end());
        let word_start = core.rfind(|c: char| !c.is_ascii_alphabetic()).map_or(0, |i| ceil_char(core, i + 1));
        let word = &core[word_start..];
        let before = &core[..word_start];
        let attached = !before.ends_with(' ');
        let is_unit = word.len() >= 2
            && !MATH_WORDS.contains(&word.to_ascii_lowercase().as_str())
            && !before.ends_with('\\')
            && (!attached || ATTACHED_UNITS.contains(&word))
            && before.chars().any(|c| c.is_ascii_digit());
        if !is_unit {
            break;
        }
        s = before.trim_end().to_owned();
    }
    s
}

/// The first char boundary at or after `i`.
fn ceil_char(s: &str, i: usize) -> usize {
    (i..s.len()).find(|&j| s.is_char_boundary(j)).unwrap_or(s.len())
}

/// Joins `1,000,000` into `1000000` outside brackets. A run `d{1,3}(,ddd)+` with no spaces is a thousands
/// number; `1,2`, `10,20` or anything inside `(…)`, `[…]`, `\{…\}` stays a list.
fn join_thousands(s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len());
    let mut depth = 0usize;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let starts_number = c.is_ascii_digit() && (i == 0 || !matches!(chars[i - 1], '0'..='9' | '.' | ','));
        if depth == 0 && starts_number {
            let mut j = i;
            while j < chars.len() && (chars[j].is_ascii_digit() || chars[j] == ',') {
                j += 1;
            }
            let run: String = chars[i..j].iter().collect();
            let groups: Vec<&str> = run.trim_end_matches(',').split(',').collect();
            let thousands =
                groups.len() >= 2 && (1..=3).contains(&groups[0].len()) && groups[1..].iter().all(|g| g.len() == 3);
            if thousands {
                out.extend(groups);
                // keep a trailing comma that was not part of the number
                out.push_str(&run[run.trim_end_matches(',').len()..]);
                i = j;
                continue;
            }
        }
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth = depth.saturating_sub(1),
            '\\' if matches!(chars.get(i + 1), Some('{')) => depth += 1,
            '\\' if matches!(chars.get(i + 1), Some('}')) => depth = depth.saturating_sub(1),
            _ => {}
        }
        out.push(c);
        i += 1;
    }
    out
}
