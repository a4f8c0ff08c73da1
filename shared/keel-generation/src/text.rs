//! Turning generated token ids into text the way clients expect: stop strings cut the text
//! (or stay in it, by flag), and a stream never shows text that may still turn into a stop
//! string or an incomplete UTF-8 character. [`Detokenizer`] keeps a sample's text up to date
//! by decoding only its last few tokens per new token, not the whole sample.

use keel_model::Tokenizer;

fn decode(tokenizer: &Tokenizer, ids: &[i64]) -> String {
    let ids: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
    tokenizer.decode(&ids, true).unwrap_or_default()
}

/// The text of a growing token sequence (special tokens skipped). Each new token decodes
/// the tokens since the last complete piece of text together with a few before it (so
/// merges and leading spaces come out as in a full decode) and appends what is new once it
/// is whole UTF-8.
#[derive(Debug, Default, Clone)]
pub struct Detokenizer {
    text: String,
    /// Tokens before `prefix` are settled; `prefix..read` decode to the text's tail.
    prefix: usize,
    read: usize,
}

impl Detokenizer {
    /// The text so far (complete characters only).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Updates the text for `tokens` (the previous tokens plus new ones); returns how many
    /// bytes were appended.
    pub fn update(&mut self, tokenizer: &Tokenizer, tokens: &[i64]) -> usize {
        let settled = decode(tokenizer, &tokens[self.prefix..self.read]);
        let current = decode(tokenizer, &tokens[self.prefix..]);
        if current.len() <= settled.len()
            || current.ends_with('\u{FFFD}')
            || !current.is_char_boundary(settled.len())
            || !current.starts_with(&settled)
        {
            return 0;
        }
        let added = current.len() - settled.len();
        self.text.push_str(&current[settled.len()..]);
        self.prefix = self.read;
        self.read = tokens.len();
        added
    }
}

/// The earliest occurrence in `text` of any of `stops`: its byte offset and the stop string
/// (the longest, when several start at the same offset).
pub fn first_stop<'a>(text: &str, stops: &'a [String]) -> Option<(usize, &'a str)> {
    stops
        .iter()
        .filter_map(|s| text.find(s.as_str()).map(|at| (at, s.as_str())))
        .min_by(|a, b| a.0.cmp(&b.0).then(b.1.len().cmp(&a.1.len())))
}

/// The final text of a sample whose decoded output is `text`, ended by the stop string
/// `stop` if any: cut at that string's first occurrence, which it keeps when `include_stop`.
pub fn final_text(text: &str, stop: Option<&str>, include_stop: bool) -> String {
    match stop.and_then(|s| text.find(s).map(|at| (at, s.len()))) {
        Some((at, len)) if include_stop => text[..at + len].to_string(),
        Some((at, _)) => text[..at].to_string(),
        None => text.to_string(),
    }
}

/// How much of `text` (a sample still running) is safe to stream: nothing from the first
/// complete stop string on (the sample is about to end there, whatever token it ended
/// inside), not a trailing replacement character (an incomplete UTF-8 sequence) and not a
/// suffix that begins one of the `stops`.
pub fn streamable_len(text: &str, stops: &[String]) -> usize {
    let trimmed = text.trim_end_matches('\u{FFFD}');
    let mut end = first_stop(trimmed, stops).map_or(trimmed.len(), |(at, _)| at);
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
    fn incremental_text_equals_a_full_decode() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("m");
        keel_model::init::init_model(&keel_model::init::InitSpec {
            architecture: keel_model::Architecture::Qwen3,
            preset: keel_model::init::Preset::Tiny,
            tokenizer_corpus: vec![keel_testkit::workspace_root().join("examples/tokenizer-corpus.txt")],
            out: out.clone(),
            seed: 1,
        })
        .unwrap();
        let tokenizer = Tokenizer::load(&out).unwrap();
        let text = "The answer is 12 + 30 = 42, isn't it? Ünïcödé ok.";
        let ids: Vec<i64> = tokenizer.encode(text, false).unwrap().into_iter().map(i64::from).collect();
        let mut detokenizer = Detokenizer::default();
        for end in 1..=ids.len() {
            detokenizer.update(&tokenizer, &ids[..end]);
            assert!(decode(&tokenizer, &ids[..end]).starts_with(detokenizer.text()));
        }
        assert_eq!(detokenizer.text(), text);
    }

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
        // A stop string that ends inside a token never reaches the stream.
        assert_eq!(streamable_len("42</answer>\nmore", &stops), 2);
        let two = vec!["b".to_string(), "a".to_string()];
        assert_eq!(streamable_len("xab", &two), 1);
        assert_eq!(first_stop("xab", &two), Some((1, "a")));
    }
}
