//! Every loss against the independent PyTorch implementation of `LOSSES.md`
//! (`tests/reference/loss_reference.py`, run in `.venv`): values, gradients with respect
//! to the logprobs (or scores), and metrics; plus cases small enough to check by hand.

#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::process::{Command, Stdio};

use keel_protocol::training::LossConfig;
use keel_training::loss::{self, GlobalCounts, LossInput};
use keel_training::metrics::Metrics;
use serde_json::{Value, json};
use tch::{Kind, Tensor};

/// Deterministic values in [lo, hi).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, lo: f64, hi: f64) -> f64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        lo + (hi - lo) * ((self.0 >> 11) as f64 / (1u64 << 53) as f64)
    }

    fn table(&mut self, rows: usize, cols: usize, lo: f64, hi: f64) -> Vec<Vec<f64>> {
        (0..rows).map(|_| (0..cols).map(|_| self.next(lo, hi)).collect()).collect()
    }
}

/// One loss problem: [B, S] tables with position 0 = 0.
#[derive(Clone)]
struct Case {
    loss: Value,
    logprobs: Vec<Vec<f64>>,
    prev: Option<Vec<Vec<f64>>>,
    generation: Option<Vec<Vec<f64>>>,
    reference: Option<Vec<Vec<f64>>>,
    token_mask: Vec<Vec<f64>>,
    sample_mask: Vec<f64>,
    /// One advantage per sample, broadcast over its tokens...
    advantages: Option<Vec<f64>>,
    /// ... or one per token (taken over `advantages` when both are set).
    token_advantages: Option<Vec<Vec<f64>>>,
    scores: Option<Vec<f64>>,
}

fn offset(base: &[Vec<f64>], noise: &[Vec<f64>]) -> Vec<Vec<f64>> {
    base.iter()
        .zip(noise)
        .map(|(b, n)| b.iter().zip(n).enumerate().map(|(i, (x, d))| if i == 0 { 0.0 } else { x + d }).collect())
        .collect()
}

fn random_case(loss: Value, seed: u64) -> Case {
    let (b, s) = (6, 7);
    let mut rng = Lcg(seed);
    let mut logprobs = rng.table(b, s, -3.0, -0.05);
    for row in &mut logprobs {
        row[0] = 0.0;
    }
    let prev = offset(&logprobs, &rng.table(b, s, -0.5, 0.5));
    let generation = offset(&prev, &rng.table(b, s, -0.4, 0.4));
    let reference = offset(&logprobs, &rng.table(b, s, -1.5, 1.5));
    // Prompts of different lengths (mask 0), then generated tokens; padding at the end of row 2.
    let token_mask = (0..b)
        .map(|row| (0..s).map(|i| if i > row % 3 && !(row == 2 && i >= 5) { 1.0 } else { 0.0 }).collect())
        .collect();
    let advantages = (0..b).map(|_| rng.next(-2.0, 2.0)).collect();
    let scores = (0..b).map(|_| rng.next(-2.0, 2.0)).collect();
    Case {
        loss,
        logprobs,
        prev: Some(prev),
        generation: Some(generation),
        reference: Some(reference),
        token_mask,
        sample_mask: vec![1.0, 1.0, 1.0, 0.0, 1.0, 1.0],
        advantages: Some(advantages),
        token_advantages: None,
        scores: Some(scores),
    }
}

fn tensor(table: &[Vec<f64>]) -> Tensor {
    let flat: Vec<f32> = table.iter().flatten().map(|&x| x as f32).collect();
    Tensor::from_slice(&flat).view([table.len() as i64, table[0].len() as i64])
}

fn vector(values: &[f64]) -> Tensor {
    Tensor::from_slice(&values.iter().map(|&x| x as f32).collect::<Vec<_>>())
}

