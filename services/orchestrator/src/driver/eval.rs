//! Evaluation: the model (a directory or a checkpoint) served by the generators, the
//! validation set (or the training set when there is none) rolled out and scored; accuracy
//! and pass@k recorded as step 1 under `eval/`.

use keel_protocol::run::Algorithm;

use super::tokens::Prompting;
use super::{Result, RunContext, rollout};
use crate::data;
use crate::db::StepRecord;

pub async fn run(ctx: &RunContext) -> Result<()> {
    let spec = &ctx.spec;
    let dataset = spec.data.validation.as_ref().unwrap_or(&spec.data.train);
    let records = data::load_async(dataset, Algorithm::Eval, "data").await?;
    let start = ctx.start().await?;
    let prompting = Prompting::load(&start.base_dir, &spec.prompt, spec.max_total_sequence_length)?;
    ctx.load_generators(&start).await?;
    let (metrics, samples) =
        rollout::validate(ctx, &prompting, &records, (start.policy_dir.clone(), 0), 1, "eval").await?;
    ctx.store.record(&StepRecord { step: 1, metrics, samples, dataloader: serde_json::Value::Null }).await
}
