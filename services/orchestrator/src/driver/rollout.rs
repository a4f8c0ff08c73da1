//! Multi-turn rollouts: generate through the generator queue group, step each sample's
//! environment through the reward queue group, append the observation's token ids (loss
//! mask 0) and generate again, until the environment terminates, `max_rollout_turns` is
//! reached or the sequence hits `max_total_sequence_length` (the sample is then marked
//! truncated). Ids and generation logprobs are kept token for token.
//!
//! Validation runs the same rollouts on held-out prompts and reports accuracy (mean reward)
//! and pass@k with the unbiased estimator.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures::future::join_all;
use keel_protocol::generator::{RolloutReply, RolloutRequest, Sampling};
use keel_protocol::reward::{EnvConfig, EnvSample, EnvStepRequest, Message};
use keel_protocol::run::{EnvironmentsSpec, Sample};
use serde_json::{Value, json};
use tracing::Instrument;

use super::tokens::Prompting;
use super::{Result, RunContext, Stop};
use crate::data::Record;

/// Samples per environment request (the reply must stay under NATS's 1 MiB).
const ENV_BATCH: usize = 64;

/// How long a run waits for the generators to load its weights.
const REFIT_WAIT: Duration = Duration::from_secs(120);

/// One sample's conversation, as token ids and as text.
#[derive(Debug, Clone)]
pub struct Episode {
    /// Index of its prompt in the batch (the advantage group).
    pub group: usize,
    pub prompt_len: usize,
    pub ids: Vec<i64>,
    /// 1 on generated tokens.
    pub mask: Vec<f32>,
    /// The generator's logprob of each token (0 where the model did not generate it).
    pub gen_logprobs: Vec<f32>,
    pub messages: Vec<Message>,
    pub metadata: Value,
    pub env: EnvConfig,
    pub stop: Vec<String>,
    pub reward: f64,
    /// Named reward components, each summed over the turns.
    pub rewards: BTreeMap<String, f64>,
    /// The reward of each turn's environment step (they sum to `reward`).
    pub turn_rewards: Vec<f64>,
    /// Where each assistant turn's generated tokens start in `ids`.
    pub turn_starts: Vec<usize>,
    /// The environment's last `info`.
    pub info: Value,
    pub done: bool,
    /// Cut at the maximum length (or the last generation ran out of tokens).
    pub truncated: bool,
    pub terminated: bool,
    pub finish_reason: String,
    pub turns: u32,
    pub generated: usize,
    /// Scoring failed and `on_error: skip` says to leave the sample out.
    pub skipped: bool,
    /// The weight version its rollout was asked of (the generator served it or a newer
    /// one when the first turn began).
    pub weight_version: u64,
    pub error: Option<String>,
    pub prompt_text: String,
    pub ground_truth: Option<String>,
    /// What the last turn generated (turned into text before the environment step).
    last_tokens: Vec<i64>,
}

impl Episode {
    /// Every assistant turn and observation after the prompt.
    pub fn turns(&self) -> &[Message] {
        let opening = self.messages.iter().take_while(|m| m.role != "assistant").count();
        &self.messages[opening..]
    }

    /// The turns as text.
    pub fn completion(&self) -> String {
        self.turns().iter().map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n")
    }

    pub fn sample(&self, step: u64, split: &str) -> Sample {
        Sample {
            step,
            split: split.to_string(),
            prompt: self.prompt_text.clone(),
            completion: self.completion(),
            reward: self.reward,
            ground_truth: self.ground_truth.clone(),
            finish_reason: Some(self.finish_reason.clone()),
            rewards: self.rewards.clone(),
            info: self.info.clone(),
            turns: self.turns().to_vec(),
            num_prompt_tokens: Some(self.prompt_len as u64),
            num_generated_tokens: Some(self.mask.iter().filter(|&&m| m > 0.0).count() as u64),
            num_tokens: Some(self.ids.len() as u64),
            truncated: Some(self.truncated),
            error: self.error.clone(),
            dropped: Some(self.skipped),
        }
    }
}