/// Keel's loss, metrics and gradient (w.r.t. logprobs, or scores for Bradley–Terry).
fn keel(case: &Case) -> (f64, Metrics, Vec<f64>) {
    if case.loss["type"] == "value" {
        return keel_value(case);
    }
    let config: LossConfig = serde_json::from_value(case.loss.clone()).unwrap();
    let logprobs = tensor(&case.logprobs).set_requires_grad(true);
    let scores = case.scores.as_ref().map(|s| vector(s).set_requires_grad(true));
    let token_mask = tensor(&case.token_mask);
    let sample_mask = vector(&case.sample_mask);
    let global = GlobalCounts::of(&token_mask, &sample_mask).unwrap();
    let input = LossInput {
        logprobs: &logprobs,
        mask: loss::shifted_mask(&token_mask, &sample_mask).unwrap(),
        sample_mask,
        advantages: match (&case.token_advantages, &case.advantages) {
            (Some(per_token), _) => Some(tensor(per_token)),
            (None, Some(a)) => {
                let width = case.logprobs[0].len() as i64;
                Some(vector(a).unsqueeze(1).expand([a.len() as i64, width], false).contiguous())
            }
            (None, None) => None,
        },
        prev_logprobs: case.prev.as_ref().map(|t| tensor(t)),
        generation_logprobs: case.generation.as_ref().map(|t| tensor(t)),
        reference_logprobs: case.reference.as_ref().map(|t| tensor(t)),
        scores: scores.as_ref().map(Tensor::shallow_clone),
    };
    let (value, metrics) = match &config {
        LossConfig::ClippedPg(c) => loss::policy::clipped_pg(c, &input, &global),
        LossConfig::Nll => loss::nll::nll(&input, &global),
        LossConfig::Dpo(c) => loss::dpo::dpo(c, &input, &global),
        LossConfig::BradleyTerry => loss::reward::bradley_terry(&input, &global),
    }
    .unwrap();
    value.backward();
    let wrt = if matches!(config, LossConfig::BradleyTerry) { scores.unwrap() } else { logprobs };
    let grad = Vec::<f64>::try_from(wrt.grad().to_kind(Kind::Double).flatten(0, -1)).unwrap();
    (value.double_value(&[]), metrics, grad)
}

/// The critic's loss on a case read as values = `logprobs`, the values scored with = `prev`,
/// returns = `reference` (what [`problem`] sends the reference for a `value` case).
fn keel_value(case: &Case) -> (f64, Metrics, Vec<f64>) {
    let values = tensor(&case.logprobs).set_requires_grad(true);
    let token_mask = tensor(&case.token_mask);
    let sample_mask = vector(&case.sample_mask);
    let global = GlobalCounts::of(&token_mask, &sample_mask).unwrap();
    let input = loss::value::ValueInput {
        values: &values,
        old_values: tensor(case.prev.as_ref().unwrap()),
        returns: tensor(case.reference.as_ref().unwrap()),
        mask: loss::shifted_mask(&token_mask, &sample_mask).unwrap(),
    };
    let (value, metrics) = loss::value::value_loss(case.loss["value_clip"].as_f64(), &input, &global).unwrap();
    value.backward();
    let grad = Vec::<f64>::try_from(values.grad().to_kind(Kind::Double).flatten(0, -1)).unwrap();
    (value.double_value(&[]), metrics, grad)
}

fn problem(case: &Case) -> Value {
    if case.loss["type"] == "value" {
        return json!({
            "loss": case.loss, "values": case.logprobs, "old_values": case.prev, "returns": case.reference,
            "token_mask": case.token_mask, "sample_mask": case.sample_mask,
        });
    }
    let mut input = json!({
        "loss": case.loss, "logprobs": case.logprobs, "token_mask": case.token_mask,
        "sample_mask": case.sample_mask,
    });
    let fields = [
        ("prev_logprobs", case.prev.as_ref().map(|t| json!(t))),
        ("generation_logprobs", case.generation.as_ref().map(|t| json!(t))),
        ("reference_logprobs", case.reference.as_ref().map(|t| json!(t))),
        (
            "advantages",
            case.token_advantages.as_ref().map(|t| json!(t)).or_else(|| case.advantages.as_ref().map(|t| json!(t))),
        ),
        ("scores", case.scores.as_ref().map(|t| json!(t))),
    ];
    for (name, value) in fields {
        if let Some(value) = value {
            input[name] = value;
        }
    }
    input
}

