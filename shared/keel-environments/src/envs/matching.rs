//! Simple single-turn scorers: `exact_match` (the response or its captured answer equals
//! `metadata.ground_truth`), `regex` (the response matches a pattern) and `multiple_choice`
//! (the answer letter equals `metadata.ground_truth`). Each ends the episode with reward 1
//! or 0.

use keel_protocol::FieldError;
use keel_protocol::reward::{EnvSample, ExactMatchConfig, MultipleChoiceConfig, RegexConfig, SampleError};
use regex::Regex;

use crate::envs::{Outcome, SampleEnv, compile_pattern, last_capture, last_turn, metadata_text};

fn verdict(sample: &EnvSample, correct: bool, answer: Option<String>) -> Outcome {
    let mut result = keel_protocol::reward::EnvStepResult::done(f64::from(u8::from(correct)), sample.metadata.clone());
    result.answer = answer;
    Ok(result)
}

#[derive(Debug)]
pub struct ExactMatch {
    config: ExactMatchConfig,
    pattern: Option<Regex>,
}

impl ExactMatch {
    pub fn new(config: &ExactMatchConfig) -> Result<Self, FieldError> {
        let pattern =
            config.answer_pattern.as_deref().map(|p| compile_pattern("answer_pattern", p, true)).transpose()?;
        Ok(Self { config: config.clone(), pattern })
    }

    fn normalise(&self, text: &str) -> String {
        let text = if self.config.normalize_whitespace {
            text.split_whitespace().collect::<Vec<_>>().join(" ")
        } else {
            text.to_string()
        };
        if self.config.case_sensitive { text } else { text.to_lowercase() }
    }
}

impl SampleEnv for ExactMatch {
    fn step_one(&self, sample: &EnvSample) -> Outcome {
        let response = last_turn(sample)?;
        let truth = metadata_text(&sample.metadata, "ground_truth")?;
        let answer = match &self.pattern {
            Some(pattern) => last_capture(pattern, response),
            None => Some(response.to_string()),
        };
        let correct = answer.as_deref().is_some_and(|a| self.normalise(a) == self.normalise(&truth));
        verdict(sample, correct, answer)
    }
}

#[derive(Debug)]
pub struct RegexEnv {
    pattern: Option<Regex>,
    full_match: bool,
}

impl RegexEnv {
    pub fn new(config: &RegexConfig) -> Result<Self, FieldError> {
        let pattern = config
            .pattern
            .as_deref()
            .map(|p| compile_pattern("pattern", &anchor(p, config.full_match), false))
            .transpose()?;
        Ok(Self { pattern, full_match: config.full_match })
    }
}

fn anchor(pattern: &str, full: bool) -> String {
    if full { format!(r"\A(?:{pattern})\z") } else { pattern.to_string() }
}

impl SampleEnv for RegexEnv {
    fn step_one(&self, sample: &EnvSample) -> Outcome {
        let response = last_turn(sample)?;
        let own;
        let pattern = match sample.metadata.get("pattern") {
            Some(_) => {
                let text = metadata_text(&sample.metadata, "pattern")?;
                own = compile_pattern("pattern", &anchor(&text, self.full_match), false)
                    .map_err(|e| SampleError::new("invalid_sample", format!("metadata.{e}")))?;
                &own
            }
            None => self
                .pattern
                .as_ref()
                .ok_or_else(|| SampleError::new("invalid_sample", "no pattern: set env.pattern or metadata.pattern"))?,
        };
        let found = pattern.find(response).map(|m| m.as_str().to_string());
        verdict(sample, found.is_some(), found)
    }
}

#[derive(Debug)]
pub struct MultipleChoice {
    choices: Vec<char>,
    patterns: Vec<Regex>,
}

impl MultipleChoice {
    pub fn new(config: &MultipleChoiceConfig) -> Result<Self, FieldError> {
        let choices: Vec<char> = config.choices.chars().collect();
        if choices.is_empty() || !choices.iter().all(char::is_ascii_uppercase) {
            return Err(FieldError::new("choices", "must be upper-case letters, e.g. ABCD"));
        }
        let set: String = choices.iter().collect();
        // Most explicit first: a boxed letter, `Answer: X`, `(X)`, then a letter standing alone.
        let patterns = [
            format!(r"\\boxed\{{\s*(?:\\text\{{)?\(?([{set}])\)?"),
            format!(r"(?i:answer)\s*(?:is)?\s*[:：]?\s*\**\(?([{set}])\b"),
            format!(r"\(([{set}])\)"),
            format!(r"\b([{set}])\b"),
        ];
        let patterns = patterns.iter().map(|p| compile_pattern("choices", p, true)).collect::<Result<_, _>>()?;
        Ok(Self { choices, patterns })
    }

