//! Asynchronous GRPO (NeMo-RL's `async_grpo`): a producer rolls out the prompts of the next
//! steps on the weights the generators serve while the trainer trains, and hands each
//! step's rollouts over a queue; the trainer's side trains on them as they come.
//!
//! Step t trains the policy of version t−1. The producer rolls out for step t from the
//! newest weights a generator has reported loaded, and only from version t−1−age or newer
//! (`max_trajectory_age_steps`); when those are not there yet it waits (the generator is
//! idle then). So the rollouts of step t+1 run while step t trains, on weights one update
//! old, and with a larger age limit further steps run ahead. The trainer's side checks each
//! trajectory's age again, drops (and counts) those past the limit, and does not wait for the
//! generators to load the weights it sends: they refit between requests (`drain`) or at the
//! next token (`in_flight_weight_updates`), under the rollouts already running.
//!
//! Per step it records the trajectories' ages (`async/trajectory_age_mean`, `_max`, and a
//! count per age, `async/trajectories_age_<k>`), `async/dropped_trajectories`, how long the
//! trainer waited for rollouts (`async/trainer_idle_seconds`) and how long the producer
//! waited for recent enough weights before rolling out the step
//! (`async/generator_idle_seconds`). `timing/train/generator_refit` is that of the weights
//! the previous step sent (it ran during this step's rollouts).

use std::collections::BTreeMap;
use std::time::Instant;

use tokio::sync::{mpsc, watch};
use tracing::Instrument;

use keel_protocol::run::RunSpec;

use super::grpo::{self, Grpo, Inputs, Rollouts, Served};
use super::rollout::Episode;
use super::{Result, RunContext, Stop, seconds};
use crate::data::Dataloader;

/// Runs the steps from `run.weights.1 + 1` to the last, rollouts produced ahead of training.
pub(super) async fn steps(ctx: &RunContext, inputs: &Inputs, run: &mut Grpo, loader: Dataloader) -> Result<()> {
    let max_age = ctx.spec.grpo.async_grpo.max_trajectory_age_steps;
    let first = run.weights.1 + 1;
    let (served, watched) =
        watch::channel(Served { weights: run.weights.clone(), dtype: run.serving_dtype.clone(), refit_seconds: None });
    // The producer is at most `max_age` + 1 steps ahead of the trainer: room for all of them.
    let (sender, receiver) = mpsc::channel(max_age as usize + 1);
    let producer = produce(ctx, inputs, loader, first, watched, sender);
    let consumer = consume(ctx, inputs, run, first, receiver, &served);
    tokio::try_join!(producer, consumer)?;
    // The generators serve the trained policy when the run ends, as after a synchronous one.
    let last = run.weights.1;
    let mut watched = served.subscribe();
    let loaded = tokio::time::timeout(super::REFIT_WAIT, watched.wait_for(|s| s.weights.1 >= last)).await;
    if !matches!(loaded, Ok(Ok(_))) {
        tracing::warn!(run_id = %ctx.id, version = last, "no generator reported the last weights loaded");
    }
    Ok(())
}

/// Rolls out step after step, each from weights no older than its age limit allows, and
/// queues them; ends when the steps or the data run out or the trainer's side is gone.
async fn produce(
    ctx: &RunContext,
    inputs: &Inputs,
    mut loader: Dataloader,
    first: u64,
    mut served: watch::Receiver<Served>,
    queue: mpsc::Sender<Rollouts>,
) -> Result<()> {
    let max_age = ctx.spec.grpo.async_grpo.max_trajectory_age_steps;
    for step in first..=inputs.total {
        let waiting = Instant::now();
        let oldest = (step - 1).saturating_sub(max_age);
        let weights = loop {
            let newest = served.borrow_and_update().weights.clone();
            if newest.1 >= oldest {
                break newest;
            }
            if ctx.stop.guard(served.changed()).await?.is_err() {
                return Ok(());
            }
        };
        let idle = seconds(waiting);
        let span = tracing::info_span!(
            parent: None,
            "grpo.rollouts",
            otel.name = "grpo rollouts",
            run_id = %ctx.id,
            step,
            weight_version = weights.1,
        );
        let Some(mut rollouts) =
            grpo::collect_groups(ctx, inputs, &mut loader, &weights, step).instrument(span).await?
        else {
            return Ok(());
        };
        rollouts.metrics.insert("async/generator_idle_seconds".into(), idle);
        if queue.send(rollouts).await.is_err() {
            return Ok(());
        }
    }
    Ok(())
}