/// The PyTorch reference's answers to `cases`, in one run of the script.
fn reference(cases: &[(&str, Case)]) -> Vec<Value> {
    let input = Value::Array(cases.iter().map(|(_, case)| problem(case)).collect());
    let script = keel_testkit::workspace_root().join("tests/reference/loss_reference.py");
    let mut child = Command::new(keel_testkit::python())
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input.to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "loss_reference.py failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn flat(value: &Value) -> Vec<f64> {
    match value {
        Value::Array(items) => items.iter().flat_map(flat).collect(),
        Value::Number(n) => vec![n.as_f64().unwrap()],
        other => panic!("not a number: {other}"),
    }
}

fn compare(cases: &[(&str, Case)]) {
    for ((name, case), expected) in cases.iter().zip(reference(cases)) {
        let (value, metrics, grad) = keel(case);
        let tolerance = |x: f64| 2e-5 * (1.0 + x.abs());
        let want = expected["loss"].as_f64().unwrap();
        assert!((value - want).abs() < tolerance(want), "{name}: loss {value} vs reference {want}");
        let want_grad = flat(&expected["grad"]);
        assert_eq!(grad.len(), want_grad.len(), "{name}: gradient size");
        assert!(want_grad.iter().any(|g| g.abs() > 1e-4), "{name}: the reference gradient is ~0");
        for (i, (g, w)) in grad.iter().zip(&want_grad).enumerate() {
            assert!((g - w).abs() < tolerance(*w), "{name}: gradient {i}: {g} vs reference {w}");
        }
        let metrics = metrics.into_map();
        for (metric, want) in expected["metrics"].as_object().unwrap() {
            let want = want.as_f64().unwrap();
            let got = *metrics.get(metric).unwrap_or_else(|| panic!("{name}: Keel lacks metric {metric}: {metrics:?}"));
            assert!((got - want).abs() < tolerance(want), "{name}: metric {metric} {got} vs reference {want}");
        }
    }
}

