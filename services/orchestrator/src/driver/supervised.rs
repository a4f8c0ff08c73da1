//! SFT, DPO and reward-model training: batches of records from the dataloader become rows
//! (an SFT example, or chosen and rejected side by side as pairs 2i, 2i + 1), one train call
//! per step. With a validation set, SFT validates by generation when the run names
//! environments; otherwise (and for DPO and reward models, as NeMo-RL does) the trainer
//! evaluates the loss on the held-out rows without an update, recorded as `validation/loss`,
//! `validation/accuracy`, ... at step 0 and every validation period.

use std::collections::BTreeMap;
use std::time::Instant;

use tracing::Instrument;

use keel_protocol::run::Algorithm;
use keel_protocol::trainer::TrainBatch;

use super::grpo::{mean_step_metrics, weights_dir};
use super::tokens::{Prompting, Row};
use super::{Result, RunContext, Stop, rollout, seconds};
use crate::data::{self, Dataloader, Record};
use crate::db::StepRecord;

pub async fn run(ctx: &RunContext) -> Result<()> {
    let spec = &ctx.spec;
    let algorithm = spec.algorithm;
    let training = spec.training.as_ref().ok_or_else(|| Stop::Failed("this run has no training section".into()))?;
    let train = std::sync::Arc::new(data::open_async(&spec.data.train, algorithm, "data.train", &ctx.run_dir).await?);
    let held_out = match &spec.data.validation {
        Some(d) => data::load_async(d, data::validation_algorithm(spec), "data.validation").await?,
        None => Vec::new(),
    };
    let start = ctx.start().await?;
    let prompting = Prompting::load(&start.base_dir, &spec.prompt, spec.max_total_sequence_length)?;
    ctx.session()?.load(&start).await?;
    let pairwise = matches!(algorithm, Algorithm::Dpo | Algorithm::Rm);
    let (validation, held_out_rows) = if held_out.is_empty() {
        (Vec::new(), None)
    } else if data::validation_algorithm(spec) == Algorithm::Eval {
        (held_out, None)
    } else {
        let v = &spec.validation;
        let take = if v.num_prompts == 0 { held_out.len() } else { v.num_prompts.min(held_out.len()) };
        let records: Vec<&Record> = held_out.iter().take(take).collect();
        (Vec::new(), Some(batch_of(rows_of(&prompting, &records, pairwise)?)))
    };
    if let (false, Some(rows)) = (start.resumed, &held_out_rows) {
        let metrics = evaluate(ctx, rows).await?;
        ctx.store.record_baseline(&metrics, &[]).await?;
    }
    let per_step = if pairwise { training.global_batch_size / 2 } else { training.global_batch_size };
    let mut loader = Dataloader::new(train.len(), spec.seed, spec.data.shuffle, spec.max_num_epochs, start.position);
    let total = spec.max_num_steps.min(start.step + loader.batches_left(per_step));
    ctx.store.set_total_steps(total).await?;
    if !validation.is_empty() {
        ctx.load_generators(&start).await?;
    }
    if !start.resumed && !validation.is_empty() {
        let weights = (start.policy_dir.clone(), 0);
        rollout::record_baseline(ctx, &prompting, &validation, weights).await?;
    }
    for step in start.step + 1..=total {
        ctx.stop.check()?;
        // One trace per step, like GRPO's.
        let span = tracing::info_span!(
            parent: None,
            "train.step",
            otel.name = format!("{} step", algorithm.name()),
            run_id = %ctx.id,
            step,
            total_steps = total,
            sequences = tracing::field::Empty,
            tokens = tracing::field::Empty,
        );
        let more = async {
            let started = Instant::now();
            let Some(indices) = loader.next_batch(per_step) else { return Ok(false) };
            let records = data::records_async(&train, indices).await?;
            let records: Vec<&Record> = records.iter().collect();
            let rows = rows_of(&prompting, &records, pairwise)?;
            let tokens: usize = rows.iter().map(|r| r.ids.len()).sum();
            tracing::Span::current().record("sequences", rows.len()).record("tokens", tokens);
            let batch = batch_of(rows);
            let session = ctx.session()?;
            let phase = Instant::now();
            let trained = session.train(batch, 1.0).instrument(tracing::info_span!("policy_training")).await?;
            let mut metrics = mean_step_metrics(&trained, "train");
            metrics.insert("timing/train/policy_training".into(), seconds(phase));
            metrics.insert("performance/training_tokens_per_second".into(), tokens as f64 / seconds(phase).max(1e-9));
            let last = step == total;
            let mut saved = None;
            let mut samples = Vec::new();
            if let Some(rows) = held_out_rows.as_ref().filter(|_| ctx.validates_at(step, last)) {
                metrics.extend(evaluate(ctx, rows).await?);
            }
            if !validation.is_empty() && ctx.validates_at(step, last) {
                let dir = weights_dir(&ctx.run_dir, step);
                session.save(&dir, step, loader.position()).await?;
                ctx.weights.publish_dir(&dir, step).await?;
                rollout::validate_step(
                    ctx,
                    &prompting,
                    &validation,
                    (dir.clone(), step),
                    step,
                    &mut metrics,
                    &mut samples,
                )
                .await?;
                saved = Some(dir);
            }
            metrics.insert("timing/train/total_step_time".into(), seconds(started));
            ctx.store
                .record(&StepRecord {
                    step,
                    metrics: metrics.clone(),
                    samples,
                    dataloader: serde_json::to_value(loader.position()).unwrap_or_default(),
                })
                .await?;
            if ctx.saves_at(step, last) {
                let dir = match saved.take() {
                    Some(dir) => dir,
                    None => {
                        let dir = weights_dir(&ctx.run_dir, step);
                        session.save(&dir, step, loader.position()).await?;
                        dir
                    }
                };
                ctx.upload_checkpoint(&dir, step, loader.position(), metrics)
                    .instrument(tracing::info_span!("checkpoint_upload"))
                    .await?;
                saved = Some(dir);
            }
            if let Some(dir) = saved
                && let Err(e) = std::fs::remove_dir_all(&dir)
            {
                tracing::warn!("cannot remove {}: {e}", dir.display());
            }
            Ok::<_, Stop>(true)
        }
        .instrument(span)
        .await?;
        if !more {
            break;
        }
    }
    Ok(())
}

/// The loss's metrics on the held-out rows as `validation/<name>`, with the time it took.
async fn evaluate(ctx: &RunContext, rows: &TrainBatch) -> Result<BTreeMap<String, f64>> {
    let started = Instant::now();
    let evaluated = ctx.session()?.evaluate(rows.clone()).instrument(tracing::info_span!("validation")).await?;
    let mut metrics: BTreeMap<String, f64> =
        evaluated.metrics.into_iter().map(|(name, value)| (format!("validation/{name}"), value)).collect();
    metrics.insert("timing/validation/total_validation_time".into(), seconds(started));
    Ok(metrics)
}

fn batch_of(rows: Vec<Row>) -> TrainBatch {
    TrainBatch {
        input_ids: rows.iter().map(|r| r.ids.clone()).collect(),
        token_mask: rows.into_iter().map(|r| r.mask).collect(),
        ..TrainBatch::default()
    }
}

fn rows_of(prompting: &Prompting, records: &[&Record], pairwise: bool) -> Result<Vec<Row>> {
    let mut rows = Vec::with_capacity(records.len() * 2);
    for record in records {
        if pairwise {
            let (chosen, rejected) = prompting.pair_rows(record)?;
            rows.push(chosen);
            rows.push(rejected);
        } else {
            rows.push(prompting.sft_row(record)?);
        }
    }
    Ok(rows)
}
