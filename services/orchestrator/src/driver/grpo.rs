//! The GRPO step, as NeMo-RL runs it (ARCHITECTURE.md, "One GRPO step"): prompts ×
//! generations → (multi-turn) rollouts → rewards (overlong shaping) → dynamic sampling →
//! group advantages → policy and reference logprobs on the trainer → train → weights to the
//! generators (weights only, exported in buckets and loaded in place; the step goes on when a
//! generator serves them) → validation → record → checkpoint (saved on the checkpoint period
//! only). Phases are timed under NeMo-RL's names (`timing/train/generation`, ...). In
//! colocated mode the generators sleep while the trainer has the device.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use tracing::Instrument;

use keel_algorithms::{Baseline, grpo_advantages, reinforce_pp_advantages};
use keel_protocol::generator::{MemoryAction, Sampling};
use keel_protocol::run::{AdvantageEstimator, Algorithm, RunSpec, WeightTransfer};
use keel_protocol::trainer::{LogprobsReply, LogprobsRequest, Scorer, Sequences, TrainBatch, TrainReply, TrainRequest};

use super::rollout::{self, Episode, Settings};
use super::tokens::Prompting;
use super::{REFIT_WAIT, Result, RunContext, Stop, seconds};
use crate::data::{self, Dataloader, Record};
use crate::db::StepRecord;

/// Weight directories kept on disk (a generator may still be loading the previous one).
const WEIGHT_DIRS_KEPT: usize = 2;

pub async fn run(ctx: &RunContext) -> Result<()> {
    let colocated = ctx.spec.generation.colocated.enabled;
    let result = steps(ctx).await;
    if colocated {
        // The generators serve again whatever became of the run (they may have been put to
        // sleep for a training turn that never ended).
        if let Err(e) = ctx.generator_memory(MemoryAction::Wake).await {
            tracing::warn!(run_id = %ctx.id, "cannot wake the generators at the end of the run: {e:?}");
        }
    }
    result
}