#[test]
fn clipped_policy_gradient_variants_match_pytorch() {
    let cases = [
        ("defaults (k3, clamps, token level)", json!({"type": "clipped_pg"})),
        (
            "asymmetric clip and dual clip",
            json!({"type": "clipped_pg", "ratio_clip_min": 0.1, "ratio_clip_max": 0.28, "ratio_clip_c": 1.5}),
        ),
        (
            "k1 with tight clamps",
            json!({"type": "clipped_pg", "reference_policy_kl_type": "k1", "reference_policy_kl_penalty": 0.3, "kl_input_clamp_value": 0.5, "kl_output_clamp_value": 0.3}),
        ),
        (
            "k2 with tight clamps",
            json!({"type": "clipped_pg", "reference_policy_kl_type": "k2", "reference_policy_kl_penalty": 0.3, "kl_input_clamp_value": 0.8, "kl_output_clamp_value": 0.2}),
        ),
        (
            "k3 without clamps",
            json!({"type": "clipped_pg", "reference_policy_kl_penalty": 0.5, "kl_input_clamp_value": null, "kl_output_clamp_value": null}),
        ),
        ("importance sampling, untruncated", json!({"type": "clipped_pg", "use_importance_sampling_correction": true})),
        (
            "tis",
            json!({"type": "clipped_pg", "use_importance_sampling_correction": true, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio_max": 1.1}),
        ),
        (
            "icepop",
            json!({"type": "clipped_pg", "use_importance_sampling_correction": true, "truncated_importance_sampling_type": "icepop", "truncated_importance_sampling_ratio_min": 0.85, "truncated_importance_sampling_ratio_max": 1.15}),
        ),
        (
            "seq-mask-tis",
            json!({"type": "clipped_pg", "use_importance_sampling_correction": true, "truncated_importance_sampling_type": "seq-mask-tis", "truncated_importance_sampling_ratio_min": 0.95, "truncated_importance_sampling_ratio_max": 1.05}),
        ),
        ("sequence-level loss", json!({"type": "clipped_pg", "token_level_loss": false})),
        ("GSPO", json!({"type": "clipped_pg", "token_level_loss": false, "sequence_level_importance_ratios": true})),
        ("REINFORCE", json!({"type": "clipped_pg", "disable_ppo_ratio": true})),
        ("force on-policy ratio", json!({"type": "clipped_pg", "force_on_policy_ratio": true})),
        ("CISPO", json!({"type": "clipped_pg", "cispo": true, "ratio_clip_min": 0.5, "ratio_clip_max": 0.1})),
        (
            "CISPO with tis",
            json!({"type": "clipped_pg", "cispo": true, "use_importance_sampling_correction": true, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio_max": 1.1}),
        ),
        ("no KL", json!({"type": "clipped_pg", "reference_policy_kl_penalty": 0.0})),
    ];
    let mut problems: Vec<(&str, Case)> =
        cases.into_iter().enumerate().map(|(seed, (name, loss))| (name, random_case(loss, seed as u64 + 1))).collect();
    // Per-token advantages (NeMo-RL's [B, S]), with dual clip so the sign of each token counts;
    // and the KL in the reward: no KL term in the loss.
    let mut case = random_case(json!({"type": "clipped_pg", "ratio_clip_c": 3.0}), 98);
    case.token_advantages = Some(Lcg(98).table(6, 7, -2.0, 2.0));
    problems.push(("per-token advantages", case));
    let mut case =
        random_case(json!({"type": "clipped_pg", "use_kl_in_reward": true, "reference_policy_kl_penalty": 0.3}), 97);
    case.token_advantages = Some(Lcg(97).table(6, 7, -2.0, 2.0));
    problems.push(("KL in the reward", case));
    // Without generator logprobs (gen = prev) and without a reference when β = 0.
    let mut case = random_case(json!({"type": "clipped_pg", "reference_policy_kl_penalty": 0.0}), 99);
    case.generation = None;
    case.reference = None;
    problems.push(("no generation logprobs", case));
    compare(&problems);
}

#[test]
fn nll_dpo_and_bradley_terry_match_pytorch() {
    compare(&[
        ("nll", random_case(json!({"type": "nll"}), 7)),
        ("dpo", random_case(json!({"type": "dpo"}), 8)),
        (
            "dpo, averaged, with SFT",
            random_case(
                json!({"type": "dpo", "reference_policy_kl_penalty": 0.2, "preference_average_log_probs": true, "sft_loss_weight": 0.5, "preference_loss_weight": 0.7}),
                9,
            ),
        ),
        ("dpo, summed SFT", random_case(json!({"type": "dpo", "sft_loss_weight": 0.3}), 11)),
        (
            "dpo, averaged SFT",
            random_case(json!({"type": "dpo", "sft_loss_weight": 0.3, "sft_average_log_probs": true}), 12),
        ),
        ("bradley-terry", random_case(json!({"type": "bradley_terry"}), 10)),
    ]);
}

/// PPO's critic loss, unclipped and clipped at two ranges (the narrow one clips most tokens).
#[test]
fn value_loss_matches_pytorch() {
    compare(&[
        ("value loss", random_case(json!({"type": "value", "value_clip": null}), 31)),
        ("value loss, clipped at 0.2", random_case(json!({"type": "value", "value_clip": 0.2}), 32)),
        ("value loss, clipped at 0.05", random_case(json!({"type": "value", "value_clip": 0.05}), 33)),
    ]);
}

/// Per-sample advantages and the same values given per token train alike.
#[test]
fn per_sample_advantages_are_per_token_advantages_broadcast() {
    let case = random_case(json!({"type": "clipped_pg", "ratio_clip_c": 3.0}), 21);
    let mut per_token = case.clone();
    let advantages = case.advantages.clone().unwrap();
    per_token.token_advantages = Some(advantages.iter().map(|&a| vec![a; case.logprobs[0].len()]).collect());
    let (loss, metrics, grad) = keel(&case);
    let (loss_t, metrics_t, grad_t) = keel(&per_token);
    assert!(close(loss, loss_t), "{loss} vs {loss_t}");
    assert!(grad.iter().zip(&grad_t).all(|(a, b)| close(*a, *b)));
    assert_eq!(metrics.get("probs_ratio"), metrics_t.get("probs_ratio"));
}

/// One row with one generated token: [0, lp].
fn one_token(loss: Value, lp: f64, prev: f64, reference: f64, advantage: f64) -> (f64, f64, Metrics) {
    let case = Case {
        loss,
        logprobs: vec![vec![0.0, lp]],
        prev: Some(vec![vec![0.0, prev]]),
        generation: None,
        reference: Some(vec![vec![0.0, reference]]),
        token_mask: vec![vec![0.0, 1.0]],
        sample_mask: vec![1.0],
        advantages: Some(vec![advantage]),
        token_advantages: None,
        scores: None,
    };
    let (value, metrics, grad) = keel(&case);
    (value, grad[1], metrics)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-5
}

#[test]
fn clipping_by_hand() {
    let pg = json!({"type": "clipped_pg", "reference_policy_kl_penalty": 0.0});
    let ln = f64::ln;
    // A > 0, r = 1.5 above 1 + ε: clipped at 1.2, no gradient.
    let (loss, grad, m) = one_token(pg.clone(), ln(1.5) - 1.0, -1.0, 0.0, 1.0);
    assert!(close(loss, -1.2) && close(grad, 0.0), "{loss} {grad}");
    assert!(close(m.get("probs_ratio").unwrap(), 1.5) && close(m.get("probs_ratio_clamped").unwrap(), 1.2));
    // A > 0, r = 0.5 below 1 − ε: the unclipped term is larger (−0.5 > −0.8), gradient −A·r.
    let (loss, grad, _) = one_token(pg.clone(), ln(0.5) - 1.0, -1.0, 0.0, 1.0);
    assert!(close(loss, -0.5) && close(grad, -0.5), "{loss} {grad}");
    // A < 0, r = 0.5: clipped at 0.8 (loss 0.8 > 0.5), no gradient.
    let (loss, grad, _) = one_token(pg.clone(), ln(0.5) - 1.0, -1.0, 0.0, -1.0);
    assert!(close(loss, 0.8) && close(grad, 0.0), "{loss} {grad}");
    // A < 0, r = 5: unclipped 5 > 1.2; dual clip c = 3 caps it at 3 with no gradient.
    let (loss, grad, _) = one_token(pg.clone(), ln(5.0) - 1.0, -1.0, 0.0, -1.0);
    assert!(close(loss, 5.0) && close(grad, 5.0), "{loss} {grad}");
    let mut dual = pg.clone();
    dual["ratio_clip_c"] = json!(3.0);
    let (loss, grad, _) = one_token(dual, ln(5.0) - 1.0, -1.0, 0.0, -1.0);
    assert!(close(loss, 3.0) && close(grad, 0.0), "{loss} {grad}");
    // REINFORCE: −A·lp.
    let (loss, grad, _) = one_token(
        json!({"type": "clipped_pg", "disable_ppo_ratio": true, "reference_policy_kl_penalty": 0.0}),
        -2.0,
        -1.0,
        0.0,
        0.5,
    );
    assert!(close(loss, 1.0) && close(grad, -0.5), "{loss} {grad}");
}

#[test]
fn kl_estimators_by_hand() {
    // ref − lp = 0.5 at r = 1 (A = 0): the loss is β·k; the gradient is β(dk/dlp + k).
    let x: f64 = 0.5;
    let expected = [
        ("k1", -x, 1.0 - x),
        ("k2", x * x / 2.0, -x + x * x / 2.0),
        ("k3", x.exp() - 1.0 - x, -(x.exp() - 1.0) + (x.exp() - 1.0 - x)),
    ];
    for (kind, value, gradient) in expected {
        let loss = json!({"type": "clipped_pg", "reference_policy_kl_type": kind, "reference_policy_kl_penalty": 1.0});
        let (loss, grad, m) = one_token(loss, -1.0, -1.0, -0.5, 0.0);
        assert!(close(loss, value) && close(grad, gradient), "{kind}: {loss} {grad}");
        assert!(close(m.get("kl_penalty").unwrap(), value));
    }
    // Input clamp: ref − lp = 30 is clamped to 20 before k1 (= −20), then the output clamp to −10.
    let k1 = json!({"type": "clipped_pg", "reference_policy_kl_type": "k1", "reference_policy_kl_penalty": 1.0});
    let (loss, grad, _) = one_token(k1.clone(), -31.0, -31.0, -1.0, 0.0);
    assert!(close(loss, -10.0) && close(grad, 0.0), "{loss} {grad}");
    let mut unclamped_out = k1;
    unclamped_out["kl_output_clamp_value"] = json!(null);
    let (loss, grad, _) = one_token(unclamped_out, -31.0, -31.0, -1.0, 0.0);
    assert!(close(loss, -20.0) && close(grad, -20.0), "{loss} {grad}");
}

#[test]
fn dpo_at_the_reference_is_ln2_and_sft_weight_adds_the_nll() {
    let mut case = random_case(json!({"type": "dpo"}), 3);
    case.reference = Some(case.logprobs.clone());
    case.sample_mask = vec![1.0; 6];
    let (loss, metrics, _) = keel(&case);
    assert!(close(loss, std::f64::consts::LN_2), "{loss}");
    assert!(close(metrics.get("accuracy").unwrap(), 0.0));

    case.loss = json!({"type": "dpo", "sft_loss_weight": 2.0});
    let (with_sft, metrics, _) = keel(&case);
    // The chosen rows' (0, 2, 4) NLL summed over their masked tokens, averaged over 3 pairs.
    let mut sum = 0.0;
    for row in [0, 2, 4] {
        for i in 1..case.logprobs[row].len() {
            sum -= case.logprobs[row][i] * case.token_mask[row][i];
        }
    }
    assert!(close(metrics.get("sft_loss").unwrap(), sum / 3.0));
    assert!(close(with_sft, std::f64::consts::LN_2 + 2.0 * sum / 3.0), "{with_sft}");
}

/// Uniform logits over a vocabulary of V give every token logprob −ln V: with chosen answers
/// of T tokens the SFT term is T·ln V by default (NeMo-RL sums each answer's NLL) and ln V
/// with `sft_average_log_probs`.
#[test]
fn dpo_sft_term_of_uniform_logits_is_t_ln_v() {
    let (vocab, answer) = (50.0f64, 7usize);
    let uniform = -vocab.ln();
    // Two pairs: a 3-token prompt, then T answer tokens (the rejected answers shorter).
    let row = |len: usize| -> (Vec<f64>, Vec<f64>) {
        let logprobs = (0..3 + len).map(|i| if i == 0 { 0.0 } else { uniform }).collect();
        let mask = (0..3 + len).map(|i| if i >= 3 { 1.0 } else { 0.0 }).collect();
        (logprobs, mask)
    };
    let rows = [row(answer), row(2), row(answer), row(4)];
    let width = rows.iter().map(|(lp, _)| lp.len()).max().unwrap();
    let pad = |v: &Vec<f64>| -> Vec<f64> { v.iter().copied().chain(std::iter::repeat(0.0)).take(width).collect() };
    let case = |average: bool| Case {
        loss: json!({"type": "dpo", "sft_loss_weight": 1.0, "preference_loss_weight": 0.0, "sft_average_log_probs": average}),
        logprobs: rows.iter().map(|(lp, _)| pad(lp)).collect(),
        prev: None,
        generation: None,
        reference: Some(rows.iter().map(|(lp, _)| pad(lp)).collect()),
        token_mask: rows.iter().map(|(_, m)| pad(m)).collect(),
        sample_mask: vec![1.0; 4],
        advantages: None,
        token_advantages: None,
        scores: None,
    };
    let (summed, metrics, _) = keel(&case(false));
    assert!(close(summed, answer as f64 * vocab.ln()), "{summed} vs {}", answer as f64 * vocab.ln());
    assert!(close(metrics.get("sft_loss").unwrap(), summed));
    let (averaged, _, _) = keel(&case(true));
    assert!(close(averaged, vocab.ln()), "{averaged} vs {}", vocab.ln());
}

#[test]
fn bradley_terry_by_hand() {
    let mut case = random_case(json!({"type": "bradley_terry"}), 4);
    case.sample_mask = vec![1.0; 6];
    case.scores = Some(vec![1.0, 1.0, 2.0, 0.0, -1.0, 0.5]);
    let (loss, metrics, grad) = keel(&case);
    let nls = |m: f64| (1.0 + (-m).exp()).ln();
    let want = (nls(0.0) + nls(2.0) + nls(-1.5)) / 3.0;
    assert!(close(loss, want), "{loss} vs {want}");
    assert!(close(metrics.get("accuracy").unwrap(), 1.0 / 3.0));
    // d/ds_c −log σ(m) = −σ(−m) / 3.
    assert!(close(grad[0], -0.5 / 3.0) && close(grad[1], 0.5 / 3.0), "{grad:?}");
}
