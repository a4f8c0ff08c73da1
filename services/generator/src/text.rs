//! Turning generated token ids into text the way clients expect: stop strings cut the text
//! (or stay in it, by flag), and a stream never shows text that may still turn into a stop
//! string or an incomplete UTF-8 character.

/// The final text of a sample whose decoded output is `text`, ended by `stop` if any.
pub fn final_text(text: &str, stop: Option<&str>, include_stop: bool) -> String {
    match stop.and_then(|s| text.find(s).map(|at| (at, s.len()))) {
        Some((at, len)) if include_stop => text[..at + len].to_string(),
        Some((at, _)) => text[..at].to_string(),
        None => text.to_string(),
    }
}

/// How much of `text` (a sample still running) is safe to stream: not a trailing
/// replacement character (an incomplete UTF-8 sequence) and not a suffix that begins one of
/// the `stops`.
pub fn streamable_len(text: &str, stops: &[String]) -> usize {
    let trimmed = text.trim_end_matches('\u{FFFD}');
    let mut end = trimmed.len();
    for stop in stops {
        for (at, _) in trimmed.char_indices() {
            if at >= end {
                break;
            }
            if stop.starts_with(&trimmed[at..]) {
                end = at;
                break;
            }
        }
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_cut_or_stay() {
        assert_eq!(final_text("12 + 3 = 15\nUser:", Some("\nUser"), false), "12 + 3 = 15");
        assert_eq!(final_text("12 + 3 = 15\nUser:", Some("\nUser"), true), "12 + 3 = 15\nUser");
        assert_eq!(final_text("abc", None, false), "abc");
    }

    #[test]
    fn streams_hold_back_possible_stops_and_partial_characters() {
        let stops = vec!["</answer>".to_string()];
        assert_eq!(streamable_len("42</ans", &stops), 2);
        assert_eq!(streamable_len("42 and", &stops), 6);
        assert_eq!(streamable_len("x\u{FFFD}", &[]), 1);
    }
}