async fn steps(ctx: &RunContext) -> Result<()> {
    let spec = &ctx.spec;
    let colocated = spec.generation.colocated.enabled;
    let train = data::load_async(&spec.data.train, Algorithm::Grpo, "data.train").await?;
    let validation = match &spec.data.validation {
        Some(d) => data::load_async(d, Algorithm::Grpo, "data.validation").await?,
        None => Vec::new(),
    };
    let start = ctx.start().await?;
    let prompting = Prompting::load(&start.base_dir, &spec.prompt, spec.max_total_sequence_length)?;
    let loaded = ctx.load_trainer(&start).await?;
    let prompts = spec.grpo.num_prompts_per_step;
    let mut loader = Dataloader::new(train.len(), spec.seed, spec.data.shuffle, spec.max_num_epochs, start.position);
    let total = spec.max_num_steps.min(start.step + loader.batches_left(prompts));
    ctx.set_total_steps(total).await?;
    let mut weights = (start.policy_dir.clone(), start.step);
    if colocated {
        // A run taken over from an orchestrator that died may find its generators asleep.
        ctx.generator_memory(MemoryAction::Wake).await?;
    }
    ctx.publish_weights(&weights.0, weights.1).await?;
    if !start.resumed && !validation.is_empty() {
        rollout::record_baseline(ctx, &prompting, &validation, weights.clone()).await?;
    }
    let mut saved: Vec<PathBuf> = Vec::new();
    let mut serving_dtype: Option<String> = None;
    let mut exported: std::collections::VecDeque<keel_protocol::generator::WeightBuckets> = Default::default();
    for step in start.step + 1..=total {
        ctx.stop.check()?;
        // One trace per step: a root span, whatever span the driver runs in.
        let span = tracing::info_span!(
            parent: None,
            "grpo.step",
            otel.name = "grpo step",
            run_id = %ctx.id,
            step,
            total_steps = total,
            prompts = prompts,
            sequences = tracing::field::Empty,
            tokens = tracing::field::Empty,
        );
        let more = async {
            let started = Instant::now();
            let mut metrics = BTreeMap::new();
            let collected = collect_groups(ctx, &prompting, &train, &mut loader, &weights, step, &mut metrics)
                .instrument(tracing::info_span!("rollouts", step))
                .await?;
            let Some(batch) = collected else {
                tracing::info!(run_id = %ctx.id, step, "the training data is used up");
                return Ok(false);
            };
            let rows = to_train_batch(spec, &batch)?;
            let current = tracing::Span::current();
            current.record("sequences", rows.input_ids.len());
            current.record("tokens", rows.input_ids.iter().map(Vec::len).sum::<usize>());

            if colocated {
                // The trainer's turn on the GPUs: the generators free them.
                let phase = Instant::now();
                ctx.generator_memory(MemoryAction::Sleep).instrument(tracing::info_span!("generator_sleep")).await?;
                metrics.insert("timing/train/generator_sleep".into(), seconds(phase));
                let phase = Instant::now();
                ctx.trainer_memory(false).instrument(tracing::info_span!("trainer_onload")).await?;
                metrics.insert("timing/train/trainer_onload".into(), seconds(phase));
            }
            ctx.stop.check()?;
            let phase = Instant::now();
            let trainer = ctx.trainer()?;
            let sequences = Sequences { input_ids: rows.input_ids.clone() };
            let temperature = spec.generation.temperature;
            let (prev, reference) = async {
                let prev = logprobs(ctx, Scorer::Policy, &sequences, temperature).await?;
                let reference = if loaded.has_reference {
                    Some(logprobs(ctx, Scorer::Reference, &sequences, temperature).await?)
                } else {
                    None
                };
                Ok::<_, Stop>((prev, reference))
            }
            .instrument(tracing::info_span!("policy_and_reference_logprobs", sequences = sequences.input_ids.len()))
            .await?;
            metrics.insert("timing/train/policy_and_reference_logprobs".into(), seconds(phase));

            ctx.stop.check()?;
            let phase = Instant::now();
            let trained: TrainReply = async {
                let batch_body = TrainBatch { prev_logprobs: Some(prev), reference_logprobs: reference, ..rows };
                let request = TrainRequest {
                    run_id: ctx.id.to_string(),
                    batch: trainer.bulk().wrap(batch_body).await?,
                    temperature,
                };
                Ok::<_, Stop>(trainer.op(&request).await?)
            }
            .instrument(tracing::info_span!("policy_training"))
            .await?;
            metrics.insert("timing/train/policy_training".into(), seconds(phase));
            metrics.extend(mean_step_metrics(&trained, "train"));
            if colocated {
                let phase = Instant::now();
                ctx.trainer_memory(true).instrument(tracing::info_span!("trainer_offload")).await?;
                metrics.insert("timing/train/trainer_offload".into(), seconds(phase));
            }

            // Weights only, in memory: the trainer exports them in buckets to the object
            // store and the generators load them in place. Checkpoints are saved on the
            // checkpoint period only. The phase ends when a generator serves the new
            // version (as NeMo-RL's refit does), so that its loading is not counted as
            // generation.
            let phase = Instant::now();
            let dir = weights_dir(&ctx.run_dir, step);
            let transfer = spec.generation.weight_transfer;
            let in_memory = transfer != WeightTransfer::Directory;
            let report = async {
                let announcement = if in_memory {
                    let shared_memory = transfer == WeightTransfer::SharedMemory;
                    let (export, announcement) =
                        ctx.publish_exported_weights(step, shared_memory, serving_dtype.as_deref()).await?;
                    if let Some(seconds) = export.timing.get("export") {
                        metrics.insert("timing/train/trainer_export".into(), *seconds);
                    }
                    exported.push_back(export.weights);
                    announcement
                } else {
                    ctx.save(&dir, step, loader.position()).await?;
                    saved.push(dir.clone());
                    ctx.publish_weights(&dir, step).await?
                };
                announcement.first_report(REFIT_WAIT).await
            }
            .instrument(tracing::info_span!("weight_sync", version = step))
            .await?;
            match report {
                Some(report) if report.error.is_none() => {
                    metrics.insert("timing/train/generator_refit".into(), report.seconds);
                    // Later exports are cast to what the generator serves.
                    if report.dtype.is_some() {
                        serving_dtype = report.dtype;
                    }
                }
                Some(report) => tracing::warn!(
                    run_id = %ctx.id, step, "a generator could not load the new weights: {}",
                    report.error.unwrap_or_default()
                ),
                None => tracing::warn!(
                    run_id = %ctx.id, step, "no generator reported the new weights loaded within {REFIT_WAIT:?}"
                ),
            }
            weights = (dir.clone(), step);
            // The previous version stays for generators still loading it.
            while exported.len() > 2 {
                if let Some(old) = exported.pop_front() {
                    ctx.delete_exported(&old).await;
                }
            }
            metrics.insert("timing/train/weight_sync".into(), seconds(phase));

            if colocated {
                // The generators' turn: the pool back (the new weights are already in).
                let phase = Instant::now();
                ctx.generator_memory(MemoryAction::Wake).instrument(tracing::info_span!("generator_wake")).await?;
                metrics.insert("timing/train/generator_wake".into(), seconds(phase));
            }
            let mut samples: Vec<_> =
                batch.iter().take(spec.grpo.samples_to_record).map(|e| e.sample(step, "train")).collect();
            let last = step == total;
            if !validation.is_empty() && ctx.validates_at(step, last) {
                rollout::validate_step(ctx, &prompting, &validation, weights.clone(), step, &mut metrics, &mut samples)
                    .instrument(tracing::info_span!("validation", prompts = validation.len()))
                    .await?;
            }
            metrics.insert("timing/train/total_step_time".into(), seconds(started));
            let record = StepRecord {
                step,
                metrics: metrics.clone(),
                samples,
                dataloader: serde_json::to_value(loader.position()).unwrap_or_default(),
            };
            ctx.record(&record).instrument(tracing::info_span!("record", metrics = record.metrics.len())).await?;
            if ctx.saves_at(step, last) {
                if in_memory {
                    ctx.save(&dir, step, loader.position()).instrument(tracing::info_span!("checkpoint_save")).await?;
                    saved.push(dir.clone());
                }
                ctx.upload_checkpoint(&dir, step, loader.position(), metrics)
                    .instrument(tracing::info_span!("checkpoint_upload"))
                    .await?;
            }
            prune(&mut saved);
            Ok::<_, Stop>(true)
        }
        .instrument(span)
        .await?;
        if !more {
            break;
        }
    }
    for old in exported {
        ctx.delete_exported(&old).await;
    }
    Ok(())
}

