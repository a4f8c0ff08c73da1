//! `code`: the model's Python program run against the task's tests in the [`Sandbox`].
//!
//! The program is the last fenced code block of the model's turn (```` ```python ````,
//! ```` ```py ```` or untagged), else the whole turn. `metadata.tests` lists the tests, each
//! run as its own sandboxed process so that no test (or the program) can forge another's
//! result:
//! - `{"stdin": "...", "stdout": "..."}`: the program reads the input; it passes when it exits
//!   0 and its output equals the expected one (trailing spaces of lines and trailing blank
//!   lines ignored);
//! - `{"assert": "assert add(1, 2) == 3"}`: the statement runs in a script that imports the
//!   program as the module `solution` (so its `if __name__ == "__main__"` part does not run)
//!   and then prints a random token it read from its input; it passes when the process exits
//!   0 and the token is the last line of its output, so a program that exits early with
//!   status 0 (`sys.exit(0)` at import) fails. The token is a local of the harness's function,
//!   so `import __main__` finds nothing. (A program that digs it out of the interpreter's
//!   frames could still forge a pass; every assert test is its own process, so it could not
//!   forge another test's.)
//!
//! Reward: the fraction of tests passed, or 1/0 with `all_or_nothing`. With `feedback` the
//! test report comes back as an observation and the episode goes on until every test passes
//! or `max_attempts` is reached (attempts are counted in `metadata.attempts`).

use keel_protocol::FieldError;
use std::sync::Arc;
use std::time::Duration;

use futures::future::{BoxFuture, join_all};
use keel_protocol::reward::{CodeConfig, EnvSample, EnvStepResult, Message, SampleError};
use serde::Serialize;
use serde_json::{Value, json};

use crate::envs::{Environment, Outcome, last_turn};
use crate::sandbox::{Limits, RunReport, Sandbox, Termination};

/// The largest program accepted.
const MAX_PROGRAM_BYTES: usize = 256 * 1024;

/// Most tests one sample may carry: each is a sandboxed process of its own, so the count
/// bounds the sandbox time one sample can ask for (with the wall-time limit of each).
pub const MAX_TESTS_PER_SAMPLE: usize = 256;

#[derive(Debug, Clone, PartialEq)]
pub enum Test {
    Io { stdin: String, stdout: String },
    Assert(String),
}

/// The script an assert test runs: the token from stdin, the program, the statement, the token.
/// The token is a local of the harness's function, not a global: `import __main__` from the
/// program finds nothing. The program and the statement run in a namespace of their own.
fn assert_harness(statement: &str) -> String {
    let body = serde_json::to_string(&format!("from solution import *\n\n{statement}\n")).unwrap_or_default();
    format!(
        "def _keel():\n    import sys\n    token = sys.stdin.readline().strip()\n    sys.path.insert(0, '/code')\n    \
         scope = {{'__name__': '__keel_test__'}}\n    exec(compile({body}, '<test>', 'exec'), scope)\n    \
         print(token, flush=True)\n\n\n_keel()\n"
    )
}

/// The tests of a sample; the error names the bad entry.
pub fn parse_tests(metadata: &Value) -> Result<Vec<Test>, SampleError> {
    let bad = |m: String| SampleError::new("invalid_sample", m);
    let tests = metadata
        .get("tests")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("metadata.tests: a list of tests is required".into()))?;
    if tests.is_empty() {
        return Err(bad("metadata.tests: is empty".into()));
    }
    if tests.len() > MAX_TESTS_PER_SAMPLE {
        return Err(bad(format!("metadata.tests: {} tests; at most {MAX_TESTS_PER_SAMPLE} are run", tests.len())));
    }
    tests
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let text = |key: &str| t.get(key).map(|v| v.as_str().map(str::to_string));
            match (text("assert"), text("stdin"), text("stdout")) {
                (Some(Some(a)), None, None) => Ok(Test::Assert(a)),
                (None, stdin, Some(Some(stdout))) => match stdin {
                    None => Ok(Test::Io { stdin: String::new(), stdout }),
                    Some(Some(stdin)) => Ok(Test::Io { stdin, stdout }),
                    Some(None) => Err(bad(format!("metadata.tests[{i}].stdin: must be a string"))),
                },
                _ => Err(bad(format!(
                    "metadata.tests[{i}]: expected {{\"stdin\", \"stdout\"}} or {{\"assert\"}} with strings"
                ))),
            }
        })
        .collect()
}

