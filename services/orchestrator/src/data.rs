//! Datasets and the dataloader. A dataset is a JSONL file (keys chosen in the spec) or the
//! built-in arithmetic generator; both become [`Record`]s. The [`Dataloader`] walks the
//! training set in a seeded order per epoch and its whole state is a position
//! ([`Position`]), saved with every checkpoint so a resumed run takes the next prompts, not
//! the same ones again.

use std::path::Path;

use keel_protocol::FieldError;
use keel_protocol::reward::Message;
use keel_protocol::run::{Algorithm, ArithmeticSplit, DataKeys, DatasetSpec};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One example, whatever the algorithm needs of it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Record {
    pub prompt: Option<String>,
    /// The ground truth an environment checks (`metadata.ground_truth`).
    pub answer: Option<String>,
    /// What SFT trains towards (the answer key's text, or the arithmetic solution written
    /// out as `\boxed{…}`).
    pub response: Option<String>,
    pub messages: Option<Vec<Message>>,
    pub chosen: Option<String>,
    pub rejected: Option<String>,
    pub task: Option<String>,
}

/// Loads a dataset, checking that every record has what `algorithm` needs. Errors name
/// `field` (`data.train`) and the line.
pub fn load(spec: &DatasetSpec, algorithm: Algorithm, field: &str) -> Result<Vec<Record>, FieldError> {
    let records = match spec {
        DatasetSpec::Jsonl { path, keys } => read_jsonl(Path::new(path), keys, field)?,
        DatasetSpec::Arithmetic { size, max_operand, operations, seed, split } => {
            let any = problems(i64::from(*max_operand), operations).any(|(a, op, b)| in_split(a, op, b, *split));
            if !any {
                return Err(FieldError::new(
                    format!("{field}.split"),
                    "no problem falls in this split: raise max_operand",
                ));
            }
            arithmetic(*size, *max_operand, operations, *seed, *split)
        }
    };
    if records.is_empty() {
        return Err(FieldError::new(field, "the dataset has no records"));
    }
    for (i, r) in records.iter().enumerate() {
        let missing = match algorithm {
            Algorithm::Grpo | Algorithm::Eval => {
                (r.prompt.is_none() && r.messages.is_none()).then_some("prompt (or messages)")
            }
            Algorithm::Sft => match &r.messages {
                Some(messages) => {
                    (!messages.iter().any(|m| m.role == "assistant")).then_some("an assistant turn in its messages")
                }
                None => (r.prompt.is_none() || r.response.is_none()).then_some("prompt and answer (or messages)"),
            },
            Algorithm::Dpo | Algorithm::Rm => (r.prompt.is_none() || r.chosen.is_none() || r.rejected.is_none())
                .then_some("prompt, chosen and rejected"),
        };
        if let Some(missing) = missing {
            return Err(FieldError::new(field, format!("record {} lacks {missing}", i + 1)));
        }
    }
    Ok(records)
}

/// What a run's validation records must hold, as the algorithm their rows are made for:
/// generation validation (GRPO, eval, SFT with environments) needs prompts only; loss
/// validation (DPO, reward models, SFT without environments) the same rows as training.
pub fn validation_algorithm(spec: &keel_protocol::run::RunSpec) -> Algorithm {
    match spec.algorithm {
        Algorithm::Dpo | Algorithm::Rm => spec.algorithm,
        Algorithm::Sft if spec.environments.is_none() => Algorithm::Sft,
        _ => Algorithm::Eval,
    }
}

/// [`load`] on a blocking thread (files are read and records made off the async workers).
pub async fn load_async(spec: &DatasetSpec, algorithm: Algorithm, field: &str) -> Result<Vec<Record>, FieldError> {
    let (spec, field) = (spec.clone(), field.to_string());
    tokio::task::spawn_blocking(move || load(&spec, algorithm, &field))
        .await
        .map_err(|e| FieldError::new("data", format!("loading stopped: {e}")))?
}

fn read_jsonl(path: &Path, keys: &DataKeys, field: &str) -> Result<Vec<Record>, FieldError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| FieldError::new(format!("{field}.path"), format!("cannot read {}: {e}", path.display())))?;
    let mut records = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = || format!("{field}.path");
        let value: Value = serde_json::from_str(line)
            .map_err(|e| FieldError::new(at(), format!("line {} is not JSON: {e}", n + 1)))?;
        let text_of = |key: &str| -> Result<Option<String>, FieldError> {
            match value.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(Value::Number(x)) => Ok(Some(x.to_string())),
                Some(other) => {
                    Err(FieldError::new(at(), format!("line {}: `{key}` must be a string, got {other}", n + 1)))
                }
            }
        };
        let messages = match value.get(&keys.messages) {
            None | Some(Value::Null) => None,
            Some(list) => Some(serde_json::from_value::<Vec<Message>>(list.clone()).map_err(|e| {
                FieldError::new(at(), format!("line {}: `{}` must be [{{role, content}}]: {e}", n + 1, keys.messages))
            })?),
        };
        let answer = text_of(&keys.answer)?;
        records.push(Record {
            prompt: text_of(&keys.prompt)?,
            response: answer.clone(),
            answer,
            messages,
            chosen: text_of(&keys.chosen)?,
            rejected: text_of(&keys.rejected)?,
            task: text_of(&keys.task)?,
        });
    }
    Ok(records)
}

