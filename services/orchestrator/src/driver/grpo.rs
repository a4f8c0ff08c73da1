//! The GRPO step, as NeMo-RL runs it (ARCHITECTURE.md, "One GRPO step"): prompts ×
//! generations → (multi-turn) rollouts → rewards (overlong shaping) → dynamic sampling →
//! group advantages → policy and reference logprobs on the trainer → train → weights to the
//! generators (weights only, exported in buckets and loaded in place; the step goes on when a
//! generator serves them) → validation → record → checkpoint (saved on the checkpoint period
//! only). Phases are timed under NeMo-RL's names (`timing/train/generation`, ...). In
//! colocated mode the generators sleep while the trainer has the device.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::time::Instant;

use tokio::sync::watch;
use tracing::Instrument;

use keel_algorithms::{
    Baseline, KlEstimator, gae, grpo_advantages, kl_estimate, reinforce_pp_advantages, reinforce_pp_token_advantages,
    turn_grpo_advantages,
};
use keel_protocol::generator::{MemoryAction, Sampling, WeightBuckets, WeightsLoaded};
use keel_protocol::run::{AdvantageEstimator, Algorithm, PpoSpec, RunSpec, WeightTransfer};
use keel_protocol::trainer::{Advantages, Scorer, Sequences, TrainBatch, TrainReply};
use keel_protocol::training::{ClippedPgConfig, KlType, LossConfig};

use super::rollout::{self, Episode, Settings};
use super::session::TrainerSession;
use super::tokens::Prompting;
use super::{REFIT_WAIT, Result, RunContext, Stop, seconds};
use crate::data::{self, Dataloader, Position, Record};
use crate::db::StepRecord;

/// Weight directories kept on disk (a generator may still be loading the previous one).
const WEIGHT_DIRS_KEPT: usize = 2;

pub async fn run(ctx: &RunContext) -> Result<()> {
    let colocated = ctx.spec.generation.colocated.enabled;
    let result = steps(ctx).await;
    if colocated {
        // The generators serve again whatever became of the run (they may have been put to
        // sleep for a training turn that never ended).
        if let Err(e) = ctx.weights.generator_memory(MemoryAction::Wake).await {
            tracing::warn!(run_id = %ctx.id, "cannot wake the generators at the end of the run: {e:?}");
        }
    }
    result
}

/// What the run reads from step to step.
pub(super) struct Inputs {
    pub prompting: Prompting,
    /// The training records, read from their files as batches need them.
    pub train: std::sync::Arc<data::Source>,
    pub validation: Vec<Record>,
    pub has_reference: bool,
    pub total: u64,
}

/// What the steps move on.
pub(super) struct Grpo {
    /// The weights the generators serve (or, in an async run, were last sent): their
    /// directory (for directory transfers and checkpoints) and version.
    pub weights: (PathBuf, u64),
    /// Where the dataloader stands after the prompts of the last step trained (checkpoints
    /// resume from there).
    pub position: Position,
    /// Weight directories saved, oldest first ([`prune`] keeps the newest few).
    saved: Vec<PathBuf>,
    /// What the generators said they serve in: later exports are cast to it.
    pub serving_dtype: Option<String>,
    /// Exports generators may still be loading (deleted once two newer ones exist).
    exported: VecDeque<WeightBuckets>,
}

/// A step's rollouts, ready to train: the kept episodes, the rollout metrics and timings,
/// and where the dataloader stood after drawing their prompts.
pub(super) struct Rollouts {
    pub episodes: Vec<Episode>,
    pub metrics: BTreeMap<String, f64>,
    pub position: Position,
}

/// What the generators serve, as the run last heard.
#[derive(Debug, Clone)]
pub(super) struct Served {
    /// Directory and version of the newest weights a generator loaded (or was not heard
    /// from about in time).
    pub weights: (PathBuf, u64),
    /// The dtype the generators serve in, once one said.
    pub dtype: Option<String>,
    /// How long the last refit took, when a generator reported it.
    pub refit_seconds: Option<f64>,
}

/// A step's metrics; each phase is timed under NeMo-RL's `timing/train/<phase>` name.
#[derive(Default)]
struct StepMetrics(BTreeMap<String, f64>);

impl StepMetrics {
    /// Runs `work` in `span` and records its time as `timing/train/<phase>`.
    async fn timed<T>(
        &mut self,
        phase: &str,
        span: tracing::Span,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let started = Instant::now();
        let out = work.instrument(span).await?;
        self.0.insert(format!("timing/train/{phase}"), seconds(started));
        Ok(out)
    }
}

async fn steps(ctx: &RunContext) -> Result<()> {
    let (inputs, mut run, loader) = prepare(ctx).await?;
    let result = if ctx.spec.grpo.async_grpo.enabled {
        super::async_grpo::steps(ctx, &inputs, &mut run, loader).await
    } else {
        synchronous(ctx, &inputs, &mut run, loader).await
    };
    for old in run.exported.drain(..) {
        ctx.weights.delete_exported(&old).await;
    }
    result
}