#[cfg(test)]
impl Episode {
    /// A one-token sample of `group` rolled out from weights `weight_version` (tests only).
    pub fn for_test(group: usize, weight_version: u64) -> Self {
        Self {
            group,
            prompt_len: 1,
            ids: vec![1],
            mask: vec![0.0],
            gen_logprobs: vec![0.0],
            messages: Vec::new(),
            metadata: Value::Null,
            env: EnvConfig::Math(Default::default()),
            stop: Vec::new(),
            reward: 0.0,
            rewards: BTreeMap::new(),
            turn_rewards: Vec::new(),
            turn_starts: Vec::new(),
            info: Value::Null,
            done: true,
            truncated: false,
            terminated: true,
            finish_reason: "stop".into(),
            turns: 1,
            generated: 0,
            skipped: false,
            weight_version,
            error: None,
            prompt_text: String::new(),
            ground_truth: None,
            last_tokens: Vec::new(),
        }
    }
}

/// What a rollout is asked for.
#[derive(Debug, Clone)]
pub struct Settings {
    pub n: usize,
    pub sampling: Sampling,
    pub max_new_tokens: usize,
    pub max_turns: u32,
    /// The weights the generators must serve: this version of this directory.
    pub weights: (PathBuf, u64),
}

/// Seconds spent generating and scoring.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timing {
    pub generation: f64,
    pub reward: f64,
}

fn env_for(ctx: &RunContext, record: &Record) -> Result<EnvConfig> {
    let envs = ctx.spec.environments.as_ref().ok_or_else(|| Stop::Failed("this run has no environments".into()))?;
    Ok(record.task.as_ref().and_then(|t| envs.tasks.get(t)).unwrap_or(&envs.default).clone())
}

/// Rolls out `settings.n` samples of every record, group `i` for `records[i]`.
pub async fn rollout(
    ctx: &RunContext,
    prompting: &Prompting,
    records: &[&Record],
    settings: &Settings,
    seed: u64,
) -> Result<(Vec<Episode>, Timing)> {
    let max_len = ctx.spec.max_total_sequence_length;
    let mut episodes = Vec::with_capacity(records.len() * settings.n);
    for (group, record) in records.iter().enumerate() {
        let messages = prompting.messages(record);
        let prompt_text = prompting.prompt_text(&messages)?;
        let ids = prompting.prompt_ids(&messages)?;
        let env = env_for(ctx, record)?;
        let mut metadata = Value::Object(record.metadata.clone());
        if let Some(truth) = &record.answer {
            metadata["ground_truth"] = json!(truth);
        }
        if let Some(task) = &record.task {
            metadata["task"] = json!(task);
        }
        for _ in 0..settings.n {
            episodes.push(Episode {
                group,
                prompt_len: ids.len(),
                mask: vec![0.0; ids.len()],
                gen_logprobs: vec![0.0; ids.len()],
                ids: ids.clone(),
                messages: messages.clone(),
                metadata: metadata.clone(),
                env: env.clone(),
                stop: ctx.spec.generation.stop.clone(),
                reward: 0.0,
                rewards: BTreeMap::new(),
                turn_rewards: Vec::new(),
                turn_starts: Vec::new(),
                info: Value::Null,
                done: ids.len() >= max_len,
                truncated: ids.len() >= max_len,
                terminated: false,
                finish_reason: "length".into(),
                turns: 0,
                generated: 0,
                skipped: false,
                weight_version: settings.weights.1,
                error: None,
                prompt_text: prompt_text.clone(),
                ground_truth: record.answer.clone(),
                last_tokens: Vec::new(),
            });
        }
    }
    let mut timing = Timing::default();
    if episodes.iter().any(|e| matches!(e.env, EnvConfig::Agent(_))) {
        let started = Instant::now();
        super::agents::roll_out(ctx, prompting, &mut episodes, settings, seed).await?;
        timing.generation += super::seconds(started);
    }
    for turn in 0..settings.max_turns {
        if episodes.iter().all(|e| e.done) {
            break;
        }
        ctx.stop.check()?;
        let started = Instant::now();
        generate_turn(ctx, &mut episodes, settings, seed.wrapping_add(u64::from(turn) * 7919), turn == 0).await?;
        timing.generation += super::seconds(started);
        ctx.stop.check()?;
        let started = Instant::now();
        step_environments(ctx, prompting, &mut episodes, turn + 1 == settings.max_turns).await?;
        timing.reward += super::seconds(started);
        if episodes.iter().all(|e| e.done) {
            break;
        }
    }
    for e in episodes.iter_mut().filter(|e| !e.done) {
        e.done = true;
    }
    Ok((episodes, timing))
}

