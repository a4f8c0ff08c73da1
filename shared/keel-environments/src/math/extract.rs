//! Finding the final answer in a model response: the last `\boxed{…}` / `\fbox{…}`, else a configured regex.

use regex::Regex;

/// Commands whose argument is the final answer.
const BOX_COMMANDS: [&str; 2] = ["\\boxed", "\\fbox"];

/// Extracts the final answer from `response`.
///
/// The last `\boxed{…}` or `\fbox{…}` wins (braces matched with nesting, `\{`/`\}` are not structural);
/// `\boxed 5` (a space, then one token) is accepted too. When the last box is unbalanced or empty there is
/// no answer. Without any box, the last match of `pattern` is used (its first capture group, or the whole
/// match when it has none). The result is trimmed and never empty.
pub fn extract_answer(response: &str, pattern: Option<&Regex>) -> Option<String> {
    if let Some(start) = last_box(response) {
        return boxed_content(&response[start..]).map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned);
    }
    let captures = pattern?.captures_iter(response).last()?;
    let found = captures.get(1).or_else(|| captures.get(0))?;
    Some(found.as_str().trim()).filter(|s| !s.is_empty()).map(str::to_owned)
}

/// Byte offset just after the name of the last box command in `text` (always a char boundary).
fn last_box(text: &str) -> Option<usize> {
    BOX_COMMANDS
        .iter()
        .filter_map(|cmd| {
            // Skip occurrences that are a prefix of a longer command name (`\boxedx`).
            let mut end = text.len();
            loop {
                let at = text[..end].rfind(cmd)?;
                let after = at + cmd.len();
                if !text[after..].starts_with(|c: char| c.is_ascii_alphabetic()) {
                    return Some(after);
                }
                end = at;
            }
        })
        .max()
}

/// The argument of a box command, given the text right after its name.
fn boxed_content(rest: &str) -> Option<&str> {
    let trimmed = rest.trim_start();
    if let Some(body) = trimmed.strip_prefix('{') {
        return balanced_prefix(body);
    }
    if trimmed.len() == rest.len() {
        return None; // `\boxed` followed directly by something other than `{` or a space
    }
    let end = trimmed.find(|c: char| c.is_whitespace() || c == '$').unwrap_or(trimmed.len());
    Some(&trimmed[..end])
}

/// Given the text after an opening `{`, the text up to its matching `}`; `None` when it never closes.
pub(crate) fn balanced_prefix(body: &str) -> Option<&str> {
    let mut depth = 0usize;
    let mut chars = body.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '\\' => {
                chars.next(); // an escaped character (`\{`, `\}`, `\\`) never opens or closes
            }
            '{' => depth += 1,
            '}' if depth == 0 => return Some(&body[..i]),
            '}' => depth -= 1,
            _ => {}
        }
    }
    None
}