/// Each step rolls out on the weights the previous one trained.
async fn synchronous(ctx: &RunContext, inputs: &Inputs, run: &mut Grpo, mut loader: Dataloader) -> Result<()> {
    for step in run.weights.1 + 1..=inputs.total {
        ctx.stop.check()?;
        let started = Instant::now();
        let span = step_span(ctx, inputs, step);
        let rollouts = collect_groups(ctx, inputs, &mut loader, &run.weights, step)
            .instrument(tracing::info_span!(parent: &span, "rollouts", step))
            .await?;
        let Some(rollouts) = rollouts else {
            tracing::info!(run_id = %ctx.id, step, "the training data is used up");
            break;
        };
        train_step(ctx, inputs, run, step, rollouts, started, None).instrument(span).await?;
    }
    Ok(())
}

/// One trace per step: a root span, whatever span the driver runs in.
pub(super) fn step_span(ctx: &RunContext, inputs: &Inputs, step: u64) -> tracing::Span {
    tracing::info_span!(
        parent: None,
        "grpo.step",
        otel.name = "grpo step",
        run_id = %ctx.id,
        step,
        total_steps = inputs.total,
        prompts = ctx.spec.grpo.num_prompts_per_step,
        sequences = tracing::field::Empty,
        tokens = tracing::field::Empty,
    )
}

/// Loads the data, the prompting, the trainer and the generators, and
/// records the baseline validation of a new run. The weights' version is the step the run
/// starts after.
async fn prepare(ctx: &RunContext) -> Result<(Inputs, Grpo, Dataloader)> {
    let spec = &ctx.spec;
    let train =
        std::sync::Arc::new(data::open_async(&spec.data.train, Algorithm::Grpo, "data.train", &ctx.run_dir).await?);
    let validation = match &spec.data.validation {
        Some(d) => data::load_async(d, Algorithm::Grpo, "data.validation").await?,
        None => Vec::new(),
    };
    let start = ctx.start().await?;
    let prompting = Prompting::load(&start.base_dir, &spec.prompt, spec.max_total_sequence_length)?;
    let loaded = ctx.session()?.load(&start).await?;
    let prompts = spec.grpo.num_prompts_per_step;
    let loader = Dataloader::new(train.len(), spec.seed, spec.data.shuffle, spec.max_num_epochs, start.position);
    let total = spec.max_num_steps.min(start.step + loader.batches_left(prompts));
    ctx.store.set_total_steps(total).await?;
    let weights = (start.policy_dir.clone(), start.step);
    // The generators load the run's model afresh (awake, whatever a run taken over from an
    // orchestrator that died left them in).
    ctx.load_generators(&start).await?;
    if !start.resumed && !validation.is_empty() {
        rollout::record_baseline(ctx, &prompting, &validation, weights.clone()).await?;
    }
    let inputs = Inputs { prompting, train, validation, has_reference: loaded.has_reference, total };
    let run =
        Grpo { weights, position: start.position, saved: Vec::new(), serving_dtype: None, exported: VecDeque::new() };
    Ok((inputs, run, loader))
}

/// A step on its rollouts: train, weights to the generators, validation, record,
/// checkpoint. `started` is when the step began (its rollouts included in a synchronous
/// run). An async run passes what the generators serve, to be told of the new weights when
/// one reports them loaded (the step does not wait for that).
pub(super) async fn train_step(
    ctx: &RunContext,
    inputs: &Inputs,
    run: &mut Grpo,
    step: u64,
    rollouts: Rollouts,
    started: Instant,
    served: Option<&watch::Sender<Served>>,
) -> Result<()> {
    let Rollouts { episodes, metrics, position } = rollouts;
    let mut metrics = StepMetrics(metrics);
    run.position = position;
    let rows = to_train_batch(&ctx.spec, &episodes)?;
    let current = tracing::Span::current();
    current.record("sequences", rows.input_ids.len());
    current.record("tokens", rows.input_ids.iter().map(Vec::len).sum::<usize>());
    let trained = train(ctx, inputs, rows, &episodes, &mut metrics).await?;
    metrics.0.extend(mean_step_metrics(&trained, "train"));
    let dir = weights_dir(&ctx.run_dir, step);
    sync_weights(ctx, run, &dir, step, &mut metrics, served).await?;
    let mut samples: Vec<_> =
        episodes.iter().take(ctx.spec.grpo.samples_to_record).map(|e| e.sample(step, "train")).collect();
    let last = step == inputs.total;
    if !inputs.validation.is_empty() && ctx.validates_at(step, last) {
        if let Some(served) = served {
            // Validation scores the new weights: an async run waits for a generator to serve them.
            let mut watched = served.subscribe();
            ctx.stop
                .guard(watched.wait_for(|s| s.weights.1 >= step))
                .await?
                .map(drop)
                .map_err(|_| Stop::Failed("the weights watch closed".into()))?;
        }
        let weights = run.weights.clone();
        let prompting = &inputs.prompting;
        rollout::validate_step(ctx, prompting, &inputs.validation, weights, step, &mut metrics.0, &mut samples).await?;
    }
    metrics.0.insert("timing/train/total_step_time".into(), seconds(started));
    let metrics = metrics.0;
    let record = StepRecord {
        step,
        metrics: metrics.clone(),
        samples,
        dataloader: serde_json::to_value(run.position).unwrap_or_default(),
    };
    ctx.store.record(&record).instrument(tracing::info_span!("record", metrics = record.metrics.len())).await?;
    if ctx.saves_at(step, last) {
        checkpoint(ctx, run, &dir, step, metrics).await?;
    }
    prune(&mut run.saved).await;
    Ok(())
}