/// Trains each step on the rollouts queued for it, past-age trajectories dropped.
async fn consume(
    ctx: &RunContext,
    inputs: &Inputs,
    run: &mut Grpo,
    first: u64,
    mut queue: mpsc::Receiver<Rollouts>,
    served: &watch::Sender<Served>,
) -> Result<()> {
    let max_age = ctx.spec.grpo.async_grpo.max_trajectory_age_steps;
    for step in first..=inputs.total {
        let started = Instant::now();
        let Some(mut rollouts) = ctx.stop.guard(queue.recv()).await? else {
            tracing::info!(run_id = %ctx.id, step, "the training data is used up");
            break;
        };
        rollouts.metrics.insert("async/trainer_idle_seconds".into(), seconds(started));
        if let Some(refit) = served.borrow().refit_seconds {
            rollouts.metrics.insert("timing/train/generator_refit".into(), refit);
        }
        let ages = keep_young(&ctx.spec, &mut rollouts, step - 1);
        if rollouts.episodes.is_empty() {
            return Err(Stop::Failed(format!(
                "step {step}: every trajectory is older than grpo.async_grpo.max_trajectory_age_steps ({max_age})"
            )));
        }
        rollouts.metrics.extend(ages);
        let span = grpo::step_span(ctx, inputs, step);
        grpo::train_step(ctx, inputs, run, step, rollouts, started, Some(served)).instrument(span).await?;
    }
    Ok(())
}

/// Drops the groups of trajectories older than the age limit against the trainer's
/// `version` (and then as many more as keep whole global batches), and returns the age
/// metrics: mean, max, a count per age and the number dropped.
fn keep_young(spec: &RunSpec, rollouts: &mut Rollouts, version: u64) -> BTreeMap<String, f64> {
    let max_age = spec.grpo.async_grpo.max_trajectory_age_steps;
    let age = |e: &Episode| version.saturating_sub(e.weight_version);
    let episodes = std::mem::take(&mut rollouts.episodes);
    let ages: Vec<u64> = episodes.iter().map(age).collect();
    let oldest = ages.iter().copied().max().unwrap_or(0);
    let mut metrics = BTreeMap::new();
    metrics.insert("async/trajectory_age_mean".into(), ages.iter().sum::<u64>() as f64 / ages.len().max(1) as f64);
    metrics.insert("async/trajectory_age_max".into(), oldest as f64);
    for k in 0..=max_age.max(oldest) {
        let count = ages.iter().filter(|&&a| a == k).count();
        metrics.insert(format!("async/trajectories_age_{k}"), count as f64);
    }
    // A group's samples share their weights; one too old drops its group.
    let mut groups: BTreeMap<usize, Vec<Episode>> = BTreeMap::new();
    for e in episodes {
        groups.entry(e.group).or_default().push(e);
    }
    let mut kept: Vec<Vec<Episode>> = groups.into_values().filter(|g| g.iter().all(|e| age(e) <= max_age)).collect();
    grpo::whole_batches(spec, &mut kept);
    rollouts.episodes = kept.into_iter().flatten().collect();
    metrics.insert("async/dropped_trajectories".into(), (ages.len() - rollouts.episodes.len()) as f64);
    metrics
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Groups of 2 samples, global batches of 4 rows, trajectories up to 1 update old.
    fn spec() -> RunSpec {
        let mut spec: RunSpec = serde_json::from_value(serde_json::json!({
            "algorithm": "grpo", "model": {"path": "/m"}, "data": {"train": {"kind": "arithmetic"}},
            "training": {"loss": {"type": "clipped_pg"}, "global_batch_size": 4, "micro_batch_size": 2},
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        spec.grpo.async_grpo.max_trajectory_age_steps = 1;
        spec
    }

    /// Groups of 2 samples from the given weight versions, as one step's rollouts.
    fn rollouts(versions: &[u64]) -> Rollouts {
        let episodes = versions
            .iter()
            .enumerate()
            .flat_map(|(g, &v)| [Episode::for_test(g, v), Episode::for_test(g, v)])
            .collect();
        Rollouts { episodes, metrics: BTreeMap::new(), position: Default::default() }
    }

    #[test]
    fn trajectories_past_the_age_limit_are_dropped_with_their_group_and_counted() {
        // The trainer is at version 5 with an age limit of 1: versions 4 and 5 are young
        // enough, 3 is not; whole global batches of 4 rows are kept.
        let mut step = rollouts(&[5, 3, 4, 4, 3]);
        let metrics = keep_young(&spec(), &mut step, 5);
        let kept: Vec<(usize, u64)> = step.episodes.iter().map(|e| (e.group, e.weight_version)).collect();
        // Three young groups (6 rows) make one batch of 4: the first two, renumbered.
        assert_eq!(kept, [(0, 5), (0, 5), (1, 4), (1, 4)]);
        assert_eq!(metrics["async/dropped_trajectories"], 6.0);
        assert_eq!(metrics["async/trajectory_age_max"], 2.0);
        assert_eq!(metrics["async/trajectory_age_mean"], (0.0 * 2.0 + 2.0 * 4.0 + 1.0 * 4.0) / 10.0);
        let counts: Vec<f64> = (0..3).map(|k| metrics[&format!("async/trajectories_age_{k}")]).collect();
        assert_eq!(counts, [2.0, 4.0, 4.0]);
        // All young: nothing dropped.
        let mut young = rollouts(&[5, 4]);
        assert_eq!(keep_young(&spec(), &mut young, 5)["async/dropped_trajectories"], 0.0);
        assert_eq!(young.episodes.len(), 4);
    }
}
