//! Generalised advantage estimation (PPO with a critic), over the tokens the loss covers.
//!
//! Each sample is the sequence of its valid tokens t = 0..T (the generated ones; prompt and
//! environment tokens are not steps). With token rewards r_t (the sample's reward on its last
//! token, any per-token penalty on every token) and the critic's values V_t (the value of the
//! state before token t is chosen), V_T = 0 past the end:
//!
//! - δ_t = r_t + γ·V_{t+1} − V_t
//! - A_t = δ_t + γ·λ·A_{t+1} (A_T = 0)
//! - the critic's target R_t = A_t + V_t
//!
//! λ = 1 makes R_t the discounted reward-to-go; λ = 0 the one-step target. The advantages
//! are whitened over every valid token of the batch ([`whiten`]) before the policy sees them,
//! the returns are not.

use crate::advantages::VAR_FLOOR;
use crate::{Error, Result};

/// One sample's advantages and the critic's targets, one per valid token.
#[derive(Debug, Clone, PartialEq)]
pub struct Estimates {
    pub advantages: Vec<f64>,
    pub returns: Vec<f64>,
}

/// GAE of one sample from its token rewards and values (as long as each other).
pub fn gae(rewards: &[f64], values: &[f64], gamma: f64, lambda: f64) -> Result<Estimates> {
    if rewards.len() != values.len() {
        return Err(Error::LengthMismatch { what: "values", expected: rewards.len(), found: values.len() });
    }
    if let Some(index) = rewards.iter().position(|r| !r.is_finite()) {
        return Err(Error::NonFiniteReward { index, value: rewards[index] });
    }
    if let Some(index) = values.iter().position(|v| !v.is_finite()) {
        return Err(Error::NonFiniteValue { index, value: values[index] });
    }
    let n = rewards.len();
    let mut advantages = vec![0.0; n];
    let mut next_value = 0.0;
    let mut next_advantage = 0.0;
    for t in (0..n).rev() {
        let delta = rewards[t] + gamma * next_value - values[t];
        next_advantage = delta + gamma * lambda * next_advantage;
        advantages[t] = next_advantage;
        next_value = values[t];
    }
    let returns = advantages.iter().zip(values).map(|(a, v)| a + v).collect();
    Ok(Estimates { advantages, returns })
}

/// Every entry of `rows` less their mean, over their std (population, floored at
/// [`VAR_FLOOR`]), all rows together; rows keep their lengths. Nothing to whiten returns the
/// rows as they are.
pub fn whiten(rows: Vec<Vec<f64>>) -> Vec<Vec<f64>> {
    let Some((mean, variance)) = mean_and_variance(rows.iter().flatten().copied()) else { return rows };
    let rstd = 1.0 / variance.max(VAR_FLOOR).sqrt();
    rows.into_iter().map(|row| row.into_iter().map(|a| (a - mean) * rstd).collect()).collect()
}

/// 1 − Var(R − V) / Var(R) over `(return, value)` pairs: the share of the returns' variance
/// the values explain (1: all of it; 0: no better than the returns' mean; below 0: worse),
/// verl's `vf_explained_var`. `None` without pairs or when the returns do not vary.
pub fn explained_variance(pairs: &[(f64, f64)]) -> Option<f64> {
    let (_, returns) = mean_and_variance(pairs.iter().map(|(r, _)| *r))?;
    let (_, residuals) = mean_and_variance(pairs.iter().map(|(r, v)| r - v))?;
    (returns > 0.0).then(|| 1.0 - residuals / returns)
}

/// The mean and the population variance of `xs`; `None` when empty.
fn mean_and_variance(xs: impl Iterator<Item = f64> + Clone) -> Option<(f64, f64)> {
    let count = xs.clone().count() as f64;
    if count == 0.0 {
        return None;
    }
    let mean = xs.clone().sum::<f64>() / count;
    Some((mean, xs.map(|x| (x - mean) * (x - mean)).sum::<f64>() / count))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-12, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn explained_variance_by_hand() {
        // Returns [1, 3], values [0, 2]: R − V = [1, 1] has no variance, so all is explained
        // once the offset is allowed for; values [2, 2] explain nothing; [3, 1] explain less
        // than nothing (Var(R) = 1, Var(R − V) = 4).
        assert_eq!(explained_variance(&[(1.0, 0.0), (3.0, 2.0)]), Some(1.0));
        assert_eq!(explained_variance(&[(1.0, 2.0), (3.0, 2.0)]), Some(0.0));
        assert_eq!(explained_variance(&[(1.0, 3.0), (3.0, 1.0)]), Some(-3.0));
        assert_eq!(explained_variance(&[(1.0, 0.0), (1.0, 2.0)]), None, "constant returns");
        assert_eq!(explained_variance(&[]), None);
    }

    #[test]
    fn gae_by_hand() {
        // Three tokens, reward 1 on the last, values 0.5, 0.25, 0.75; γ = 0.9, λ = 0.5.
        // δ = [0 + 0.9·0.25 − 0.5, 0 + 0.9·0.75 − 0.25, 1 + 0 − 0.75] = [−0.275, 0.425, 0.25]
        // A_2 = 0.25; A_1 = 0.425 + 0.45·0.25 = 0.5375; A_0 = −0.275 + 0.45·0.5375 = −0.033125
        let e = gae(&[0.0, 0.0, 1.0], &[0.5, 0.25, 0.75], 0.9, 0.5).unwrap();
        close(&e.advantages, &[-0.033125, 0.5375, 0.25]);
        close(&e.returns, &[0.466875, 0.7875, 1.0]);
    }

    #[test]
    fn lambda_one_gives_the_discounted_reward_to_go_and_zero_the_one_step_target() {
        let (rewards, values) = ([0.5, -1.0, 2.0], [0.3, 0.1, -0.2]);
        let full = gae(&rewards, &values, 0.5, 1.0).unwrap();
        close(&full.returns, &[0.5 - 0.5 + 0.5, -1.0 + 1.0, 2.0]);
        let one_step = gae(&rewards, &values, 0.5, 0.0).unwrap();
        close(&one_step.returns, &[0.5 + 0.5 * 0.1, -1.0 + 0.5 * -0.2, 2.0]);
        close(&one_step.advantages, &[0.5 + 0.05 - 0.3, -1.0 - 0.1 - 0.1, 2.0 + 0.2]);
    }

    #[test]
    fn empty_samples_and_bad_inputs() {
        assert_eq!(gae(&[], &[], 1.0, 1.0).unwrap(), Estimates { advantages: vec![], returns: vec![] });
        assert!(matches!(gae(&[1.0], &[], 1.0, 1.0), Err(Error::LengthMismatch { .. })));
        assert!(matches!(gae(&[f64::NAN], &[0.0], 1.0, 1.0), Err(Error::NonFiniteReward { index: 0, .. })));
        assert!(matches!(
            gae(&[0.0, 1.0], &[0.0, f64::INFINITY], 1.0, 1.0),
            Err(Error::NonFiniteValue { index: 1, .. })
        ));
    }

    #[test]
    fn whitening_is_over_every_token_of_the_batch() {
        let w = whiten(vec![vec![1.0, 3.0], vec![], vec![5.0, 7.0]]);
        let rstd = 1.0 / 5.0f64.sqrt();
        close(&w.concat(), &[-3.0 * rstd, -rstd, rstd, 3.0 * rstd]);
        assert_eq!(w[1].len(), 0);
        assert_eq!(whiten(vec![vec![]]), vec![Vec::<f64>::new()]);
    }
}
