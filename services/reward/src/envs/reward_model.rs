//! `reward_model`: scores from a Bradley–Terry reward model trained by Keel, served by a
//! trainer worker that the run has claimed and loaded the model on (`<prefix>.trainer.
//! <worker>.score`). Samples must carry their conversation's `token_ids` (the orchestrator
//! keeps token ids end to end; nothing is re-tokenised here). The reward is the model's score
//! on the last token.

use std::time::Duration;

use futures::future::BoxFuture;
use keel_protocol::reward::{EnvSample, EnvStepResult, RewardModelConfig, SampleError};
use keel_protocol::subjects::{TrainerOp, is_subject_token};
use keel_protocol::trainer::{ScoreReply, ScoreRequest, Sequences};
use keel_protocol::{Payload, Reply, Subjects};

use crate::env::{Environment, Outcome};

/// Tokens per trainer request, so that a request stays well under NATS's 1 MiB.
const TOKENS_PER_REQUEST: usize = 100_000;

#[derive(Debug)]
pub struct RewardModelEnv {
    run_id: String,
    subject: String,
    timeout: Duration,
    nats: async_nats::Client,
}

impl RewardModelEnv {
    pub fn new(
        config: &RewardModelConfig,
        nats: Option<async_nats::Client>,
        subjects: Subjects,
    ) -> Result<Self, String> {
        if !is_subject_token(&config.worker_id) {
            return Err("worker_id: must name a trainer worker (letters, digits, `-`, `_`)".into());
        }
        if config.run_id.is_empty() {
            return Err("run_id: must name the run that holds the worker".into());
        }
        let nats = nats.ok_or("name: reward_model needs the service connected to NATS (its nats_url is empty)")?;
        let timeout = Duration::from_millis(if config.timeout_ms == 0 { 30_000 } else { config.timeout_ms });
        Ok(Self {
            run_id: config.run_id.clone(),
            subject: subjects.trainer(&config.worker_id, TrainerOp::Score),
            timeout,
            nats,
        })
    }

    async fn score(&self, input_ids: Vec<Vec<i64>>) -> Result<Vec<f32>, SampleError> {
        let n = input_ids.len();
        let request = ScoreRequest { run_id: self.run_id.clone(), batch: Payload::Inline(Sequences { input_ids }) };
        let body = serde_json::to_vec(&request).map_err(|e| SampleError::new("internal", e.to_string()))?;
        let ask = self.nats.request(self.subject.clone(), body.into());
        let message = tokio::time::timeout(self.timeout, ask)
            .await
            .map_err(|_| {
                SampleError::new("timeout", format!("{} did not answer within {:?}", self.subject, self.timeout))
            })?
            .map_err(|e| SampleError::new("trainer", format!("{}: {e}", self.subject)))?;
        match serde_json::from_slice::<Reply<ScoreReply>>(&message.payload) {
            Ok(Reply::Ok(reply)) if reply.scores.len() == n => Ok(reply.scores),
            Ok(Reply::Ok(reply)) => {
                Err(SampleError::new("trainer", format!("{} scores for {n} sequences", reply.scores.len())))
            }
            Ok(Reply::Error(e)) => Err(SampleError::new("trainer", e.to_string())),
            Err(e) => Err(SampleError::new("trainer", format!("malformed trainer reply: {e}"))),
        }
    }
}

impl Environment for RewardModelEnv {
    fn step<'a>(&'a self, samples: &'a [EnvSample]) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let mut outcomes: Vec<Outcome> = samples
                .iter()
                .map(|s| match &s.token_ids {
                    Some(ids) if !ids.is_empty() => Ok(EnvStepResult::done(0.0, s.metadata.clone())),
                    _ => {
                        Err(SampleError::new("invalid_sample", "token_ids: reward_model scores token ids; none given"))
                    }
                })
                .collect();
            let ready: Vec<usize> = (0..samples.len()).filter(|i| outcomes[*i].is_ok()).collect();
            let mut start = 0;
            while start < ready.len() {
                let mut end = start;
                let mut tokens = 0;
                while end < ready.len()
                    && (end == start || tokens + ids_len(&samples[ready[end]]) <= TOKENS_PER_REQUEST)
                {
                    tokens += ids_len(&samples[ready[end]]);
                    end += 1;
                }
                let chunk = &ready[start..end];
                let ids = chunk.iter().map(|i| samples[*i].token_ids.clone().unwrap_or_default()).collect();
                match self.score(ids).await {
                    Ok(scores) => {
                        for (i, score) in chunk.iter().zip(scores) {
                            if let Ok(result) = &mut outcomes[*i] {
                                result.reward = f64::from(score);
                            }
                        }
                    }
                    Err(e) => chunk.iter().for_each(|i| outcomes[*i] = Err(e.clone())),
                }
                start = end;
            }
            outcomes
        })
    }
}

fn ids_len(sample: &EnvSample) -> usize {
    sample.token_ids.as_ref().map_or(0, Vec::len)
}
