//! Tests of the `math` answer verifier: an equivalence table, a seeded fuzz run, and unit tests of
//! extraction and configuration.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use keel_environments::math::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `(category, response, ground truth, expected correct)`.
const TABLE: &[(&str, &str, &str, bool)] = &[
    // fractions
    ("fractions", r"\boxed{\frac{1}{2}}", "0.5", true),
    ("fractions", r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", true),
    ("fractions", r"\boxed{\tfrac{2}{6}}", r"\frac13", true),
    ("fractions", r"\boxed{\frac12}", "1/2", true),
    ("fractions", r"\boxed{6/8}", r"\frac{3}{4}", true),
    ("fractions", r"\boxed{3\frac{1}{2}}", r"\frac{7}{2}", true),
    ("fractions", r"\boxed{2\frac{1}{4}}", "2.25", true),
    ("fractions", r"\boxed{\frac{10}{4}}", r"\frac{5}{2}", true),
    ("fractions", r"\boxed{\cfrac{1}{1+\frac{1}{2}}}", r"\frac{2}{3}", true),
    ("fractions", r"\boxed{\frac{1}{3}}", "0.5", false),
    ("fractions", r"\boxed{\frac{2}{3}}", r"\frac{3}{2}", false),
    ("fractions", r"\boxed{3\frac{1}{2}}", r"\frac{3}{2}", false),
    ("fractions", r"\boxed{\frac12}", "12", false),
    ("fractions", r"\boxed{1/3}", "0.33", false),
    ("fractions", r"\boxed{\frac{1}{2}}", r"\frac{1}{4}", false),
    // decimals and trailing zeros
    ("decimals", r"\boxed{2.50}", "2.5", true),
    ("decimals", r"\boxed{3.0}", "3", true),
    ("decimals", r"\boxed{0.125}", r"\frac{1}{8}", true),
    ("decimals", r"\boxed{.5}", "0.5", true),
    ("decimals", r"\boxed{0.33333}", r"\frac{1}{3}", true),
    ("decimals", r"\boxed{1.5e3}", "1500", true),
    ("decimals", r"\boxed{2.51}", "2.5", false),
    ("decimals", r"\boxed{0.3}", r"\frac{1}{3}", false),
    ("decimals", r"\boxed{3.01}", "3", false),
    ("decimals", r"\boxed{0.12}", "0.125", false),
    // percents: 50% equals both 50 and 0.5
    ("percent", r"\boxed{50\%}", "50", true),
    ("percent", r"\boxed{50\%}", "0.5", true),
    ("percent", r"\boxed{50}", r"50\%", true),
    ("percent", r"\boxed{12.5\%}", r"\frac{1}{8}", true),
    ("percent", r"\boxed{25%}", r"25\%", true),
    ("percent", r"\boxed{5 percent}", "5", true),
    ("percent", r"\boxed{50\%}", "5", false),
    ("percent", r"\boxed{40\%}", "0.5", false),
    ("percent", r"\boxed{0.5\%}", "50", false),
    // LaTeX forms
    ("latex", r"$\boxed{\left(\frac{1}{2}\right)}$", r"\frac12", true),
    ("latex", r"\boxed{\displaystyle \frac{3}{5}}", "0.6", true),
    ("latex", r"\boxed{1\!000}", "1000", true),
    ("latex", r"\boxed{\text{5}}", "5", true),
    ("latex", r"\boxed{$7$}", "7", true),
    ("latex", r"\boxed{\,42\;}", "42", true),
    ("latex", r"\boxed{\mathrm{e}^{2}}", "e^2", true),
    ("latex", r"\boxed{\left[ 1, 2 \right]}", "[1,2]", true),
    ("latex", r"\boxed{2\ \cdot\ 3}", "6", true),
    ("latex", r"\boxed{2\mathrm{e}}", "2e", true),
    ("latex", r"\boxed{\left(\frac{1}{2}\right)^2}", r"\frac12", false),
    ("latex", r"\boxed{\displaystyle \frac{3}{5}}", r"\frac{5}{3}", false),
    ("latex", r"\boxed{\text{7}}", "1", false),
    ("latex", r"\boxed{\mathrm{e}}", "2.71", false),
    // units
    ("units", r"\boxed{5 \text{ cm}}", "5", true),
    ("units", r"\boxed{12 meters}", "12", true),
    ("units", r"\boxed{\$3.50}", "3.5", true),
    ("units", r"\boxed{30^\circ}", "30", true),
    ("units", r"\boxed{45^{\circ}}", "45", true),
    ("units", r"\boxed{90\degree}", "90", true),
    ("units", r"\boxed{10\mbox{ inches}}", "10", true),
    ("units", r"\boxed{20\text{dollars}}", r"\$20", true),
    ("units", r"\boxed{16 \text{ cm}^2}", "16", true),
    ("units", r"\boxed{5cm}", "5", true),
    ("units", r"\boxed{8 square feet}", "8", true),
    ("units", "\\boxed{60\u{b0}}", "60", true),
    ("units", r"\boxed{5 \text{ cm}}", "6", false),
    ("units", r"\boxed{30^\circ}", "60", false),
    ("units", r"\boxed{\$3.50}", "350", false),
    ("units", r"\boxed{12 meters}", "1.2", false),
    // boxes: nesting, several boxes, \fbox, space form
    ("boxes", r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", true),
    ("boxes", r"First \boxed{1}, then finally \boxed{2}.", "2", true),
    ("boxes", r"\boxed{\boxed{5}}", "5", true),
    ("boxes", r"\fbox{7}", "7", true),
    ("boxes", r"so it is $\boxed 9$.", "9", true),
    ("boxes", r"\boxed{\{1,2\}}", r"\{2,1\}", true),
    ("boxes", r"\boxed{4}", r"\boxed{4}", true),
    ("boxes", r"First \boxed{1}, then finally \boxed{2}.", "1", false),
    ("boxes", r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt2}{2}", false),
    ("boxes", r"\fbox{7}", "8", false),
    ("boxes", r"\boxed{4}", r"\boxed{5}", false),
    // negatives
    ("negatives", r"\boxed{-5}", "-5", true),
    ("negatives", "\\boxed{\u{2212}5}", "-5", true),
    ("negatives", r"\boxed{\dfrac{-1}{2}}", "-0.5", true),
    ("negatives", r"\boxed{-\frac12}", r"\frac{-1}{2}", true),
    ("negatives", "\\boxed{\u{2212}\\frac{3}{4}}", "-0.75", true),
    ("negatives", r"\boxed{\frac{1}{-2}}", r"-\frac{1}{2}", true),
    ("negatives", r"\boxed{-5}", "5", false),
    ("negatives", "\\boxed{\u{2212}0.5}", "0.5", false),
    ("negatives", r"\boxed{--3}", "-3", false),
    ("negatives", r"\boxed{-\frac{1}{2}}", r"\frac12", false),
    // sqrt and pi
    ("sqrt-pi", r"\boxed{2\sqrt{2}}", r"\sqrt{8}", true),
    ("sqrt-pi", r"\boxed{\sqrt2}", r"\sqrt{2}", true),
    ("sqrt-pi", r"\boxed{\sqrt[3]{27}}", "3", true),
    ("sqrt-pi", r"\boxed{2\pi}", r"2 \pi", true),
    ("sqrt-pi", r"\boxed{2*pi}", r"2\pi", true),
    ("sqrt-pi", r"\boxed{6.28319}", r"2\pi", true),
    ("sqrt-pi", r"\boxed{\frac{\pi}{2}}", r"\pi/2", true),
    ("sqrt-pi", r"\boxed{3\sqrt{2}}", r"\sqrt{18}", true),
    ("sqrt-pi", r"\boxed{\sqrt{12}}", r"2\sqrt3", true),
    ("sqrt-pi", r"\boxed{\sqrt{\frac{1}{4}}}", "0.5", true),
    ("sqrt-pi", "\\boxed{\u{3c0}}", r"\pi", true),
    ("sqrt-pi", r"\boxed{1.41421}", r"\sqrt{2}", true),
    ("sqrt-pi", r"\boxed{2\sqrt{3}}", r"\sqrt{8}", false),
    ("sqrt-pi", r"\boxed{3.14}", r"\pi", false),
    ("sqrt-pi", r"\boxed{\sqrt[3]{27}}", "9", false),
    ("sqrt-pi", r"\boxed{\pi}", r"2\pi", false),
    ("sqrt-pi", r"\boxed{\sqrt{2}}", "2", false),
    ("sqrt-pi", r"\boxed{e}", r"\pi", false),
    // symbolic expressions
    ("symbolic", r"\boxed{2x+2}", "2(x+1)", true),
    ("symbolic", r"\boxed{x^2-1}", "(x-1)(x+1)", true),
    ("symbolic", r"\boxed{\frac{a}{2}}", "0.5a", true),
    ("symbolic", r"\boxed{(x+1)^2}", "x^2+2x+1", true),
    ("symbolic", r"\boxed{3+4i}", "4i+3", true),
    ("symbolic", r"\boxed{\frac{x^2-1}{x-1}}", "x+1", true),
    ("symbolic", r"\boxed{2x \cdot 3y}", "6xy", true),
    ("symbolic", r"\boxed{\sin^2 x + \cos^2 x}", "1", true),
    ("symbolic", r"\boxed{e^{\ln 2}}", "2", true),
    ("symbolic", r"\boxed{\sqrt{x}}", "x^{1/2}", true),
    ("symbolic", r"\boxed{\log_2 8}", "3", true),
    ("symbolic", r"\boxed{5!}", "120", true),
    ("symbolic", r"\boxed{\binom{5}{2}}", "10", true),
    ("symbolic", r"\boxed{|x|}", r"\sqrt{x^2}", true),
    ("symbolic", r"\boxed{2x+1}", "2(x+1)", false),
    ("symbolic", r"\boxed{\binom{5}{2}}", "20", false),
    ("symbolic", r"\boxed{x^{1/3}}", r"\sqrt{x}", false),
    ("symbolic", r"\boxed{x^2+1}", "(x-1)(x+1)", false),
    ("symbolic", r"\boxed{\sqrt{x^2}}", "x", false),
    ("symbolic", r"\boxed{2y}", "2x", false),
    ("symbolic", r"\boxed{x^3}", "x^2", false),
    ("symbolic", r"\boxed{\frac{a}{2}}", "2a", false),
    // intervals and unions
    ("intervals", r"\boxed{(1, 2]}", "(1,2]", true),
    ("intervals", r"\boxed{[-\infty, 3)}", r"(-\infty, 3)", true),
    ("intervals", r"\boxed{(-\infty, 5) \cup (6, \infty)}", r"(-\infty,5)\cup(6,\infty)", true),
    ("intervals", r"\boxed{(6, \infty) \cup (-\infty, 5)}", r"(-\infty,5)\cup(6,\infty)", true),
    ("intervals", r"\boxed{\left[\frac12, 3\right)}", "[0.5, 3)", true),
    ("intervals", r"\boxed{x \in [0, 1]}", "[0,1]", true),
    ("intervals", "\\boxed{(-\u{221e}, 0]}", r"(-\infty, 0]", true),
    ("intervals", r"\boxed{\mathbb{R}}", r"(-\infty, \infty)", true),
    ("intervals", r"\boxed{(1, 2]}", "[1,2]", false),
    ("intervals", r"\boxed{(1, 2)}", "(1,2]", false),
    ("intervals", r"\boxed{(-\infty, 5) \cup (6, \infty)}", r"(-\infty,5]\cup(6,\infty)", false),
    ("intervals", r"\boxed{(-\infty, 5)}", r"(-\infty,5)\cup(6,\infty)", false),
    ("intervals", r"\boxed{[0, 1]}", "[0, 2]", false),
    ("intervals", r"\boxed{[1,2]}", "1, 2", false),
    // sets (unordered) vs tuples (ordered)
    ("sets-tuples", r"\boxed{\{1, 2\}}", r"\{2, 1\}", true),
    ("sets-tuples", r"\boxed{(1, 2)}", "(1,2)", true),
    ("sets-tuples", r"\boxed{\left\{3, 1, 2\right\}}", r"\{1,2,3\}", true),
    ("sets-tuples", r"\boxed{(\frac12, -1)}", "(0.5, -1)", true),
    ("sets-tuples", r"\boxed{\emptyset}", r"\varnothing", true),
    ("sets-tuples", r"\boxed{\{\}}", r"\emptyset", true),
    ("sets-tuples", r"\boxed{\langle 1, 2\rangle}", "(1,2)", true),
    ("sets-tuples", r"\boxed{(1, 2)}", "(2, 1)", false),
    ("sets-tuples", r"\boxed{\{1, 2\}}", "(1, 2)", false),
    ("sets-tuples", r"\boxed{\{1, 2\}}", r"\{1, 2, 3\}", false),
    ("sets-tuples", r"\boxed{(1, 2, 3)}", "(1, 2)", false),
    ("sets-tuples", r"\boxed{\emptyset}", r"\{0\}", false),
    // multiple answers (unordered)
    ("multiple", r"\boxed{2, 3}", "3, 2", true),
    ("multiple", r"\boxed{x = 2, 3}", "2, 3", true),
    ("multiple", r"\boxed{2 \text{ and } 3}", "2, 3", true),
    ("multiple", r"\boxed{x=2 \text{ or } x=3}", "3, 2", true),
    ("multiple", r"\boxed{x = 2 or x = 3}", "2,3", true),
    ("multiple", r"\boxed{1 \pm \sqrt{2}}", r"1+\sqrt2, 1-\sqrt2", true),
    ("multiple", r"\boxed{-1, \frac{1}{2}}", r"\frac12, -1", true),
    ("multiple", r"\boxed{2, 3}", "2, 4", false),
    ("multiple", r"\boxed{2, 3}", "2", false),
    ("multiple", r"\boxed{2}", "2, 3", false),
    ("multiple", r"\boxed{2 \text{ and } 3}", "2, 3, 4", false),
    ("multiple", r"\boxed{x=2 or x=3}", "2, -3", false),
    // equations and answer prefixes
    ("equations", r"\boxed{x = 5}", "5", true),
    ("equations", r"\boxed{y = 2x + 1}", "2x+1", true),
    ("equations", r"\boxed{y = 2x+1}", "y = 1 + 2x", true),
    ("equations", r"\boxed{5}", "x = 5", true),
    ("equations", r"\boxed{x^2 + y^2 = 1}", "y^2 + x^2 = 1", true),
    ("equations", r"\boxed{(x, y) = (1, 2)}", "(1, 2)", true),
    ("equations", r"\boxed{f(x) = x^2}", "x^2", true),
    ("equations", r"\boxed{x_1 = 3}", "3", true),
    ("equations", r"\boxed{x = 5}", "6", false),
    ("equations", r"\boxed{y = 2x + 1}", "x = 2x+1", false),
    ("equations", r"\boxed{y = 2x+2}", "y = 2x+1", false),
    ("equations", r"\boxed{x^2 + y^2 = 1}", "x^2 + y^2 = 2", false),
    // thousands separators
    ("thousands", r"\boxed{1,000,000}", "1000000", true),
    ("thousands", r"\boxed{1{,}000}", "1000", true),
    ("thousands", r"\boxed{12,345}", "12345", true),
    ("thousands", r"\boxed{\$1,250.50}", "1250.5", true),
    ("thousands", r"\boxed{1,000 \text{ dollars}}", "1000", true),
    ("thousands", r"\boxed{(1,2)}", "(1, 2)", true),
    ("thousands", r"\boxed{1,2}", "2, 1", true),
    ("thousands", r"\boxed{1,000}", "1", false),
    ("thousands", r"\boxed{1,2}", "12", false),
    ("thousands", r"\boxed{1,000,000}", "100000", false),
    ("thousands", r"\boxed{(100,200)}", "100200", false),
    // text answers
    ("text", r"\boxed{\text{Monday}}", "monday", true),
    ("text", r"\boxed{\textbf{(B)}}", "B", true),
    ("text", r"\boxed{\text{No solution}}", "no solution", true),
    ("text", r"\boxed{Tuesday and Monday}", "Monday, Tuesday", true),
    ("text", r"\boxed{\text{No}}", "no", true),
    ("text", r"\boxed{x \leq 3}", r"x \le 3", true),
    ("text", r"\boxed{\text{Monday}}", "Tuesday", false),
    ("text", r"\boxed{x \le 3}", "x < 3", false),
    ("text", r"\boxed{\textbf{(B)}}", "C", false),
    ("text", r"\boxed{\text{odd}}", "even", false),
    ("text", r"\boxed{\text{yes}}", "no", false),
    // malformed input
    ("malformed", r"\boxed{\frac{1}{2}", r"\frac12", false),
    ("malformed", r"\boxed{}", "0", false),
    ("malformed", "The answer is 5", "5", false),
    ("malformed", r"\boxed{)(*&^}", "5", false),
    ("malformed", r"\boxed{\frac{1}{}}", "1", false),
    ("malformed", r"\boxed{1 + }", "1", false),
    ("malformed", r"\boxed{9^{9^{9^{9}}}}", r"\infty", false),
    ("malformed", r"\boxed{2^{10^{10}}}", "0", false),
    (
        "malformed",
        r"\boxed{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{1}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}",
        "2",
        false,
    ),
    ("malformed", r"\boxed{\sqrt{-4}}", "2", false),
    ("malformed", r"\boxed{1/0}", r"\infty", false),
    ("malformed", r"\boxed{3} and then \boxed{", "3", false),
    ("malformed", r"\boxed{{{1}}}", "1", true),
    ("malformed", r"\boxed{((((2))))}", "2", true),
    ("malformed", r"\boxed{9^{9^{9^{9}}}}", r"9^{9^{9^{9}}}", true),
    ("malformed", r"\boxed{2^{100}}", "1267650600228229401496703205376", true),
];

fn long_rows() -> Vec<(&'static str, String, String, bool)> {
    let huge_sum = format!("\\boxed{{{}1}}", "1+".repeat(1500));
    let long_prose = format!("{} so the answer is \\boxed{{42}}", "blah ".repeat(20_000));
    vec![
        ("malformed", huge_sum, "1501".to_owned(), false),
        ("malformed", long_prose, "42".to_owned(), true),
        ("malformed", "\\boxed{".repeat(3000), "1".to_owned(), false),
    ]
}

#[test]
fn equivalence_table() {
    let verifier = MathVerifier::new(&MathConfig::default()).unwrap();
    let mut rows: Vec<(&str, String, String, bool)> =
        TABLE.iter().map(|&(cat, r, t, e)| (cat, r.to_owned(), t.to_owned(), e)).collect();
    rows.extend(long_rows());
    let falses = rows.iter().filter(|r| !r.3).count();
    assert!(rows.len() >= 160, "table has only {} rows", rows.len());
    assert!(falses * 3 >= rows.len(), "only {falses} of {} rows are false", rows.len());
    for category in rows.iter().map(|r| r.0) {
        let has = |want: bool| rows.iter().any(|r| r.0 == category && r.3 == want);
        assert!(has(true) && has(false), "category {category} needs both true and false rows");
    }
    let mut failures = Vec::new();
    for (category, response, truth, expected) in &rows {
        let verdict = verifier.verify(response, truth);
        if verdict.correct != *expected {
            let shown: String = response.chars().take(80).collect();
            failures.push(format!(
                "[{category}] {shown:?} vs {truth:?}: expected {expected}, got {} (extracted {:?}, reason {:?})",
                verdict.correct,
                verdict.extracted.as_deref().map(|s| s.chars().take(60).collect::<String>()),
                verdict.reason
            ));
        }
    }
    assert!(failures.is_empty(), "{} of {} rows failed:\n{}", failures.len(), rows.len(), failures.join("\n"));
}

const FRAGMENTS: &[&str] = &[
    r"\frac{",
    r"\boxed{",
    r"\fbox{",
    "{",
    "}",
    "^",
    r"\sqrt",
    r"\sqrt[",
    "1",
    "2",
    "9",
    "0",
    "42",
    ",",
    "(",
    ")",
    "[",
    "]",
    r"\infty",
    "x",
    "y",
    " ",
    "  ",
    "-",
    "+",
    "/",
    "*",
    "=",
    r"\{",
    r"\}",
    r"\cup",
    r"\pi",
    "e",
    ".",
    "%",
    r"\%",
    r"\text{",
    r"\left(",
    r"\right)",
    r"\dfrac",
    "\u{2212}",
    "\u{3c0}",
    "\u{e9}",
    "\u{1f600}",
    "\0",
    "\t",
    "\u{7}",
    r"\",
    "$",
    "!",
    "|",
    "_",
    r"\pm",
    " and ",
    " or ",
    r"\circ",
    r"\cdot",
    "1,000",
    r"9^{9^{9^{9}}}",
    r"2^{10^{10}}",
    r"\binom{",
    "sin",
    r"\log_",
    "1e999",
    "0.000",
    r"\mathbb{R}",
    r"\emptyset",
];

fn random_text(rng: &mut ChaCha8Rng) -> String {
    let mut s = String::new();
    match rng.random_range(0..10) {
        0 => {
            // deeply nested braces / parentheses
            let depth = rng.random_range(1..400);
            let (open, close) = if rng.random_bool(0.5) { ("{", "}") } else { ("(", ")") };
            s.push_str(&open.repeat(depth));
            s.push('1');
            s.push_str(&close.repeat(rng.random_range(0..=depth)));
        }
        1 => {
            // random unicode and control characters
            for _ in 0..rng.random_range(0..40) {
                s.push(char::from_u32(rng.random_range(0..0x11_0000)).unwrap_or('\u{fffd}'));
            }
        }
        _ => {
            for _ in 0..rng.random_range(0..30) {
                s.push_str(FRAGMENTS[rng.random_range(0..FRAGMENTS.len())]);
            }
        }
    }
    s
}

#[test]
fn fuzz_never_panics() {
    let verifier = MathVerifier::new(&MathConfig { time_limit_ms: 200, ..MathConfig::default() }).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(0x6b65_656c);
    for _ in 0..1000 {
        let mut response = random_text(&mut rng);
        if rng.random_bool(0.6) {
            response = format!("\\boxed{{{response}}}");
        }
        let truth = random_text(&mut rng);
        let verdict = verifier.verify(&response, &truth);
        assert!(verdict.correct || verdict.reason.is_some(), "a wrong verdict always has a reason");
    }
}

#[test]
fn extraction_edge_cases() {
    assert_eq!(extract_answer(r"\boxed{\frac{1}{2}}", None).as_deref(), Some(r"\frac{1}{2}"));
    assert_eq!(extract_answer(r"\boxed{\{1,2\}}", None).as_deref(), Some(r"\{1,2\}"));
    assert_eq!(extract_answer(r"a \boxed{1} b \fbox{2} c", None).as_deref(), Some("2"));
    assert_eq!(extract_answer(r"\fbox{2} then \boxed{3}", None).as_deref(), Some("3"));
    assert_eq!(extract_answer(r"$\boxed 7$.", None).as_deref(), Some("7"));
    assert_eq!(extract_answer(r"\boxed{  5  }", None).as_deref(), Some("5"));
    assert_eq!(extract_answer(r"\boxed{\}}", None).as_deref(), Some(r"\}"));
    assert_eq!(extract_answer(r"\boxed{1} \boxed{2", None), None, "an unbalanced last box is no answer");
    assert_eq!(extract_answer(r"\boxed{}", None), None);
    assert_eq!(extract_answer(r"\boxed{ }", None), None);
    assert_eq!(extract_answer("no box here", None), None);
    assert_eq!(extract_answer(r"\boxedx{1}", None), None);
    assert_eq!(extract_answer("\\boxed{\u{e9}\u{1f600}}", None).as_deref(), Some("\u{e9}\u{1f600}"));
    assert_eq!(extract_answer("\\boxed \u{1f600}", None).as_deref(), Some("\u{1f600}"));

    let pattern = regex::Regex::new(r"Answer:\s*(.+)").unwrap();
    let text = "Answer: 3\nthinking more\nAnswer: 4";
    assert_eq!(extract_answer(text, Some(&pattern)).as_deref(), Some("4"), "the last match wins");
    assert_eq!(extract_answer(r"Answer: 3 \boxed{5}", Some(&pattern)).as_deref(), Some("5"), "a box wins");
    assert_eq!(extract_answer("nothing", Some(&pattern)), None);
}

#[test]
fn pattern_is_used_by_the_verifier() {
    let config = MathConfig { answer_pattern: Some(r"Answer:\s*(.+)".to_owned()), ..MathConfig::default() };
    let verifier = MathVerifier::new(&config).unwrap();
    let verdict = verifier.verify("so... Answer: 1/2", r"\frac{1}{2}");
    assert!(verdict.correct, "{verdict:?}");
    assert_eq!(verdict.extracted.as_deref(), Some("1/2"));
    let verdict = verifier.verify("I don't know", "1");
    assert_eq!(verdict.reason.as_deref(), Some("no answer found"));
    assert_eq!(verdict.extracted, None);
}

#[test]
fn config_validation_names_the_field() {
    let validate = |config: &MathConfig| MathVerifier::new(config).map(drop);
    assert_eq!(validate(&MathConfig::default()), Ok(()));
    let bad_regex = MathConfig { answer_pattern: Some("Answer: (".to_owned()), ..MathConfig::default() };
    assert!(validate(&bad_regex).unwrap_err().to_string().starts_with("answer_pattern:"));
    let no_group = MathConfig { answer_pattern: Some(r"Answer: \d+".to_owned()), ..MathConfig::default() };
    assert!(validate(&no_group).unwrap_err().to_string().starts_with("answer_pattern:"));
    let tolerance = MathConfig { relative_tolerance: f64::NAN, ..MathConfig::default() };
    assert!(validate(&tolerance).unwrap_err().to_string().starts_with("relative_tolerance:"));
    let negative = MathConfig { relative_tolerance: -1.0, ..MathConfig::default() };
    assert!(validate(&negative).unwrap_err().to_string().starts_with("relative_tolerance:"));
    let zero_time = MathConfig { time_limit_ms: 0, ..MathConfig::default() };
    assert!(validate(&zero_time).unwrap_err().to_string().starts_with("time_limit_ms:"));
}

#[test]
fn verdict_reasons() {
    let verifier = MathVerifier::new(&MathConfig::default()).unwrap();
    let wrong = verifier.verify(r"\boxed{3}", "4");
    assert_eq!((wrong.correct, wrong.reason.as_deref()), (false, Some("not equivalent")));
    assert_eq!(wrong.extracted.as_deref(), Some("3"));
    let none = verifier.verify("no idea", "4");
    assert_eq!(none.reason.as_deref(), Some("no answer found"));
    let garbage = verifier.verify(r"\boxed{)(}", "4");
    assert_eq!(garbage.reason.as_deref(), Some("unparseable answer"));
    let long = verifier.verify(&format!("\\boxed{{{}}}", "1".repeat(3000)), "1");
    assert!(long.reason.unwrap().starts_with("answer too long"));
    let right = verifier.verify(r"\boxed{4}", "4");
    assert_eq!((right.correct, right.reason), (true, None));
}

#[test]
fn equivalent_honours_the_deadline_and_tolerance() {
    let past = Instant::now();
    assert_eq!(equivalent("x^2", "x*x", 1e-4, past), Err(MathError::TimedOut));
    assert_eq!(MathError::TimedOut.to_string(), "time limit exceeded");
    let later = Instant::now() + Duration::from_secs(5);
    assert_eq!(equivalent("3.1416", r"\pi", 1e-4, later), Ok(true));
    assert_eq!(equivalent("3.1416", r"\pi", 1e-7, later), Ok(false));
    assert_eq!(equivalent("1001", "1000", 0.01, later), Ok(false), "integers are compared exactly");
    assert_eq!(equivalent("1000.5", "1000", 0.01, later), Ok(true), "decimals use the tolerance");
}