/// Whether problem (a, op, b) is in the held-out tenth of the problem space.
/// The split problem (a, op, b) falls in: a quarter each `validation` and `test`, half
/// `train`, by the splitmix64 of the problem (a fixed, well-mixed partition).
fn split_of(a: i64, op: char, b: i64) -> ArithmeticSplit {
    let mut z = (a as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (b as u64).rotate_left(29) ^ u64::from(op);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    match (z ^ (z >> 31)) % 4 {
        0 => ArithmeticSplit::Validation,
        1 => ArithmeticSplit::Test,
        _ => ArithmeticSplit::Train,
    }
}

/// Whether problem (a, op, b) is in `split` (`held_out`: validation or test).
fn in_split(a: i64, op: char, b: i64, split: ArithmeticSplit) -> bool {
    match (split, split_of(a, op, b)) {
        (ArithmeticSplit::HeldOut, found) => found != ArithmeticSplit::Train,
        (wanted, found) => wanted == found,
    }
}

/// Every problem of the space: operands 0..=max, each operation.
fn problems(max: i64, operations: &str) -> impl Iterator<Item = (i64, char, i64)> + '_ {
    (0..=max).flat_map(move |a| (0..=max).flat_map(move |b| operations.chars().map(move |op| (a, op, b))))
}

/// `What is A op B?` with its exact answer, from the requested split of the problem space:
/// `size` drawn with replacement, or with `size` 0 every problem of the split once in a
/// seeded order. The response SFT learns is `\boxed{answer}`, and the rejected answer of a
/// preference pair is off by 1 to 3.
pub fn arithmetic(size: usize, max_operand: u32, operations: &str, seed: u64, split: ArithmeticSplit) -> Vec<Record> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let ops: Vec<char> = operations.chars().collect();
    let picked: Vec<(i64, char, i64)> = if size == 0 {
        let mut all: Vec<_> =
            problems(i64::from(max_operand), operations).filter(|&(a, op, b)| in_split(a, op, b, split)).collect();
        all.shuffle(&mut rng);
        all
    } else {
        (0..size)
            .map(|_| {
                loop {
                    let a = i64::from(rng.random_range(0..=max_operand));
                    let b = i64::from(rng.random_range(0..=max_operand));
                    let op = ops[rng.random_range(0..ops.len())];
                    if in_split(a, op, b, split) {
                        break (a, op, b);
                    }
                }
            })
            .collect()
    };
    picked
        .into_iter()
        .map(|(a, op, b)| {
            let value = match op {
                '+' => a + b,
                '-' => a - b,
                _ => a * b,
            };
            let off = rng.random_range(1..=3) * if rng.random_bool(0.5) { 1 } else { -1 };
            let boxed = |v: i64| format!("\\boxed{{{v}}}");
            Record {
                prompt: Some(format!("What is {a} {op} {b}?")),
                answer: Some(value.to_string()),
                response: Some(boxed(value)),
                chosen: Some(boxed(value)),
                rejected: Some(boxed(value + off)),
                ..Record::default()
            }
        })
        .collect()
}

/// Where the dataloader is: the epoch and how many records of it were taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Position {
    pub epoch: u64,
    pub index: usize,
}

/// Seeded epochs over a dataset.
#[derive(Debug)]
pub struct Dataloader {
    len: usize,
    seed: u64,
    shuffle: bool,
    max_epochs: u64,
    position: Position,
    order: Vec<usize>,
}

impl Dataloader {
    pub fn new(len: usize, seed: u64, shuffle: bool, max_epochs: u64, position: Position) -> Self {
        let mut loader = Self { len, seed, shuffle, max_epochs, position, order: Vec::new() };
        loader.order = loader.epoch_order(position.epoch);
        loader
    }

    fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            order.shuffle(&mut ChaCha8Rng::seed_from_u64(self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        }
        order
    }

    pub fn position(&self) -> Position {
        self.position
    }

