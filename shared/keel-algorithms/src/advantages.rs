//! Advantages from per-sample rewards, samples grouped by prompt.
//!
//! For a group with v valid samples (v ≥ 2) and m = v − 1 for leave-one-out (v for the mean
//! baseline), sample i's baseline is the mean of the valid rewards in its comparison set (the
//! group, without sample i for leave-one-out) and its std is the Bessel-corrected std of that
//! same set: sqrt((E[r²] − E[r]²) · m / (m − 1)), 0 where undefined. A group with at most one
//! valid sample gets baseline = reward (advantage 0) and std 0.

use std::collections::HashMap;
use std::hash::Hash;

use crate::{Error, Result};

/// Added to the std before dividing, as NeMo-RL does.
pub const STD_EPSILON: f64 = 1e-6;
/// Floor on the variance in REINFORCE++ whitening.
pub const VAR_FLOOR: f64 = 1e-8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Baseline {
    /// The mean reward of the group.
    Mean,
    /// The mean reward of the other samples of the group (RLOO; NeMo-RL's default).
    LeaveOneOut,
}

/// Per-sample baseline and std.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupStats {
    pub baseline: Vec<f64>,
    pub std: Vec<f64>,
}

fn check_len(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if expected == found { Ok(()) } else { Err(Error::LengthMismatch { what, expected, found }) }
}

fn check_rewards(rewards: &[f64]) -> Result<()> {
    match rewards.iter().position(|r| !r.is_finite()) {
        Some(index) => Err(Error::NonFiniteReward { index, value: rewards[index] }),
        None => Ok(()),
    }
}

/// Sample indices by group, in first-seen order.
fn groups_of<K: Hash + Eq>(groups: &[K]) -> Vec<Vec<usize>> {
    let mut index: HashMap<&K, usize> = HashMap::new();
    let mut members: Vec<Vec<usize>> = Vec::new();
    for (i, key) in groups.iter().enumerate() {
        let slot = *index.entry(key).or_insert_with(|| {
            members.push(Vec::new());
            members.len() - 1
        });
        members[slot].push(i);
    }
    members
}

/// Baseline and std of each sample's comparison set; `valid[i] = false` leaves sample i out
/// of every set (its own entries are still filled).
pub fn group_baseline_and_std<K: Hash + Eq>(
    groups: &[K],
    rewards: &[f64],
    valid: &[bool],
    baseline: Baseline,
) -> Result<GroupStats> {
    check_len("groups", rewards.len(), groups.len())?;
    check_len("valid", rewards.len(), valid.len())?;
    check_rewards(rewards)?;
    let mut stats = GroupStats { baseline: rewards.to_vec(), std: vec![0.0; rewards.len()] };
    for members in groups_of(groups) {
        let valid_members: Vec<usize> = members.iter().copied().filter(|&i| valid[i]).collect();
        if valid_members.len() <= 1 {
            continue;
        }
        let sum: f64 = valid_members.iter().map(|&i| rewards[i]).sum();
        let sum_sq: f64 = valid_members.iter().map(|&i| rewards[i] * rewards[i]).sum();
        let leave_out = baseline == Baseline::LeaveOneOut;
        let m = valid_members.len() as f64 - if leave_out { 1.0 } else { 0.0 };
        for &i in &members {
            let own = if leave_out && valid[i] { rewards[i] } else { 0.0 };
            let mean = (sum - own) / m;
            let mean_sq = (sum_sq - own * own) / m;
            let variance = (mean_sq - mean * mean) * m / (m - 1.0);
            stats.baseline[i] = mean;
            stats.std[i] = if variance.is_finite() && variance > 0.0 { variance.sqrt() } else { 0.0 };
        }
    }
    Ok(stats)
}

/// GRPO advantages: reward − baseline, divided by (std + 1e-6) only where std > 0 when
/// `normalize_std` is set.
pub fn grpo_advantages<K: Hash + Eq>(
    groups: &[K],
    rewards: &[f64],
    valid: &[bool],
    baseline: Baseline,
    normalize_std: bool,
) -> Result<Vec<f64>> {
    let stats = group_baseline_and_std(groups, rewards, valid, baseline)?;
    Ok(rewards
        .iter()
        .zip(stats.baseline.iter().zip(&stats.std))
        .map(|(r, (b, s))| {
            let advantage = r - b;
            if normalize_std && *s > 0.0 { advantage / (s + STD_EPSILON) } else { advantage }
        })
        .collect())
}