/// The trainer's turn: the policy's (and reference's) logprobs before the update, then the
/// update (with the KL in the reward, the advantages are made per token in between). In
/// colocated mode the generators sleep first and the trainer's optimiser state leaves the
/// device after.
async fn train(
    ctx: &RunContext,
    inputs: &Inputs,
    rows: TrainBatch,
    episodes: &[Episode],
    metrics: &mut StepMetrics,
) -> Result<TrainReply> {
    let colocated = ctx.spec.generation.colocated.enabled;
    let session = ctx.session()?;
    if colocated {
        let sleep = ctx.weights.generator_memory(MemoryAction::Sleep);
        metrics.timed("generator_sleep", tracing::info_span!("generator_sleep"), sleep).await?;
        metrics.timed("trainer_onload", tracing::info_span!("trainer_onload"), session.move_memory(false)).await?;
    }
    ctx.stop.check()?;
    let sequences = Sequences { input_ids: rows.input_ids.clone() };
    let span = tracing::info_span!("policy_and_reference_logprobs", sequences = sequences.input_ids.len());
    let both = logprobs(session, &sequences, passes(&ctx.spec, inputs.has_reference, sequences.input_ids.len()));
    let (prev, reference) = metrics.timed("policy_and_reference_logprobs", span, both).await?;
    ctx.stop.check()?;
    // PPO: the critic's values make every generated token's advantage and the critic's targets.
    let mut critic = None;
    if let Some(ppo) = &ctx.spec.ppo {
        let span = tracing::info_span!("critic_values", sequences = sequences.input_ids.len());
        let values = metrics.timed("critic_values", span, session.logprobs(Scorer::Critic, &sequences)).await?;
        ctx.stop.check()?;
        let (advantages, returns, explained) = ppo_advantages(ppo, episodes, &values)?;
        if let Some(explained) = explained {
            metrics.0.insert("train/value_explained_variance".into(), explained);
        }
        critic = Some((advantages, values, returns));
    }
    let advantages = match (rows.advantages, kl_in_reward(&ctx.spec), &ctx.spec.distillation) {
        _ if critic.is_some() => None,
        (task, _, Some(distillation)) => {
            let prev =
                prev.as_deref().ok_or_else(|| Stop::Failed("distillation needs the student's logprobs".into()))?;
            let teacher =
                reference.as_deref().ok_or_else(|| Stop::Failed("distillation needs the teacher's logprobs".into()))?;
            let (advantages, kl) = distillation_advantages(distillation, episodes, task.as_ref(), prev, teacher)?;
            metrics.0.insert("train/teacher_kl".into(), kl);
            Some(advantages)
        }
        (Some(advantages), _, None) => Some(advantages),
        (None, Some(loss), None) => {
            let reference = reference
                .as_deref()
                .ok_or_else(|| Stop::Failed("use_kl_in_reward needs reference logprobs (a KL penalty β ≠ 0)".into()))?;
            let prev =
                prev.as_deref().ok_or_else(|| Stop::Failed("use_kl_in_reward needs the policy's logprobs".into()))?;
            let (advantages, penalty) = token_advantages(&ctx.spec, loss, episodes, prev, reference)?;
            metrics.0.insert("train/kl_in_reward".into(), penalty);
            Some(advantages)
        }
        (None, None, None) => return Err(Stop::Failed("the train batch has no advantages".into())),
    };
    // The teacher's logprobs made the advantages; the loss has no use for them.
    let reference = if ctx.spec.distillation.is_some() { None } else { reference };
    let batch = match critic {
        Some((advantages, values, returns)) => TrainBatch {
            advantages: Some(advantages),
            values: Some(values),
            returns: Some(returns),
            prev_logprobs: prev,
            reference_logprobs: reference,
            ..rows
        },
        None => TrainBatch { advantages, prev_logprobs: prev, reference_logprobs: reference, ..rows },
    };
    let training = session.train(batch, ctx.spec.generation.temperature);
    let trained = metrics.timed("policy_training", tracing::info_span!("policy_training"), training).await?;
    if colocated {
        metrics.timed("trainer_offload", tracing::info_span!("trainer_offload"), session.move_memory(true)).await?;
    }
    Ok(trained)
}

/// The new weights to the generators ([`weight_sync`]); in colocated mode the generators
/// then wake with them.
async fn sync_weights(
    ctx: &RunContext,
    run: &mut Grpo,
    dir: &Path,
    step: u64,
    metrics: &mut StepMetrics,
    served: Option<&watch::Sender<Served>>,
) -> Result<()> {
    let span = tracing::info_span!("weight_sync", version = step);
    let timings = metrics.timed("weight_sync", span, weight_sync(ctx, run, dir, step, served)).await?;
    metrics.0.extend(timings);
    if ctx.spec.generation.colocated.enabled {
        let wake = ctx.weights.generator_memory(MemoryAction::Wake);
        metrics.timed("generator_wake", tracing::info_span!("generator_wake"), wake).await?;
    }
    Ok(())
}