/// One generation turn for every live episode: on the first turn one request of n samples
/// per prompt, later one request per episode.
async fn generate_turn(
    ctx: &RunContext,
    episodes: &mut [Episode],
    settings: &Settings,
    seed: u64,
    first: bool,
) -> Result<()> {
    let max_len = ctx.spec.max_total_sequence_length;
    let live: Vec<usize> = (0..episodes.len()).filter(|&i| !episodes[i].done).collect();
    // Requests as (episode indices served, request).
    let mut requests: Vec<(Vec<usize>, RolloutRequest)> = Vec::new();
    let chunks: Vec<Vec<usize>> = if first {
        let mut by_group: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for &i in &live {
            by_group.entry(episodes[i].group).or_default().push(i);
        }
        by_group.into_values().collect()
    } else {
        live.iter().map(|&i| vec![i]).collect()
    };
    for (k, members) in chunks.into_iter().enumerate() {
        let e = &episodes[members[0]];
        let room = max_len.saturating_sub(e.ids.len());
        let request = RolloutRequest {
            run_id: ctx.id.to_string(),
            min_weight_version: settings.weights.1,
            prompt_token_ids: e.ids.clone(),
            n: members.len(),
            max_tokens: settings.max_new_tokens.min(room).max(1),
            sampling: Sampling {
                seed: Some(seed.wrapping_add(k as u64 * 104_729).wrapping_add(members[0] as u64 * 31)),
                ..settings.sampling.clone()
            },
            stop_token_ids: Vec::new(),
            stop: e.stop.clone(),
            include_stop_str_in_output: true,
            ignore_eos: false,
            // One id per logical rollout: its retries join the work already under way.
            request_id: Some(uuid::Uuid::new_v4().to_string()),
        };
        requests.push((members, request));
    }
    let replies = join_all(requests.iter().map(|(_, request)| generate(ctx, request, &settings.weights))).await;
    for ((members, _), reply) in requests.into_iter().zip(replies) {
        let reply = reply?;
        if reply.samples.len() != members.len() {
            return Err(Stop::Failed(format!(
                "the generator answered {} samples for {}",
                reply.samples.len(),
                members.len()
            )));
        }
        for (i, sample) in members.into_iter().zip(reply.samples) {
            let e = &mut episodes[i];
            let room = max_len.saturating_sub(e.ids.len());
            let take = sample.token_ids.len().min(room);
            e.turn_starts.push(e.ids.len());
            e.ids.extend_from_slice(&sample.token_ids[..take]);
            e.mask.extend(std::iter::repeat_n(1.0, take));
            e.gen_logprobs.extend_from_slice(&sample.logprobs[..take.min(sample.logprobs.len())]);
            e.gen_logprobs.resize(e.ids.len(), 0.0);
            e.generated += take;
            e.turns += 1;
            e.finish_reason = sample.finish_reason.clone();
            if sample.finish_reason == "length" || e.ids.len() >= max_len {
                e.truncated = true;
            }
            e.last_tokens = sample.token_ids[..take].to_vec();
        }
    }
    Ok(())
}

/// A rollout from any of the run's generators ([`on_weights`]).
async fn generate(ctx: &RunContext, request: &RolloutRequest, weights: &(PathBuf, u64)) -> Result<RolloutReply> {
    Ok(on_weights(ctx, weights, || ctx.nats.rollout(request)).await??)
}

/// `call` to a generator that must serve `weights` (this version or newer): one that does
/// not yet refuses with `stale_weights`, the weights are announced again and the call
/// retried, for up to [`REFIT_WAIT`]. Any other answer is returned as it is (a generator that
/// could not load the weights, `refit_failed`, ends it at once).
pub(super) async fn on_weights<T, F, Fut>(
    ctx: &RunContext,
    weights: &(PathBuf, u64),
    call: F,
) -> Result<std::result::Result<T, crate::clients::CallError>>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, crate::clients::CallError>>,
{
    let deadline = Instant::now() + REFIT_WAIT;
    loop {
        match call().await {
            Err(e) if e.kind() == Some("stale_weights") && Instant::now() < deadline => {
                ctx.stop.check()?;
                ctx.weights.reannounce(&weights.0, weights.1).await?;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            other => return Ok(other),
        }
    }
}

/// Items (an index and its sample's environment) in one environment request each per
/// environment configuration, at most [`ENV_BATCH`] to a request.
pub(super) fn env_chunks<'a>(items: impl Iterator<Item = (usize, &'a EnvConfig)>) -> Vec<Vec<usize>> {
    let mut by_env: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, env) in items {
        by_env.entry(serde_json::to_string(env).unwrap_or_default()).or_default().push(i);
    }
    by_env
        .into_values()
        .flat_map(|members| members.chunks(ENV_BATCH).map(<[usize]>::to_vec).collect::<Vec<_>>())
        .collect()
}