/// The program in a model's turn.
pub fn extract_program(response: &str) -> String {
    let mut blocks = Vec::new();
    let mut rest = response;
    while let Some(start) = rest.find("```") {
        let after = &rest[start + 3..];
        let Some(line_end) = after.find('\n') else { break };
        let tag = after[..line_end].trim().to_lowercase();
        let body = &after[line_end + 1..];
        let Some(end) = body.find("```") else { break };
        if matches!(tag.as_str(), "" | "python" | "py" | "python3") {
            blocks.push(&body[..end]);
        }
        rest = &body[end + 3..];
    }
    blocks.last().map_or_else(|| response.to_string(), |b| b.to_string())
}

fn same_output(got: &str, expected: &str) -> bool {
    let lines = |s: &str| {
        let mut lines: Vec<String> = s.lines().map(|l| l.trim_end().to_string()).collect();
        while lines.last().is_some_and(String::is_empty) {
            lines.pop();
        }
        lines
    };
    lines(got) == lines(expected)
}

#[derive(Debug, Clone, Serialize)]
pub struct TestOutcome {
    pub passed: bool,
    /// `passed`, `wrong_answer`, `runtime_error`, `memory_limit`, `cpu_limit`, `timeout` or
    /// `not_run` (the request had used its sandbox seconds).
    pub status: &'static str,
    pub termination: Termination,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub stdout: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub stderr: String,
}

/// The sandbox seconds one request may still use (`ceilings.request_seconds`), shared by its
/// samples' tests: each test reserves its wall-clock limit before it starts and gives back
/// what it did not use, so the request's programs can never hold more than that between them.
#[derive(Debug)]
pub struct Budget {
    left_ms: std::sync::Mutex<i64>,
    seconds: f64,
}

impl Budget {
    pub fn new(seconds: f64) -> Self {
        Self { left_ms: std::sync::Mutex::new((seconds * 1000.0) as i64), seconds }
    }

    /// Takes `wall` from what is left, if that much is.
    fn reserve(&self, wall: Duration) -> bool {
        let mut left = self.left_ms.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let want = wall.as_millis() as i64;
        if *left < want {
            return false;
        }
        *left -= want;
        true
    }

    /// Gives back what a test reserved and did not use.
    fn refund(&self, wall: Duration, used_seconds: f64) {
        let unused = wall.as_millis() as i64 - (used_seconds * 1000.0).ceil() as i64;
        *self.left_ms.lock().unwrap_or_else(std::sync::PoisonError::into_inner) += unused.max(0);
    }

    /// A test the request could not afford.
    fn not_run(&self) -> TestOutcome {
        TestOutcome {
            passed: false,
            status: "not_run",
            termination: Termination::NotRun,
            stdout: String::new(),
            stderr: format!(
                "not run: the request used its {} sandbox seconds (sandbox.ceilings.request_seconds)",
                self.seconds
            ),
        }
    }
}

/// `token`: what an assert test's harness prints last when the statement held.
fn judge(test: &Test, report: RunReport, token: &str) -> TestOutcome {
    let status = match report.termination {
        Termination::TimedOut => "timeout",
        Termination::Signaled(9 | 24) => "cpu_limit",
        Termination::Exited(0) => match test {
            Test::Io { stdout, .. } if !same_output(&report.stdout, stdout) => "wrong_answer",
            Test::Assert(_) if report.stdout.lines().rev().find(|l| !l.trim().is_empty()) != Some(token) => {
                "runtime_error"
            }
            _ => "passed",
        },
        _ if report.stderr.contains("MemoryError") => "memory_limit",
        _ => "runtime_error",
    };
    let tail = |s: &str| {
        let start = s.char_indices().rev().nth(1999).map_or(0, |(i, _)| i);
        s[start..].to_string()
    };
    TestOutcome {
        passed: status == "passed",
        status,
        termination: report.termination,
        stdout: tail(&report.stdout),
        stderr: tail(&report.stderr),
    }
}

#[derive(Debug)]
pub struct CodeEnv {
    config: CodeConfig,
    limits: Limits,
    sandbox: Arc<Sandbox>,
}