/// Removes weight directories but the newest few.
fn prune(saved: &mut Vec<PathBuf>) {
    while saved.len() > WEIGHT_DIRS_KEPT {
        let old = saved.remove(0);
        if let Err(e) = std::fs::remove_dir_all(&old) {
            tracing::warn!("cannot remove {}: {e}", old.display());
        }
    }
}

/// Rollouts until `num_prompts_per_step` groups are kept. With dynamic sampling, groups
/// whose rewards all agree are set aside and more prompts drawn, for up to `max_rounds`
/// rounds; set-aside groups fill what is still missing after that. Rewards are shaped,
/// and timing and rollout metrics written into `metrics`. None when the data ran out.
async fn collect_groups(
    ctx: &RunContext,
    prompting: &Prompting,
    train: &[Record],
    loader: &mut Dataloader,
    weights: &(PathBuf, u64),
    step: u64,
    metrics: &mut BTreeMap<String, f64>,
) -> Result<Option<Vec<Episode>>> {
    let spec = &ctx.spec;
    let g = &spec.grpo;
    let settings = Settings {
        n: g.num_generations_per_prompt,
        sampling: Sampling {
            temperature: spec.generation.temperature,
            top_p: spec.generation.top_p,
            top_k: spec.generation.top_k,
            min_p: 0.0,
            seed: None,
        },
        max_new_tokens: spec.generation.max_new_tokens,
        max_turns: g.max_rollout_turns,
        weights: weights.clone(),
    };
    let rounds = if g.dynamic_sampling.enabled { g.dynamic_sampling.max_rounds } else { 1 };
    let (mut kept, mut set_aside): (Vec<Vec<Episode>>, Vec<Vec<Episode>>) = (Vec::new(), Vec::new());
    let (mut generation, mut reward, mut all) = (0.0, 0.0, Vec::new());
    for round in 0..rounds {
        let need = g.num_prompts_per_step - kept.len();
        let Some(indices) = loader.next_batch(need) else { break };
        let records: Vec<&Record> = indices.iter().map(|&i| &train[i]).collect();
        let seed = spec.seed.wrapping_mul(1_000_003).wrapping_add(step * 10_007).wrapping_add(u64::from(round));
        let (mut episodes, timing) = rollout::rollout(ctx, prompting, &records, &settings, seed).await?;
        generation += timing.generation;
        reward += timing.reward;
        if let Some(shaping) = &g.overlong_shaping {
            let free = spec.generation.max_new_tokens.saturating_sub(shaping.buffer);
            for e in &mut episodes {
                let over = e.generated.saturating_sub(free) as f64 / shaping.buffer as f64;
                e.reward -= over.min(1.0) * shaping.penalty;
            }
        }
        all.extend(episodes.iter().cloned());
        let mut groups: Vec<Vec<Episode>> = vec![Vec::new(); records.len()];
        for e in episodes {
            groups[e.group].push(e);
        }
        for group in groups {
            let agree = group.windows(2).all(|w| (w[0].reward - w[1].reward).abs() < 1e-9);
            if g.dynamic_sampling.enabled && agree {
                set_aside.push(group);
            } else {
                kept.push(group);
            }
        }
        if kept.len() >= g.num_prompts_per_step {
            break;
        }
    }
    if all.is_empty() {
        return Ok(None);
    }
    if g.dynamic_sampling.enabled {
        metrics.insert("train/dynamic_sampling_kept_groups".into(), kept.len() as f64);
    }
    while kept.len() < g.num_prompts_per_step {
        match set_aside.pop() {
            Some(group) => kept.push(group),
            None => break,
        }
    }
    let rows = kept.len() * g.num_generations_per_prompt;
    let global = spec.training.as_ref().map_or(rows, |t| t.global_batch_size.max(1));
    kept.truncate(rows / global * global / g.num_generations_per_prompt.max(1));
    if kept.is_empty() {
        return Ok(None);
    }
    for (k, group) in kept.iter_mut().enumerate() {
        for e in group {
            e.group = k;
        }
    }
    metrics.insert("timing/train/generation".into(), generation);
    metrics.insert("timing/train/reward_calculation".into(), reward);
    let generated: usize = all.iter().map(|e| e.generated).sum();
    if generation > 0.0 {
        metrics.insert("performance/generation_tokens_per_second".into(), generated as f64 / generation);
    }
    for (name, value) in rollout::rollout_metrics(&all) {
        metrics.insert(format!("train/{name}"), value);
    }
    Ok(Some(kept.into_iter().flatten().collect()))
}