/// The policy's logprobs before the update, and the reference's when the run has one.
/// The logprob passes a step needs before its update: (policy, reference).
fn passes(spec: &RunSpec, has_reference: bool, rows: usize) -> (bool, bool) {
    let loss = spec.training.as_ref().map(|t| &t.loss);
    let in_reward = kl_in_reward(spec).is_some();
    let distilling = spec.distillation.is_some();
    // Without a KL penalty (β = 0) the reference is not needed; a teacher is.
    let reference = has_reference && (distilling || loss.is_some_and(LossConfig::needs_reference));
    // With one optimiser step over the batch the trainer takes the policy's logprobs before
    // the update from its training forward; the KL in the reward and distillation's
    // advantages need them before training.
    let global = spec.training.as_ref().map_or(rows, |t| t.global_batch_size);
    (in_reward || distilling || rows > global, reference)
}

async fn logprobs(
    session: TrainerSession<'_>,
    sequences: &Sequences,
    (policy, reference): (bool, bool),
) -> Result<(Option<Vec<Vec<f32>>>, Option<Vec<Vec<f32>>>)> {
    let prev = if policy { Some(session.logprobs(Scorer::Policy, sequences).await?) } else { None };
    let reference = if reference { Some(session.logprobs(Scorer::Reference, sequences).await?) } else { None };
    Ok((prev, reference))
}

/// Weights to the generators: in memory (the trainer exports weights only, in buckets, to
/// the object store, shared memory or its GPU's memory for CUDA IPC) or through a saved
/// directory. The phase ends when a
/// generator serves the new version (as NeMo-RL's refit does), so that its loading is not
/// counted as generation. Returns the trainer's export time and the generator's refit time.
/// An async run does not wait: the generators load the new weights while its next rollouts
/// run, and `served` hears of them when the first one reports them loaded (or fails to, or
/// is not heard from in time: the rollouts then find out for themselves).
async fn weight_sync(
    ctx: &RunContext,
    run: &mut Grpo,
    dir: &Path,
    step: u64,
    served: Option<&watch::Sender<Served>>,
) -> Result<BTreeMap<String, f64>> {
    let mut timings = BTreeMap::new();
    if let Some(dtype) = served.and_then(|s| s.borrow().dtype.clone()) {
        run.serving_dtype = Some(dtype);
    }
    let transfer = ctx.spec.generation.weight_transfer;
    let announcement = if transfer == WeightTransfer::Directory {
        ctx.session()?.save(dir, step, run.position).await?;
        run.saved.push(dir.to_path_buf());
        ctx.weights.publish_dir(dir, step).await?
    } else {
        let export = ctx.session()?.export(transfer, run.serving_dtype.as_deref()).await?;
        if let Some(seconds) = export.timing.get("export") {
            timings.insert("timing/train/trainer_export".into(), *seconds);
        }
        let announcement = ctx.weights.publish_export(step, &export.weights).await?;
        run.exported.push_back(export.weights);
        announcement
    };
    // The previous version stays for generators still loading it.
    while run.exported.len() > 2 {
        if let Some(old) = run.exported.pop_front() {
            ctx.weights.delete_exported(&old).await;
        }
    }
    if let Some(served) = served {
        let (served, new_dir, id) = (served.clone(), dir.to_path_buf(), ctx.id);
        tokio::spawn(async move {
            let loaded = loaded(id, step, announcement.first_report(REFIT_WAIT).await.ok().flatten());
            served.send_if_modified(|s| {
                // A late report of older weights changes nothing.
                if s.weights.1 > step {
                    return false;
                }
                s.weights = (new_dir, step);
                s.refit_seconds = loaded.as_ref().map(|r| r.seconds);
                if let Some(dtype) = loaded.and_then(|r| r.dtype) {
                    s.dtype = Some(dtype);
                }
                true
            });
        });
    } else if let Some(report) = loaded(ctx.id, step, announcement.first_report(REFIT_WAIT).await?) {
        timings.insert("timing/train/generator_refit".into(), report.seconds);
        if report.dtype.is_some() {
            run.serving_dtype = report.dtype;
        }
    }
    run.weights = (dir.to_path_buf(), step);
    Ok(timings)
}

/// A generator's report of loading weights `step`, when it loaded them; a failure or no
/// report in time is logged.
fn loaded(run_id: uuid::Uuid, step: u64, report: Option<WeightsLoaded>) -> Option<WeightsLoaded> {
    match report {
        Some(report) if report.error.is_none() => Some(report),
        Some(report) => {
            let error = report.error.unwrap_or_default();
            tracing::warn!(%run_id, step, "a generator could not load the new weights: {error}");
            None
        }
        None => {
            tracing::warn!(%run_id, step, "no generator reported the new weights loaded within {REFIT_WAIT:?}");
            None
        }
    }
}

/// Saves (unless the weight sync already did) and uploads the step's checkpoint.
async fn checkpoint(
    ctx: &RunContext,
    run: &mut Grpo,
    dir: &Path,
    step: u64,
    metrics: BTreeMap<String, f64>,
) -> Result<()> {
    if ctx.spec.generation.weight_transfer != WeightTransfer::Directory {
        ctx.session()?.save(dir, step, run.position).instrument(tracing::info_span!("checkpoint_save")).await?;
        run.saved.push(dir.to_path_buf());
    }
    ctx.upload_checkpoint(dir, step, run.position, metrics)
        .instrument(tracing::info_span!("checkpoint_upload"))
        .await?;
    Ok(())
}