impl CodeEnv {
    pub fn new(config: &CodeConfig, sandbox: Arc<Sandbox>) -> Result<Self, FieldError> {
        let most = &sandbox.config().ceilings;
        let bounded = [
            ("cpu_seconds", config.cpu_seconds, most.cpu_seconds),
            ("memory_mb", config.memory_mb, most.memory_mb),
            ("max_processes", config.max_processes, most.processes),
            ("max_file_mb", config.max_file_mb, most.file_mb),
            ("max_output_bytes", config.max_output_bytes as u64, most.output_bytes as u64),
            ("max_attempts", u64::from(config.max_attempts), u64::from(u32::MAX)),
        ];
        if let Some((field, _, most)) = bounded.iter().find(|(_, v, most)| *v == 0 || v > most) {
            return Err(FieldError::new(*field, format!("must be 1 to {most} (this service's ceiling)")));
        }
        if !(config.wall_seconds > 0.0 && config.wall_seconds <= most.wall_seconds) {
            return Err(FieldError::new(
                "wall_seconds",
                format!("must be more than 0 and at most {} (this service's ceiling)", most.wall_seconds),
            ));
        }
        let limits = Limits {
            cpu_seconds: config.cpu_seconds,
            wall: Duration::from_secs_f64(config.wall_seconds),
            memory_bytes: config.memory_mb.saturating_mul(1 << 20),
            processes: config.max_processes,
            file_bytes: config.max_file_mb.saturating_mul(1 << 20),
            output_bytes: config.max_output_bytes,
        };
        Ok(Self { config: config.clone(), limits, sandbox })
    }

    /// Runs every test of one sample, within what is left of the request's `budget`.
    pub async fn run_tests(
        &self,
        program: &str,
        tests: &[Test],
        budget: &Budget,
    ) -> Result<Vec<TestOutcome>, SampleError> {
        let runs = tests.iter().map(|test| async move {
            if !budget.reserve(self.limits.wall) {
                return Ok(budget.not_run());
            }
            let token = format!("keel-pass-{:032x}", rand::random::<u128>());
            let report = match test {
                Test::Io { stdin, .. } => {
                    self.sandbox
                        .run_python(&[("solution.py", program)], "solution.py", stdin.as_bytes(), &self.limits)
                        .await
                }
                Test::Assert(statement) => {
                    let main = assert_harness(statement);
                    let files = [("solution.py", program), ("test_main.py", main.as_str())];
                    let input = format!("{token}\n");
                    self.sandbox.run_python(&files, "test_main.py", input.as_bytes(), &self.limits).await
                }
            };
            budget.refund(self.limits.wall, report.as_ref().map_or(0.0, |r| r.wall_seconds));
            report.map(|r| judge(test, r, &token)).map_err(|e| SampleError::new("sandbox", e.to_string()))
        });
        join_all(runs).await.into_iter().collect()
    }

    async fn step_one(&self, sample: &EnvSample, budget: &Budget) -> Outcome {
        let response = last_turn(sample)?;
        let tests = parse_tests(&sample.metadata)?;
        let program = extract_program(response);
        let outcomes = if program.len() > MAX_PROGRAM_BYTES {
            None
        } else {
            Some(self.run_tests(&program, &tests, budget).await?)
        };
        let passed = outcomes.as_ref().map_or(0, |o| o.iter().filter(|t| t.passed).count());
        let total = tests.len();
        let fraction = passed as f64 / total as f64;
        let reward = if self.config.all_or_nothing { f64::from(u8::from(passed == total)) } else { fraction };
        let attempts = sample.metadata.get("attempts").and_then(Value::as_u64).unwrap_or(0) + 1;
        let mut metadata = match &sample.metadata {
            Value::Object(map) => map.clone(),
            _ => serde_json::Map::new(),
        };
        metadata.insert("attempts".into(), json!(attempts));
        let mut result = EnvStepResult::done(reward, Value::Object(metadata));
        result.info =
            json!({"passed": passed, "total": total, "tests": outcomes, "program_too_long": outcomes.is_none()});
        if self.config.feedback {
            result.terminated = passed == total || attempts >= u64::from(self.config.max_attempts);
            if !result.terminated {
                result.observation = Some(Message::new("user", report(&tests, outcomes.as_deref())));
            }
        }
        Ok(result)
    }
}