    /// The next `n` indices, crossing into the next epoch when needed; None when the
    /// epochs are used up before `n` are found (the last partial batch is dropped).
    pub fn next_batch(&mut self, n: usize) -> Option<Vec<usize>> {
        let mut out = Vec::with_capacity(n);
        let mut position = self.position;
        let mut order = None;
        while out.len() < n {
            if position.index == self.len {
                position = Position { epoch: position.epoch + 1, index: 0 };
                order = Some(self.epoch_order(position.epoch));
            }
            if position.epoch >= self.max_epochs {
                return None;
            }
            let current = order.as_ref().unwrap_or(&self.order);
            out.push(current[position.index]);
            position.index += 1;
        }
        self.position = position;
        if let Some(order) = order {
            self.order = order;
        }
        Some(out)
    }

    /// Batches of `n` the remaining epochs hold.
    pub fn batches_left(&self, n: usize) -> u64 {
        let remaining = (self.max_epochs.saturating_sub(self.position.epoch) as usize * self.len)
            .saturating_sub(self.position.index);
        (remaining / n.max(1)) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_loader_continues_where_it_stopped() {
        let mut whole = Dataloader::new(10, 7, true, 3, Position::default());
        let first: Vec<Vec<usize>> = (0..4).map(|_| whole.next_batch(4).unwrap()).collect();
        let mut head = Dataloader::new(10, 7, true, 3, Position::default());
        head.next_batch(4).unwrap();
        head.next_batch(4).unwrap();
        let mut resumed = Dataloader::new(10, 7, true, 3, head.position());
        assert_eq!(resumed.next_batch(4).unwrap(), first[2]);
        assert_eq!(resumed.next_batch(4).unwrap(), first[3]);
    }

    #[test]
    fn every_epoch_visits_every_record_once() {
        let mut loader = Dataloader::new(6, 1, true, 2, Position::default());
        let mut seen: Vec<usize> = (0..3).flat_map(|_| loader.next_batch(4).unwrap()).collect();
        assert_eq!(loader.next_batch(4), None, "two epochs of 6 hold three batches of 4");
        let mut epoch0 = seen.drain(..6).collect::<Vec<_>>();
        epoch0.sort_unstable();
        assert_eq!(epoch0, (0..6).collect::<Vec<_>>());
        assert_ne!(seen[..4], loader.epoch_order(0)[..4], "epoch 1 is shuffled differently");
    }

    /// The splits never share a problem; `size: 0` lists each problem of its split once;
    /// validation and test are each about a quarter of the space.
    #[test]
    fn arithmetic_splits_are_disjoint_and_listed_whole() {
        let prompts = |split| -> Vec<String> {
            arithmetic(0, 20, "+-", 7, split).into_iter().map(|r| r.prompt.unwrap()).collect()
        };
        let (train, validation, test) =
            (prompts(ArithmeticSplit::Train), prompts(ArithmeticSplit::Validation), prompts(ArithmeticSplit::Test));
        let held_out = prompts(ArithmeticSplit::HeldOut);
        assert_eq!(train.len() + validation.len() + test.len(), 21 * 21 * 2, "every problem in one split");
        assert_eq!(held_out.len(), validation.len() + test.len());
        for (name, split) in [("validation", &validation), ("test", &test)] {
            assert!((180..=260).contains(&split.len()), "{name} has {} problems", split.len());
            let distinct: std::collections::HashSet<_> = split.iter().collect();
            assert_eq!(distinct.len(), split.len(), "{name} lists each problem once");
            assert!(split.iter().all(|p| !train.contains(p)), "{name} shares nothing with train");
        }
        assert!(validation.iter().all(|p| !test.contains(p)), "validation and test are disjoint");
        assert_ne!(
            prompts(ArithmeticSplit::Test),
            arithmetic(0, 20, "+-", 8, ArithmeticSplit::Test)
                .into_iter()
                .map(|r| r.prompt.unwrap())
                .collect::<Vec<_>>(),
            "the order follows the seed"
        );
    }

    #[test]
    fn arithmetic_answers_are_right() {
        let train = arithmetic(300, 30, "+-*", 3, ArithmeticSplit::Train);
        let held_out = arithmetic(100, 30, "+-*", 3, ArithmeticSplit::HeldOut);
        let prompts: std::collections::HashSet<_> = train.iter().map(|r| r.prompt.clone()).collect();
        assert!(held_out.iter().all(|r| !prompts.contains(&r.prompt)), "held-out problems never appear in train");
        for r in train.into_iter().chain(held_out) {
            let prompt = r.prompt.unwrap();
            let parts: Vec<&str> = prompt.trim_start_matches("What is ").trim_end_matches('?').split(' ').collect();
            let (a, b): (i64, i64) = (parts[0].parse().unwrap(), parts[2].parse().unwrap());
            let want = match parts[1] {
                "+" => a + b,
                "-" => a - b,
                _ => a * b,
            };
            assert_eq!(r.answer.unwrap(), want.to_string());
            assert_ne!(r.chosen, r.rejected);
        }
    }
}