/// Turn-level GRPO advantages for multi-turn samples: sample i's turn k is credited with its
/// reward-to-go (`turn_rewards[i][k] + turn_rewards[i][k + 1] + ...`), compared by
/// [`grpo_advantages`] with the reward-to-go of turn k of the other samples of its group that
/// reached turn k. One value per turn of each sample; on single-turn samples this is
/// [`grpo_advantages`] of their rewards.
pub fn turn_grpo_advantages<K: Hash + Eq + Clone>(
    groups: &[K],
    turn_rewards: &[Vec<f64>],
    baseline: Baseline,
    normalize_std: bool,
) -> Result<Vec<Vec<f64>>> {
    check_len("turn_rewards", groups.len(), turn_rewards.len())?;
    let (mut keys, mut to_go) = (Vec::new(), Vec::new());
    for (group, rewards) in groups.iter().zip(turn_rewards) {
        for k in 0..rewards.len() {
            keys.push((group.clone(), k));
            to_go.push(rewards[k..].iter().sum::<f64>());
        }
    }
    let flat = grpo_advantages(&keys, &to_go, &vec![true; keys.len()], baseline, normalize_std)?;
    let mut values = flat.into_iter();
    Ok(turn_rewards.iter().map(|rewards| values.by_ref().take(rewards.len()).collect()).collect())
}

/// REINFORCE++ advantages: optionally the group mean subtracted, then whitened over all valid
/// tokens of the batch (each sample's advantage counts once per valid token). Samples with
/// no valid tokens get 0.
pub fn reinforce_pp_advantages<K: Hash + Eq>(
    groups: &[K],
    rewards: &[f64],
    valid_tokens: &[usize],
    minus_baseline: bool,
) -> Result<Vec<f64>> {
    check_len("valid_tokens", rewards.len(), valid_tokens.len())?;
    let no_penalty: Vec<Vec<f64>> = valid_tokens.iter().map(|&t| vec![0.0; t]).collect();
    let per_token = reinforce_pp_token_advantages(groups, rewards, &no_penalty, minus_baseline)?;
    Ok(per_token.iter().map(|tokens| tokens.first().copied().unwrap_or(0.0)).collect())
}

/// REINFORCE++ advantages per token with the KL in the reward (NeMo-RL's
/// `use_kl_in_reward`): sample i's token t gets (r_i − its group's mean, when
/// `minus_baseline`) − `penalties[i][t]`, then every valid token of the batch is whitened
/// together. `penalties[i]` holds one entry per valid token of sample i (β·KL_t); the result
/// has the same shape.
pub fn reinforce_pp_token_advantages<K: Hash + Eq>(
    groups: &[K],
    rewards: &[f64],
    penalties: &[Vec<f64>],
    minus_baseline: bool,
) -> Result<Vec<Vec<f64>>> {
    check_len("penalties", rewards.len(), penalties.len())?;
    let base = if minus_baseline {
        let all_valid = vec![true; rewards.len()];
        let stats = group_baseline_and_std(groups, rewards, &all_valid, Baseline::Mean)?;
        rewards.iter().zip(&stats.baseline).map(|(r, b)| r - b).collect::<Vec<_>>()
    } else {
        check_len("groups", rewards.len(), groups.len())?;
        check_rewards(rewards)?;
        rewards.to_vec()
    };
    if let Some((index, value)) =
        penalties.iter().enumerate().find_map(|(i, p)| p.iter().find(|v| !v.is_finite()).map(|v| (i, *v)))
    {
        return Err(Error::NonFinitePenalty { index, value });
    }
    let raw: Vec<Vec<f64>> =
        base.iter().zip(penalties).map(|(b, penalty)| penalty.iter().map(|p| b - p).collect()).collect();
    Ok(crate::gae::whiten(raw))
}

/// Which estimate of KL(policy ‖ reference) per token, from the sampled token's logprobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KlEstimator {
    /// log(π/π_ref).
    K1,
    /// ½·log²(π/π_ref).
    K2,
    /// π_ref/π − 1 − log(π_ref/π) (unbiased, non-negative).
    K3,
}