/// The test report a model reads in feedback mode.
fn report(tests: &[Test], outcomes: Option<&[TestOutcome]>) -> String {
    let Some(outcomes) = outcomes else {
        return format!("The program is longer than {MAX_PROGRAM_BYTES} bytes and was not run.");
    };
    let passed = outcomes.iter().filter(|o| o.passed).count();
    let mut text = format!("{passed} of {} tests passed.", tests.len());
    if let Some((test, outcome)) = tests.iter().zip(outcomes).find(|(_, o)| !o.passed) {
        match test {
            Test::Io { stdin, stdout } => {
                text.push_str(&format!("\nFailed ({}) on input:\n{stdin}\nExpected:\n{stdout}", outcome.status));
                text.push_str(&format!("\nGot:\n{}", outcome.stdout));
            }
            Test::Assert(statement) => text.push_str(&format!("\nFailed ({}): {statement}", outcome.status)),
        }
        if !outcome.stderr.is_empty() {
            text.push_str(&format!("\nstderr:\n{}", outcome.stderr));
        }
    }
    text
}

impl Environment for CodeEnv {
    fn step<'a>(&'a self, samples: &'a [EnvSample]) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let budget = Budget::new(self.sandbox.config().ceilings.request_seconds);
            join_all(samples.iter().map(|s| self.step_one(s, &budget))).await
        })
    }

    fn metrics(&self, results: &[EnvStepResult]) -> std::collections::BTreeMap<String, f64> {
        let statuses: Vec<&str> = results
            .iter()
            .filter_map(|r| r.info.get("tests").and_then(Value::as_array))
            .flatten()
            .filter_map(|t| t.get("status").and_then(Value::as_str))
            .collect();
        let mut metrics = std::collections::BTreeMap::new();
        if !statuses.is_empty() {
            let share = |s: &str| statuses.iter().filter(|x| **x == s).count() as f64 / statuses.len() as f64;
            for status in ["passed", "timeout", "runtime_error", "memory_limit"] {
                metrics.insert(format!("code/{status}_rate"), share(status));
            }
        }
        metrics
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sample may carry at most `MAX_TESTS_PER_SAMPLE` tests; more are refused naming the
    /// field, before any is run.
    #[test]
    fn a_sample_carries_a_bounded_number_of_tests() {
        let tests = |n: usize| serde_json::json!({"tests": vec![serde_json::json!({"assert": "assert True"}); n]});
        assert_eq!(parse_tests(&tests(MAX_TESTS_PER_SAMPLE)).unwrap().len(), MAX_TESTS_PER_SAMPLE);
        let refused = parse_tests(&tests(MAX_TESTS_PER_SAMPLE + 1)).unwrap_err();
        assert!(refused.message.contains("metadata.tests") && refused.message.contains("at most"), "{refused:?}");
    }

    #[test]
    fn programs_come_from_the_last_python_block() {
        let response = "First:\n```python\nprint(1)\n```\nthen\n```text\nnot code\n```\nfinal:\n```py\nprint(2)\n```\n";
        assert_eq!(extract_program(response), "print(2)\n");
        assert_eq!(extract_program("print(3)"), "print(3)");
        assert_eq!(extract_program("```\nx = 1\n```"), "x = 1\n");
        assert_eq!(extract_program("```python\nunterminated"), "```python\nunterminated");
    }

    #[test]
    fn tests_are_validated_with_their_index() {
        let ok = parse_tests(
            &json!({"tests": [{"stdin": "1\n", "stdout": "2"}, {"assert": "assert f()"}, {"stdout": "x"}]}),
        );
        assert_eq!(ok.unwrap().len(), 3);
        for (metadata, needle) in [
            (json!({}), "metadata.tests"),
            (json!({"tests": []}), "is empty"),
            (json!({"tests": [{"assert": "assert 1"}, {"stdin": "1"}]}), "metadata.tests[1]"),
            (json!({"tests": [{"stdin": 1, "stdout": "x"}]}), "metadata.tests[0].stdin"),
        ] {
            assert!(parse_tests(&metadata).unwrap_err().message.contains(needle), "{metadata}");
        }
    }

    #[test]
    fn output_comparison_ignores_trailing_space() {
        assert!(same_output("1 2 \n3\n\n", "1 2\n3"));
        assert!(!same_output("1 2\n3", "1 2\n4"));
        assert!(!same_output(" 1", "1"));
    }
}
