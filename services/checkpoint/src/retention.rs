//! Which checkpoints of a run retention keeps: the latest (highest step, then newest), and
//! the `keep_top_k` best by the metric, ties going to the newer. Checkpoints without the
//! metric are not ranked: they stay only while they are the latest.

use keel_protocol::checkpoint::{Checkpoint, Retention};
use uuid::Uuid;

use std::cmp::Ordering;

/// Orders by step, then by age: the greater is the newer.
fn newer(a: &Checkpoint, b: &Checkpoint) -> Ordering {
    (a.step, a.created_at).partial_cmp(&(b.step, b.created_at)).unwrap_or(Ordering::Equal)
}

/// The latest checkpoint (highest step, then newest).
pub fn latest(checkpoints: &[Checkpoint]) -> Option<&Checkpoint> {
    checkpoints.iter().max_by(|a, b| newer(a, b))
}

/// The checkpoints that have `metric`, best first, ties going to the newer.
pub fn ranked<'a>(checkpoints: &'a [Checkpoint], metric: &str, higher_is_better: bool) -> Vec<&'a Checkpoint> {
    let mut ranked: Vec<&Checkpoint> = checkpoints.iter().filter(|c| c.metrics.contains_key(metric)).collect();
    ranked.sort_by(|a, b| {
        let (x, y) = (a.metrics[metric], b.metrics[metric]);
        let better = if higher_is_better { y.total_cmp(&x) } else { x.total_cmp(&y) };
        better.then_with(|| newer(b, a))
    });
    ranked
}

/// The checkpoints to delete (those not kept), oldest first.
pub fn to_delete(checkpoints: &[Checkpoint], policy: &Retention) -> Vec<Uuid> {
    let Some(latest) = latest(checkpoints) else { return Vec::new() };
    let ranked = ranked(checkpoints, &policy.metric, policy.higher_is_better);
    let mut keep: Vec<Uuid> = ranked.iter().take(policy.keep_top_k).map(|c| c.id).collect();
    keep.push(latest.id);
    checkpoints.iter().filter(|c| !keep.contains(&c.id)).map(|c| c.id).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn ckpt(n: u8, step: u64, created_at: f64, metric: Option<f64>) -> Checkpoint {
        Checkpoint {
            id: Uuid::from_bytes([n; 16]),
            run_id: "r".into(),
            step,
            status: "complete".into(),
            metrics: metric.map(|m| BTreeMap::from([("acc".to_string(), m)])).unwrap_or_default(),
            info: serde_json::Value::Null,
            files: vec![],
            missing: vec![],
            created_at,
        }
    }

    fn policy(k: usize, higher: bool) -> Retention {
        Retention { keep_top_k: k, metric: "acc".into(), higher_is_better: higher }
    }

    fn ids(ns: &[u8]) -> Vec<Uuid> {
        ns.iter().map(|n| Uuid::from_bytes([*n; 16])).collect()
    }

    #[test]
    fn top_k_plus_latest_with_ties_to_the_newer() {
        let all = [
            ckpt(1, 10, 1.0, Some(0.5)),
            ckpt(2, 20, 2.0, Some(0.9)),
            ckpt(3, 30, 3.0, Some(0.5)),
            ckpt(4, 40, 4.0, Some(0.1)),
        ];
        // Top 2 by accuracy: 2 (0.9), then 3 (0.5, newer than 1); 4 is the latest.
        assert_eq!(to_delete(&all, &policy(2, true)), ids(&[1]));
        // Lower is better: 4 (0.1) and 3 (0.5, newer than 1); 4 is also the latest.
        assert_eq!(to_delete(&all, &policy(2, false)), ids(&[1, 2]));
        // k = 0 keeps only the latest.
        assert_eq!(to_delete(&all, &policy(0, true)), ids(&[1, 2, 3]));
    }

    #[test]
    fn the_latest_is_kept_even_without_the_metric() {
        let all = [ckpt(1, 1, 1.0, Some(0.9)), ckpt(2, 2, 2.0, Some(0.8)), ckpt(3, 3, 3.0, None)];
        assert_eq!(to_delete(&all, &policy(1, true)), ids(&[2]));
        // The same step written twice: the newer one is the latest.
        let twice = [ckpt(1, 5, 1.0, Some(0.1)), ckpt(2, 5, 2.0, Some(0.1))];
        assert_eq!(to_delete(&twice, &policy(0, true)), ids(&[1]));
        assert!(to_delete(&[], &policy(1, true)).is_empty());
    }
}