/// One token's KL estimate as the loss computes it: log r = reference − policy clamped to
/// ±`input_clamp`, the estimator, then the value clamped to ±`output_clamp`.
pub fn kl_estimate(
    policy: f64,
    reference: f64,
    estimator: KlEstimator,
    input_clamp: Option<f64>,
    output_clamp: Option<f64>,
) -> f64 {
    let mut log_r = reference - policy;
    if let Some(c) = input_clamp {
        log_r = log_r.clamp(-c, c);
    }
    let k = match estimator {
        KlEstimator::K1 => -log_r,
        KlEstimator::K2 => 0.5 * log_r * log_r,
        KlEstimator::K3 => log_r.exp() - 1.0 - log_r,
    };
    match output_clamp {
        Some(c) => k.clamp(-c, c),
        None => k,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-9, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn mean_baseline_and_bessel_std_by_hand() {
        // Group "p": rewards 1, 0, 0, 1 → mean 0.5, sample std sqrt(1/3).
        let stats = group_baseline_and_std(&["p"; 4], &[1.0, 0.0, 0.0, 1.0], &[true; 4], Baseline::Mean).unwrap();
        close(&stats.baseline, &[0.5; 4]);
        close(&stats.std, &[(1.0f64 / 3.0).sqrt(); 4]);
        let adv = grpo_advantages(&["p"; 4], &[1.0, 0.0, 0.0, 1.0], &[true; 4], Baseline::Mean, true).unwrap();
        let a = 0.5 / ((1.0f64 / 3.0).sqrt() + STD_EPSILON);
        close(&adv, &[a, -a, -a, a]);
    }

    #[test]
    fn leave_one_out_uses_the_other_samples() {
        // Rewards 3, 1, 2: others of sample 0 are {1, 2} → baseline 1.5, std sqrt(0.5).
        let stats = group_baseline_and_std(&[7, 7, 7], &[3.0, 1.0, 2.0], &[true; 3], Baseline::LeaveOneOut).unwrap();
        close(&stats.baseline, &[1.5, 2.5, 2.0]);
        close(&stats.std, &[0.5f64.sqrt(), 0.5f64.sqrt(), 2.0f64.sqrt()]);
        let adv = grpo_advantages(&[7, 7, 7], &[3.0, 1.0, 2.0], &[true; 3], Baseline::LeaveOneOut, false).unwrap();
        close(&adv, &[1.5, -1.5, 0.0]);
    }

    #[test]
    fn groups_are_independent_and_degenerate_groups_get_zero() {
        let groups = ["a", "b", "a", "c", "c", "c"];
        let rewards = [1.0, 5.0, 0.0, 2.0, 2.0, 2.0];
        let adv = grpo_advantages(&groups, &rewards, &[true; 6], Baseline::LeaveOneOut, true).unwrap();
        // "a": two samples, LOO baselines are each other's reward, std undefined → unnormalised.
        // "b": one sample → 0. "c": all equal → 0 (std 0, no division).
        close(&adv, &[1.0, 0.0, -1.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn invalid_samples_leave_the_baseline() {
        // The invalid sample's reward (100) does not move the others' baseline.
        let adv = grpo_advantages(&[0; 3], &[1.0, 0.0, 100.0], &[true, true, false], Baseline::Mean, false).unwrap();
        close(&adv[..2], &[0.5, -0.5]);
        // One valid sample left: advantage 0.
        let adv = grpo_advantages(&[0; 2], &[1.0, 0.0], &[true, false], Baseline::Mean, true).unwrap();
        close(&adv, &[0.0, 0.0]);
    }

    #[test]
    fn reinforce_pp_whitens_over_tokens() {
        // Without a baseline: rewards 1 (3 tokens) and 0 (1 token): token mean 0.75,
        // token variance 0.1875.
        let adv = reinforce_pp_advantages(&[0, 1], &[1.0, 0.0], &[3, 1], false).unwrap();
        let rstd = 1.0 / 0.1875f64.sqrt();
        close(&adv, &[0.25 * rstd, -0.75 * rstd]);
        // With the group mean removed first, then whitened.
        let adv = reinforce_pp_advantages(&[0, 0, 1, 1], &[1.0, 0.0, 3.0, 3.0], &[1, 1, 1, 1], true).unwrap();
        // Centred: 0.5, -0.5, 0, 0 → token mean 0, variance 0.125.
        let rstd = 1.0 / 0.125f64.sqrt();
        close(&adv, &[0.5 * rstd, -0.5 * rstd, 0.0, 0.0]);
        // All equal: variance floored, advantages 0.
        close(&reinforce_pp_advantages(&[0, 0], &[2.0, 2.0], &[4, 4], false).unwrap(), &[0.0, 0.0]);
    }

    #[test]
    fn bad_inputs_are_named() {
        assert_eq!(
            grpo_advantages(&[0, 0], &[1.0], &[true], Baseline::Mean, true).unwrap_err(),
            Error::LengthMismatch { what: "groups", expected: 1, found: 2 }
        );
        let err = grpo_advantages(&[0, 0], &[1.0, f64::NAN], &[true, true], Baseline::Mean, true).unwrap_err();
        assert!(err.to_string().contains("sample 1"));
        assert!(reinforce_pp_advantages(&[0], &[1.0], &[1, 2], false).is_err());
        let err = reinforce_pp_token_advantages(&[0], &[1.0], &[vec![0.0, f64::INFINITY]], false).unwrap_err();
        assert_eq!(err.to_string(), "KL penalty of sample 0 is not finite (inf)");
    }

    #[test]
    fn turns_are_credited_with_their_reward_to_go_against_the_same_turn() {
        // One group: sample 0 scores 1 then 0, sample 1 scores 0 then 1, sample 2 ends after
        // one turn scoring 0. Turn 0 compares totals 1, 1, 0; turn 1 compares 0 and 1.
        let turns = [vec![1.0, 0.0], vec![0.0, 1.0], vec![0.0]];
        let adv = turn_grpo_advantages(&[7, 7, 7], &turns, Baseline::Mean, false).unwrap();
        let third = 2.0 / 3.0;
        close(&adv[0], &[1.0 - third, -0.5]);
        close(&adv[1], &[1.0 - third, 0.5]);
        close(&adv[2], &[-third]);
        // Single-turn samples get GRPO's advantages.
        let single = turn_grpo_advantages(
            &[0, 0, 1, 1],
            &[vec![1.0], vec![0.0], vec![2.0], vec![3.0]],
            Baseline::LeaveOneOut,
            true,
        )
        .unwrap();
        let grpo =
            grpo_advantages(&[0, 0, 1, 1], &[1.0, 0.0, 2.0, 3.0], &[true; 4], Baseline::LeaveOneOut, true).unwrap();
        close(&single.concat(), &grpo);
    }

    #[test]
    fn kl_in_the_reward_is_per_token_then_whitened() {
        // Rewards 1 and 0 in one group (mean 0.5): sample 0's tokens carry penalties 0 and 0.5,
        // sample 1's one token 0: raw 0.5, 0, -0.5 → mean 0, variance 1/6.
        let adv = reinforce_pp_token_advantages(&[0, 0], &[1.0, 0.0], &[vec![0.0, 0.5], vec![0.0]], true).unwrap();
        let rstd = 6f64.sqrt();
        close(&adv[0], &[0.5 * rstd, 0.0]);
        close(&adv[1], &[-0.5 * rstd]);
        // Zero penalties give the per-sample estimator's values on every token.
        let per_sample = reinforce_pp_advantages(&[0, 0, 1], &[1.0, 0.0, 2.0], &[2, 1, 0], true).unwrap();
        let zero = [vec![0.0; 2], vec![0.0; 1], vec![]];
        let per_token = reinforce_pp_token_advantages(&[0, 0, 1], &[1.0, 0.0, 2.0], &zero, true).unwrap();
        close(&per_token[0], &[per_sample[0]; 2]);
        close(&per_token[1], &[per_sample[1]]);
        assert!(per_token[2].is_empty() && per_sample[2] == 0.0);
    }

    #[test]
    fn kl_estimates_match_their_definitions() {
        let (policy, reference) = (-1.0f64, -1.5f64);
        let log_r = reference - policy;
        close(&[kl_estimate(policy, reference, KlEstimator::K1, None, None)], &[-log_r]);
        close(&[kl_estimate(policy, reference, KlEstimator::K2, None, None)], &[0.5 * log_r * log_r]);
        close(&[kl_estimate(policy, reference, KlEstimator::K3, None, None)], &[log_r.exp() - 1.0 - log_r]);
        // Clamps: log r to ±1 first, then the value to ±0.2.
        close(&[kl_estimate(0.0, -30.0, KlEstimator::K1, Some(1.0), None)], &[1.0]);
        close(&[kl_estimate(0.0, -30.0, KlEstimator::K1, Some(20.0), Some(0.2))], &[0.2]);
    }
}