/// The training batch of the kept episodes: advantages over each prompt's group (every
/// sample counts in the baseline; truncated ones are masked out of the loss when overlong
/// filtering is on, skipped ones always).
fn to_train_batch(spec: &RunSpec, episodes: &[Episode]) -> Result<TrainBatch> {
    let g = &spec.grpo;
    let groups: Vec<usize> = episodes.iter().map(|e| e.group).collect();
    let rewards: Vec<f64> = episodes.iter().map(|e| e.reward).collect();
    let advantages = match g.advantage_estimator {
        AdvantageEstimator::Grpo => {
            let baseline = if g.use_leave_one_out_baseline { Baseline::LeaveOneOut } else { Baseline::Mean };
            grpo_advantages(&groups, &rewards, &vec![true; episodes.len()], baseline, g.normalize_rewards)
        }
        AdvantageEstimator::ReinforcePlusPlus => {
            let tokens: Vec<usize> = episodes.iter().map(|e| e.mask.iter().filter(|&&m| m > 0.0).count()).collect();
            reinforce_pp_advantages(&groups, &rewards, &tokens, g.normalize_rewards)
        }
    }
    .map_err(|e| Stop::Failed(format!("advantages: {e}")))?;
    let sample_mask =
        episodes.iter().map(|e| if e.skipped || (g.overlong_filtering && e.truncated) { 0.0 } else { 1.0 }).collect();
    Ok(TrainBatch {
        input_ids: episodes.iter().map(|e| e.ids.clone()).collect(),
        token_mask: episodes.iter().map(|e| e.mask.clone()).collect(),
        sample_mask: Some(sample_mask),
        advantages: Some(advantages.into_iter().map(|a| a as f32).collect()),
        generation_logprobs: Some(episodes.iter().map(|e| e.gen_logprobs.clone()).collect()),
        prev_logprobs: None,
        reference_logprobs: None,
    })
}

async fn logprobs(ctx: &RunContext, model: Scorer, sequences: &Sequences, temperature: f64) -> Result<Vec<Vec<f32>>> {
    let trainer = ctx.trainer()?;
    let request = LogprobsRequest {
        run_id: ctx.id.to_string(),
        model,
        batch: trainer.bulk().wrap(sequences.clone()).await?,
        temperature,
    };
    let reply: LogprobsReply = trainer.op(&request).await?;
    Ok(trainer.bulk().fetch(reply.logprobs).await?.logprobs)
}

/// Each metric averaged over the optimiser steps of one train call, prefixed.
pub fn mean_step_metrics(reply: &TrainReply, prefix: &str) -> BTreeMap<String, f64> {
    let mut sums: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for step in &reply.steps {
        for (name, value) in &step.metrics {
            let entry = sums.entry(format!("{prefix}/{name}")).or_default();
            entry.0 += value;
            entry.1 += 1.0;
        }
    }
    sums.into_iter().map(|(name, (sum, n))| (name, sum / n)).collect()
}

/// The directory a run's weights are saved to after `step`.
pub fn weights_dir(run_dir: &Path, step: u64) -> PathBuf {
    run_dir.join("weights").join(format!("step-{step}"))
}