/// Steps the environment of every episode that generated this turn.
async fn step_environments(
    ctx: &RunContext,
    prompting: &Prompting,
    episodes: &mut [Episode],
    last_turn: bool,
) -> Result<()> {
    let max_len = ctx.spec.max_total_sequence_length;
    let on_error = ctx.spec.environments.as_ref().map(|e| e.on_error).unwrap_or_default();
    let live: Vec<usize> = (0..episodes.len()).filter(|&i| !episodes[i].done).collect();
    for &i in &live {
        let e = &mut episodes[i];
        let text = prompting.decode(&std::mem::take(&mut e.last_tokens));
        e.messages.push(Message::new("assistant", text));
    }
    let mut calls = Vec::new();
    for chunk in env_chunks(live.iter().map(|&i| (i, &episodes[i].env))) {
        let request = EnvStepRequest {
            env: episodes[chunk[0]].env.clone(),
            on_error,
            samples: chunk
                .iter()
                .map(|&i| EnvSample {
                    messages: episodes[i].messages.clone(),
                    metadata: episodes[i].metadata.clone(),
                    token_ids: Some(episodes[i].ids.clone()),
                    agent: None,
                })
                .collect(),
        };
        calls.push((chunk.to_vec(), request));
    }
    let replies = join_all(calls.iter().map(|(_, request)| ctx.nats.ask(request))).await;
    for ((members, _), reply) in calls.into_iter().zip(replies) {
        let reply = reply?;
        for (i, result) in members.into_iter().zip(reply.results) {
            let e = &mut episodes[i];
            e.reward += result.reward;
            e.turn_rewards.push(result.reward);
            for (name, value) in &result.rewards {
                *e.rewards.entry(name.clone()).or_default() += value;
            }
            if !result.info.is_null() {
                e.info = result.info.clone();
            }
            e.skipped |= result.skipped;
            if let Some(error) = &result.error {
                e.error = Some(error.to_string());
            }
            e.metadata = result.metadata;
            if let Some(stop) = result.stop_strings {
                e.stop = stop;
            }
            if result.terminated {
                e.terminated = true;
                e.done = true;
            } else if last_turn || e.truncated {
                e.done = true;
            } else if let Some(observation) = result.observation {
                let ids = prompting.observation_ids(&observation)?;
                let room = max_len.saturating_sub(e.ids.len());
                let take = ids.len().min(room);
                e.ids.extend_from_slice(&ids[..take]);
                e.mask.extend(std::iter::repeat_n(0.0, take));
                e.gen_logprobs.extend(std::iter::repeat_n(0.0, take));
                e.messages.push(observation);
                if take < ids.len() || e.ids.len() >= max_len {
                    e.truncated = true;
                    e.done = true;
                }
            }
        }
    }
    Ok(())
}

/// Rollout metrics under NeMo-RL's names (without the `train/` or `validation/` prefix),
/// with `rewards/<name>` for each named reward component: its mean over the samples that
/// report it.
pub fn rollout_metrics(episodes: &[Episode]) -> BTreeMap<String, f64> {
    let n = episodes.len().max(1) as f64;
    let mean = |f: &dyn Fn(&Episode) -> f64| episodes.iter().map(f).sum::<f64>() / n;
    let mut named: BTreeMap<&str, (f64, f64)> = BTreeMap::new();
    for (name, value) in episodes.iter().flat_map(|e| &e.rewards) {
        let entry = named.entry(name).or_default();
        entry.0 += value;
        entry.1 += 1.0;
    }
    let components = named.into_iter().map(|(name, (sum, count))| (format!("rewards/{name}"), sum / count));
    let mut metrics = BTreeMap::from([
        ("reward".to_string(), mean(&|e| e.reward)),
        ("mean_gen_tokens_per_sample".to_string(), mean(&|e| e.generated as f64)),
        ("turns_per_sample".to_string(), mean(&|e| f64::from(e.turns))),
        ("natural_termination_rate".to_string(), mean(&|e| f64::from(u8::from(e.terminated && !e.truncated)))),
        ("truncation_rate".to_string(), mean(&|e| f64::from(u8::from(e.truncated)))),
        ("scoring_error_rate".to_string(), mean(&|e| f64::from(u8::from(e.error.is_some())))),
    ]);
    metrics.extend(components);
    metrics
}