    fn extract(&self, response: &str) -> Option<String> {
        self.patterns.iter().find_map(|p| last_capture(p, response))
    }
}

impl SampleEnv for MultipleChoice {
    fn step_one(&self, sample: &EnvSample) -> Outcome {
        let response = last_turn(sample)?;
        let truth = metadata_text(&sample.metadata, "ground_truth")?;
        let truth = truth.trim().trim_matches(|c| c == '(' || c == ')').to_uppercase();
        if !(truth.len() == 1 && truth.chars().all(|c| self.choices.contains(&c))) {
            return Err(SampleError::new(
                "invalid_sample",
                format!("metadata.ground_truth `{truth}` is not one of the choices"),
            ));
        }
        let answer = self.extract(response);
        verdict(sample, answer.as_deref() == Some(truth.as_str()), answer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_protocol::reward::Message;
    use serde_json::json;

    fn sample(response: &str, metadata: serde_json::Value) -> EnvSample {
        EnvSample {
            messages: vec![Message::new("user", "q"), Message::new("assistant", response)],
            metadata,
            token_ids: None,
            agent: None,
        }
    }

    fn reward(env: &dyn SampleEnv, response: &str, metadata: serde_json::Value) -> f64 {
        env.step_one(&sample(response, metadata)).unwrap().reward
    }

    #[test]
    fn exact_match_normalises_and_extracts() {
        let env = ExactMatch::new(&ExactMatchConfig::default()).unwrap();
        assert_eq!(reward(&env, "  Paris\n", json!({"ground_truth": "paris"})), 1.0);
        assert_eq!(reward(&env, "Paris, France", json!({"ground_truth": "paris"})), 0.0);
        assert_eq!(reward(&env, "42", json!({"ground_truth": 42})), 1.0);
        let strict = ExactMatch::new(&ExactMatchConfig {
            case_sensitive: true,
            answer_pattern: Some(r"Answer:\s*(\S+)".into()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(reward(&strict, "Answer: no. Answer: Paris", json!({"ground_truth": "Paris"})), 1.0);
        assert_eq!(reward(&strict, "Answer: paris", json!({"ground_truth": "Paris"})), 0.0);
        assert_eq!(reward(&strict, "I think Paris", json!({"ground_truth": "Paris"})), 0.0);
        let err = env.step_one(&sample("x", json!({}))).unwrap_err();
        assert!(err.message.contains("metadata.ground_truth"), "{err}");
        let err = ExactMatch::new(&ExactMatchConfig { answer_pattern: Some("no group".into()), ..Default::default() })
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("answer_pattern:"), "{err}");
    }

    #[test]
    fn regex_from_config_or_metadata() {
        let env = RegexEnv::new(&RegexConfig { pattern: Some(r"\d{3}-\d{4}".into()), full_match: false }).unwrap();
        assert_eq!(reward(&env, "call 555-1234 now", json!({})), 1.0);
        assert_eq!(reward(&env, "call me", json!({})), 0.0);
        assert_eq!(reward(&env, "yes", json!({"pattern": "^(yes|no)$"})), 1.0);
        let full = RegexEnv::new(&RegexConfig { pattern: Some(r"[a-z]+".into()), full_match: true }).unwrap();
        assert_eq!(reward(&full, "abc", json!({})), 1.0);
        assert_eq!(reward(&full, "abc1", json!({})), 0.0);
        let none = RegexEnv::new(&RegexConfig::default()).unwrap();
        assert!(none.step_one(&sample("x", json!({}))).unwrap_err().message.contains("metadata.pattern"));
        assert!(none.step_one(&sample("x", json!({"pattern": "("}))).unwrap_err().message.contains("metadata.pattern"));
        assert!(
            RegexEnv::new(&RegexConfig { pattern: Some("(".into()), full_match: false })
                .unwrap_err()
                .to_string()
                .starts_with("pattern:")
        );
    }

    #[test]
    fn multiple_choice_finds_the_letter() {
        let env = MultipleChoice::new(&MultipleChoiceConfig::default()).unwrap();
        let truth = json!({"ground_truth": "B"});
        for response in ["The answer is B.", "Answer: (B)", r"so \boxed{B}", "I pick (B) over (A)... Answer: B", "B"] {
            assert_eq!(reward(&env, response, truth.clone()), 1.0, "{response}");
        }
        for response in ["The answer is C.", r"\boxed{A}", "I am not sure", "Answer: E"] {
            assert_eq!(reward(&env, response, truth.clone()), 0.0, "{response}");
        }
        assert!(env.step_one(&sample("A", json!({"ground_truth": "Z"}))).is_err());
        assert!(
            MultipleChoice::new(&MultipleChoiceConfig { choices: "ab".into() })
                .unwrap_err()
                .to_string()
                .starts_with("choices:")
        );
    }
}