/// Removes weight directories but the newest few (whole checkpoints: on the blocking pool).
async fn prune(saved: &mut Vec<PathBuf>) {
    while saved.len() > WEIGHT_DIRS_KEPT {
        let old = saved.remove(0);
        if let Err(e) = tokio::fs::remove_dir_all(&old).await {
            tracing::warn!("cannot remove {}: {e}", old.display());
        }
    }
}

/// Rollouts until `num_prompts_per_step` groups are kept. With dynamic sampling, groups
/// whose rewards all agree are set aside and more prompts drawn, for up to `max_rounds`
/// rounds; set-aside groups fill what is still missing after that. Rewards are shaped,
/// and timing and rollout metrics recorded. None when the data ran out.
pub(super) async fn collect_groups(
    ctx: &RunContext,
    inputs: &Inputs,
    loader: &mut Dataloader,
    weights: &(PathBuf, u64),
    step: u64,
) -> Result<Option<Rollouts>> {
    let (prompting, train) = (&inputs.prompting, &inputs.train);
    let mut metrics = BTreeMap::new();
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
        let records = data::records_async(train, indices).await?;
        let records: Vec<&Record> = records.iter().collect();
        let seed = spec.seed.wrapping_mul(1_000_003).wrapping_add(step * 10_007).wrapping_add(u64::from(round));
        let (mut episodes, timing) = rollout::rollout(ctx, prompting, &records, &settings, seed).await?;
        generation += timing.generation;
        reward += timing.reward;
        if let Some(shaping) = &g.overlong_shaping {
            let free = spec.generation.max_new_tokens.saturating_sub(shaping.buffer);
            for e in &mut episodes {
                let over = e.generated.saturating_sub(free) as f64 / shaping.buffer as f64;
                let penalty = over.min(1.0) * shaping.penalty;
                e.reward -= penalty;
                if let Some(last) = e.turn_rewards.last_mut() {
                    *last -= penalty;
                }
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
    whole_batches(spec, &mut kept);
    if kept.is_empty() {
        return Ok(None);
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
    Ok(Some(Rollouts { episodes: kept.into_iter().flatten().collect(), metrics, position: loader.position() }))
}

/// Keeps the first groups that make whole global batches (every sample trains once) and
/// numbers them from 0.
pub(super) fn whole_batches(spec: &RunSpec, groups: &mut Vec<Vec<Episode>>) {
    let per_group = spec.grpo.num_generations_per_prompt.max(1);
    let rows = groups.len() * per_group;
    let global = spec.training.as_ref().map_or(rows, |t| t.global_batch_size).max(1);
    groups.truncate(rows / global * global / per_group);
    for (k, group) in groups.iter_mut().enumerate() {
        for e in group {
            e.group = k;
        }
    }
}

/// The training batch of the kept episodes: advantages over each prompt's group (every
/// sample counts in the baseline but skipped ones, whose reward says nothing: their scoring
/// failed or their agent was dropped; truncated ones are masked out of the loss when overlong
/// filtering is on, skipped ones always). With the KL in the reward the advantages are left
/// out: they need the trainer's logprobs ([`token_advantages`]); with turn-level credit they
/// are per token ([`turn_advantages`]).
fn to_train_batch(spec: &RunSpec, episodes: &[Episode]) -> Result<TrainBatch> {
    let g = &spec.grpo;
    let groups: Vec<usize> = episodes.iter().map(|e| e.group).collect();
    let rewards: Vec<f64> = episodes.iter().map(|e| e.reward).collect();
    let per_sample = |a: Vec<f64>| Advantages::PerSample(a.into_iter().map(|a| a as f32).collect());
    // The KL in the reward and PPO's critic make the advantages per token once the trainer
    // has scored the batch.
    let advantages = if kl_in_reward(spec).is_some() || spec.ppo.is_some() {
        None
    } else if g.turn_level_advantages {
        Some(turn_advantages(spec, episodes).map(Advantages::PerToken))
    } else {
        Some(match g.advantage_estimator {
            AdvantageEstimator::Grpo => {
                let baseline = if g.use_leave_one_out_baseline { Baseline::LeaveOneOut } else { Baseline::Mean };
                let scored: Vec<bool> = episodes.iter().map(|e| !e.skipped).collect();
                grpo_advantages(&groups, &rewards, &scored, baseline, g.normalize_rewards).map(per_sample)
            }
            AdvantageEstimator::ReinforcePlusPlus => {
                let tokens: Vec<usize> = episodes.iter().map(|e| e.mask.iter().filter(|&&m| m > 0.0).count()).collect();
                reinforce_pp_advantages(&groups, &rewards, &tokens, g.normalize_rewards).map(per_sample)
            }
        })
    }
    .transpose()
    .map_err(|e| Stop::Failed(format!("advantages: {e}")))?;
    Ok(batch_of(spec, episodes, advantages))
}

/// The episodes as a train batch with `advantages`.
fn batch_of(spec: &RunSpec, episodes: &[Episode], advantages: Option<Advantages>) -> TrainBatch {
    let g = &spec.grpo;
    let sample_mask =
        episodes.iter().map(|e| if e.skipped || (g.overlong_filtering && e.truncated) { 0.0 } else { 1.0 }).collect();
    TrainBatch {
        input_ids: episodes.iter().map(|e| e.ids.clone()).collect(),
        token_mask: episodes.iter().map(|e| e.mask.clone()).collect(),
        sample_mask: Some(sample_mask),
        advantages,
        generation_logprobs: Some(episodes.iter().map(|e| e.gen_logprobs.clone()).collect()),
        prev_logprobs: None,
        reference_logprobs: None,
        values: None,
        returns: None,
    }
}

/// Turn-level GRPO advantages ([`turn_grpo_advantages`]) on the tokens each turn generated;
/// every other position 0.
fn turn_advantages(spec: &RunSpec, episodes: &[Episode]) -> keel_algorithms::Result<Vec<Vec<f32>>> {
    let g = &spec.grpo;
    let groups: Vec<usize> = episodes.iter().map(|e| e.group).collect();
    let turn_rewards: Vec<Vec<f64>> = episodes.iter().map(|e| e.turn_rewards.clone()).collect();
    let baseline = if g.use_leave_one_out_baseline { Baseline::LeaveOneOut } else { Baseline::Mean };
    let per_turn = turn_grpo_advantages(&groups, &turn_rewards, baseline, g.normalize_rewards)?;
    Ok(episodes
        .iter()
        .zip(per_turn)
        .map(|(e, turns)| {
            let mut row = vec![0.0f32; e.ids.len()];
            for (k, a) in turns.into_iter().enumerate() {
                let start = e.turn_starts.get(k).copied().unwrap_or(e.ids.len());
                let end = e.turn_starts.get(k + 1).copied().unwrap_or(e.ids.len());
                for t in (start..end).filter(|&t| e.mask[t] > 0.0) {
                    row[t] = a as f32;
                }
            }
            row
        })
        .collect())
}

/// On-policy distillation's advantages ([`keel_protocol::run::DistillationSpec`]): token t
/// the student generated gets −kl_weight · (student_t − teacher_t) + reward_weight · its
/// sample's task advantage; every other position 0. Also the mean of student_t − teacher_t
/// over the generated tokens of the samples trained on (`train/teacher_kl`).
fn distillation_advantages(
    d: &keel_protocol::run::DistillationSpec,
    episodes: &[Episode],
    task: Option<&Advantages>,
    student: &[Vec<f32>],
    teacher: &[Vec<f32>],
) -> Result<(Advantages, f64)> {
    let task_of = |i: usize, t: usize| -> f64 {
        match task {
            Some(Advantages::PerSample(a)) => f64::from(a.get(i).copied().unwrap_or(0.0)),
            Some(Advantages::PerToken(a)) => f64::from(a.get(i).and_then(|row| row.get(t)).copied().unwrap_or(0.0)),
            None => 0.0,
        }
    };
    let (mut sum, mut count) = (0.0f64, 0usize);
    let mut rows = Vec::with_capacity(episodes.len());
    for (i, e) in episodes.iter().enumerate() {
        let (s, t) = (&student[i], &teacher[i]);
        if s.len() != e.ids.len() || t.len() != e.ids.len() {
            return Err(Stop::Failed(format!(
                "sample {i}: {} tokens, {} student and {} teacher logprobs",
                e.ids.len(),
                s.len(),
                t.len()
            )));
        }
        let mut row = vec![0.0f32; e.ids.len()];
        for k in (1..e.ids.len()).filter(|&k| e.mask[k] > 0.0) {
            let kl = f64::from(s[k]) - f64::from(t[k]);
            row[k] = (-d.kl_weight * kl + d.reward_weight * task_of(i, k)) as f32;
            if !e.skipped {
                sum += kl;
                count += 1;
            }
        }
        rows.push(row);
    }
    Ok((Advantages::PerToken(rows), if count == 0 { 0.0 } else { sum / count as f64 }))
}

/// PPO's advantages and the critic's targets ([`PpoSpec`]): each sample's reward on its last
/// generated token, generalised advantage estimation over its generated tokens with the
/// critic's `values`, the advantages whitened over the generated tokens of every sample
/// trained on. Both per token, laid out like the logprobs (0 on every other position); a
/// skipped sample (its reward says nothing, and the loss masks it out) gets advantages 0 and
/// its own values as targets. Also returns the share of the targets' variance the values
/// explain over the same tokens (see [`keel_algorithms::explained_variance`]).
fn ppo_advantages(
    ppo: &PpoSpec,
    episodes: &[Episode],
    values: &[Vec<f32>],
) -> Result<(Advantages, Vec<Vec<f32>>, Option<f64>)> {
    if values.len() != episodes.len() {
        return Err(Stop::Failed(format!("the critic scored {} sequences of {}", values.len(), episodes.len())));
    }
    let mut steps = Vec::with_capacity(episodes.len());
    let mut raw = Vec::with_capacity(episodes.len());
    let mut returns = Vec::with_capacity(episodes.len());
    let mut targets = Vec::new();
    for (i, (e, v)) in episodes.iter().zip(values).enumerate() {
        if v.len() != e.ids.len() {
            return Err(Stop::Failed(format!("sample {i}: {} tokens, {} values", e.ids.len(), v.len())));
        }
        let generated: Vec<usize> = (1..e.ids.len()).filter(|&k| e.mask[k] > 0.0).collect();
        let mut row = v.clone();
        if e.skipped {
            raw.push(Vec::new());
        } else {
            let mut rewards = vec![0.0; generated.len()];
            if let Some(last) = rewards.last_mut() {
                *last = e.reward;
            }
            let own: Vec<f64> = generated.iter().map(|&k| f64::from(v[k])).collect();
            let estimates = gae(&rewards, &own, ppo.gamma, ppo.lambda)
                .map_err(|err| Stop::Failed(format!("ppo advantages of sample {i}: {err}")))?;
            for (&k, r) in generated.iter().zip(&estimates.returns) {
                row[k] = *r as f32;
                targets.push((*r, f64::from(v[k])));
            }
            raw.push(estimates.advantages);
        }
        returns.push(row);
        steps.push(generated);
    }
    let whitened = keel_algorithms::whiten(raw);
    let advantages = episodes
        .iter()
        .zip(steps.iter().zip(&whitened))
        .map(|(e, (generated, a))| {
            let mut row = vec![0.0f32; e.ids.len()];
            for (&k, a) in generated.iter().zip(a) {
                row[k] = *a as f32;
            }
            row
        })
        .collect();
    Ok((Advantages::PerToken(advantages), returns, keel_algorithms::explained_variance(&targets)))
}

/// The loss configuration when the run puts the KL penalty into the reward.
fn kl_in_reward(spec: &RunSpec) -> Option<&ClippedPgConfig> {
    match spec.training.as_ref().map(|t| &t.loss) {
        Some(LossConfig::ClippedPg(c)) if c.use_kl_in_reward => Some(c),
        _ => None,
    }
}

/// REINFORCE++ advantages per token with the KL in the reward (NeMo-RL's
/// `use_kl_in_reward`): each generated token's reward is the sample's (less its group's mean)
/// minus β·KL_t of the policy before the update (`prev`) against the reference, estimated and
/// clamped as the loss would; then all of them are whitened together. Also returns the mean
/// β·KL_t over those tokens.
fn token_advantages(
    spec: &RunSpec,
    loss: &ClippedPgConfig,
    episodes: &[Episode],
    prev: &[Vec<f32>],
    reference: &[Vec<f32>],
) -> Result<(Advantages, f64)> {
    let estimator = match loss.reference_policy_kl_type {
        KlType::K1 => KlEstimator::K1,
        KlType::K2 => KlEstimator::K2,
        KlType::K3 => KlEstimator::K3,
    };
    let beta = loss.reference_policy_kl_penalty;
    let aligned = |rows: &[Vec<f32>]| {
        rows.len() == episodes.len() && rows.iter().zip(episodes).all(|(r, e)| r.len() == e.ids.len())
    };
    if !aligned(prev) || !aligned(reference) {
        return Err(Stop::Failed("the trainer's logprobs do not match the batch's sequences".into()));
    }
    let generated = |e: &Episode| e.mask.iter().enumerate().filter(|(_, m)| **m > 0.0).map(|(t, _)| t).collect();
    let positions: Vec<Vec<usize>> = episodes.iter().map(generated).collect();
    let penalties: Vec<Vec<f64>> = positions
        .iter()
        .zip(prev.iter().zip(reference))
        .map(|(at, (p, r))| {
            let kl = |t: &usize| {
                kl_estimate(
                    p[*t] as f64,
                    r[*t] as f64,
                    estimator,
                    loss.kl_input_clamp_value,
                    loss.kl_output_clamp_value,
                )
            };
            at.iter().map(|t| beta * kl(t)).collect()
        })
        .collect();
    let groups: Vec<usize> = episodes.iter().map(|e| e.group).collect();
    let rewards: Vec<f64> = episodes.iter().map(|e| e.reward).collect();
    let per_token = reinforce_pp_token_advantages(&groups, &rewards, &penalties, spec.grpo.normalize_rewards)
        .map_err(|e| Stop::Failed(format!("advantages: {e}")))?;
    let rows = episodes
        .iter()
        .zip(positions.iter().zip(per_token))
        .map(|(e, (at, values))| {
            let mut row = vec![0.0f32; e.ids.len()];
            for (t, a) in at.iter().zip(values) {
                row[*t] = a as f32;
            }
            row
        })
        .collect();
    let tokens = penalties.iter().map(Vec::len).sum::<usize>().max(1) as f64;
    Ok((Advantages::PerToken(rows), penalties.iter().flatten().sum::<f64>() / tokens))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Two samples of three tokens after a one-token prompt; the second sample's last token
    /// is an observation (mask 0), and the first sample is dropped from the metric by nothing.
    #[test]
    fn distillation_advantages_are_the_weighted_reverse_kl_and_task_advantage_per_token() {
        let mut episodes = vec![Episode::for_test(0, 1), Episode::for_test(0, 1)];
        for (e, mask) in episodes.iter_mut().zip([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]]) {
            e.ids = vec![5, 6, 7, 8];
            e.mask = mask.to_vec();
        }
        let student = vec![vec![0.0, -1.0, -2.0, -0.5], vec![0.0, -0.25, -1.5, -3.0]];
        let teacher = vec![vec![0.0, -1.5, -1.0, -0.5], vec![0.0, -0.75, -1.0, -9.0]];
        let spec = keel_protocol::run::DistillationSpec {
            teacher: keel_protocol::run::ModelRef {
                path: Some("/t".into()),
                name: None,
                revision: None,
                checkpoint: None,
            },
            kl_weight: 2.0,
            reward_weight: 0.5,
        };
        let task = Advantages::PerSample(vec![1.0, -1.0]);
        let (advantages, kl) = distillation_advantages(&spec, &episodes, Some(&task), &student, &teacher).unwrap();
        let Advantages::PerToken(rows) = advantages else { panic!("per-token advantages") };
        // Token by token: −2·(student − teacher) + 0.5·task, by hand.
        assert_eq!(rows[0], vec![0.0, -2.0 * 0.5 + 0.5, -2.0 * -1.0 + 0.5, -2.0 * 0.0 + 0.5]);
        assert_eq!(rows[1], vec![0.0, -2.0 * 0.5 - 0.5, -2.0 * -0.5 - 0.5, 0.0]);
        // The mean of student − teacher over the five generated tokens.
        assert!((kl - (0.5 - 1.0 + 0.0 + 0.5 - 0.5) / 5.0).abs() < 1e-12, "{kl}");
        let (_, kl_alone) = distillation_advantages(&spec, &episodes, None, &student, &teacher).unwrap();
        assert_eq!(kl, kl_alone);
        // A dropped sample's tokens still get advantages (its sample mask is 0) but are not in
        // the metric.
        episodes[1].skipped = true;
        let (_, kl_kept) = distillation_advantages(&spec, &episodes, None, &student, &teacher).unwrap();
        assert!((kl_kept - (0.5 - 1.0 + 0.0) / 3.0).abs() < 1e-12, "{kl_kept}");
    }

    /// Two samples after a one-token prompt, the second with an observation token between its
    /// generated ones (not a step) and a third one skipped: GAE over each sample's generated
    /// tokens with its reward on the last, the advantages whitened over both, the returns in
    /// place; the skipped sample's advantages are 0 and its targets its own values.
    #[test]
    fn ppo_advantages_run_gae_over_each_samples_generated_tokens() {
        let mut episodes = vec![Episode::for_test(0, 1), Episode::for_test(0, 1), Episode::for_test(0, 1)];
        for (e, mask) in episodes.iter_mut().zip([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]]) {
            e.ids = vec![5, 6, 7, 8];
            e.mask = mask.to_vec();
        }
        episodes[0].reward = 1.0;
        episodes[1].reward = 0.0;
        episodes[2].reward = 5.0;
        episodes[2].skipped = true;
        let values = vec![vec![0.0, 0.5, 0.25, 9.0], vec![0.0, 0.5, 9.0, -0.5], vec![0.0, 0.1, 0.2, 0.3]];
        let ppo: PpoSpec = serde_json::from_value(serde_json::json!({"gamma": 0.5, "lambda": 0.5})).unwrap();
        let (advantages, returns, explained) = ppo_advantages(&ppo, &episodes, &values).unwrap();
        // Sample 0, steps at 1 and 2, rewards [0, 1], values [0.5, 0.25]:
        // δ = [0.5·0.25 − 0.5, 1 − 0.25] = [−0.375, 0.75]; A = [−0.375 + 0.25·0.75, 0.75].
        // Sample 1, steps at 1 and 3, rewards [0, 0], values [0.5, −0.5]:
        // δ = [0.5·−0.5 − 0.5, 0 + 0.5] = [−0.75, 0.5]; A = [−0.75 + 0.25·0.5, 0.5].
        let raw = [-0.1875, 0.75, -0.625, 0.5];
        let mean = raw.iter().sum::<f64>() / 4.0;
        let std = (raw.iter().map(|a| (a - mean) * (a - mean)).sum::<f64>() / 4.0).sqrt();
        let w: Vec<f32> = raw.iter().map(|a| ((a - mean) / std) as f32).collect();
        let Advantages::PerToken(rows) = advantages else { panic!("per-token advantages") };
        let expected = [vec![0.0, w[0], w[1], 0.0], vec![0.0, w[2], 0.0, w[3]], vec![0.0; 4]];
        for (row, want) in rows.iter().zip(&expected) {
            assert!(row.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6), "{rows:?} vs {expected:?}");
        }
        assert_eq!(returns[0], vec![0.0, -0.1875 + 0.5, 1.0, 9.0]);
        assert_eq!(returns[1], vec![0.0, -0.625 + 0.5, 9.0, 0.0]);
        assert_eq!(returns[2], values[2], "a skipped sample's targets are its values");
        // Over the four trained tokens, returns [0.3125, 1, −0.125, 0] and residuals R − V the
        // raw advantages: Var(R) = 0.760742…/4, Var(R − V) = 1.190429…/4.
        let var = |xs: &[f64]| {
            let mean = xs.iter().sum::<f64>() / xs.len() as f64;
            xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64
        };
        let want = 1.0 - var(&raw) / var(&[0.3125, 1.0, -0.125, 0.0]);
        assert!((explained.unwrap() - want).abs() < 1e-12 && (want + 0.564827).abs() < 1e-6, "{explained:?}");
        assert!(ppo_advantages(&ppo, &episodes, &values[..2]).is_err());
    }
}