/// Accuracy and pass@k of `records` (greedy unless `validation.temperature` says), with a
/// few samples to record. Accuracy (the fraction of samples with reward 1, as NeMo-RL
/// counts it) only where every environment rewards 0 or 1; otherwise the mean reward as
/// `reward_mean`.
pub async fn validate(
    ctx: &RunContext,
    prompting: &Prompting,
    records: &[Record],
    weights: (PathBuf, u64),
    step: u64,
    prefix: &str,
) -> Result<(BTreeMap<String, f64>, Vec<Sample>)> {
    let v = &ctx.spec.validation;
    let take = if v.num_prompts == 0 { records.len() } else { v.num_prompts.min(records.len()) };
    let chosen: Vec<&Record> = records.iter().take(take).collect();
    let settings = Settings {
        n: v.num_samples,
        sampling: Sampling { temperature: v.temperature, top_p: 1.0, top_k: None, min_p: 0.0, seed: None },
        max_new_tokens: ctx.spec.generation.max_new_tokens,
        max_turns: ctx.spec.grpo.max_rollout_turns,
        weights,
    };
    // Hundreds of alike requests: one span with their summary, not a span per request
    // (KEEL_TRACE=info,keel::detail=debug keeps them).
    let span = tracing::info_span!(
        "validation",
        step,
        prompts = chosen.len(),
        requests = tracing::field::Empty,
        failed_requests = tracing::field::Empty,
        request_seconds = tracing::field::Empty,
    );
    let work = rollout(ctx, prompting, &chosen, &settings, ctx.spec.seed ^ 0x5eed);
    let (rolled, summary) = keel_telemetry::summarised(work).instrument(span.clone()).await;
    span.record("requests", summary.requests);
    span.record("failed_requests", summary.failed);
    span.record("request_seconds", summary.seconds);
    let (episodes, _) = rolled?;
    let correct = |e: &Episode| e.reward >= 1.0 - 1e-6;
    let mut per_prompt = vec![(v.num_samples, 0usize); chosen.len()];
    for e in episodes.iter().filter(|e| correct(e)) {
        per_prompt[e.group].1 += 1;
    }
    let mut metrics = BTreeMap::new();
    let base = rollout_metrics(&episodes);
    if ctx.spec.environments.as_ref().is_some_and(EnvironmentsSpec::binary_rewards) {
        let right = episodes.iter().filter(|e| correct(e)).count();
        metrics.insert(format!("{prefix}/accuracy"), right as f64 / episodes.len().max(1) as f64);
    } else {
        metrics.insert(format!("{prefix}/reward_mean"), base["reward"]);
    }
    metrics.insert(format!("{prefix}/avg_length"), base["mean_gen_tokens_per_sample"]);
    for (name, value) in base.iter().filter(|(name, _)| name.starts_with("rewards/")) {
        metrics.insert(format!("{prefix}/{name}"), *value);
    }
    for &k in &v.pass_at_k {
        let value = keel_algorithms::mean_pass_at_k(&per_prompt, k).map_err(|e| Stop::Failed(e.to_string()))?;
        metrics.insert(format!("{prefix}/pass@{k}"), value);
    }
    let samples = episodes.iter().step_by(v.num_samples.max(1)).take(8).map(|e| e.sample(step, "validation")).collect();
    Ok((metrics, samples))
}

/// The starting model's validation, recorded as step 0 (the baseline of the curve).
pub async fn record_baseline(
    ctx: &RunContext,
    prompting: &Prompting,
    records: &[Record],
    weights: (PathBuf, u64),
) -> Result<()> {
    let (metrics, samples) = validate(ctx, prompting, records, weights, 0, "validation").await?;
    ctx.store.record_baseline(&metrics, &samples).await
}

/// Validation within step `step`: its metrics, samples and time added to the step's.
pub async fn validate_step(
    ctx: &RunContext,
    prompting: &Prompting,
    records: &[Record],
    weights: (PathBuf, u64),
    step: u64,
    metrics: &mut BTreeMap<String, f64>,
    samples: &mut Vec<Sample>,
) -> Result<()> {
    let started = Instant::now();
    let (found, recorded) = validate(ctx, prompting, records, weights, step, "validation").await?;
    metrics.extend(found);
    samples.extend(recorded);
    metrics.insert("timing/validation/total_validation_time".into(), super::seconds(started));
    Ok(())
}
