//! `reward_model`: scores from a Bradley–Terry reward model trained by Keel, served by a
//! trainer worker that the run has claimed and loaded the model on (`<prefix>.trainer.
//! <worker>.score`). Samples must carry their conversation's `token_ids` (the orchestrator
//! keeps token ids end to end; nothing is re-tokenised here). The reward is the model's score
//! on the last token. A batch too large for one NATS message travels through the JetStream
//! object store, as every trainer request does.

use keel_protocol::FieldError;
use std::time::Duration;

use futures::future::BoxFuture;
use keel_protocol::reward::{EnvSample, EnvStepResult, RewardModelConfig, SampleError};
use keel_protocol::subjects::is_subject_token;
use keel_protocol::trainer::{ScoreRequest, Sequences, TrainerCall};
use keel_protocol::{Reply, Subjects};
use keel_service::nats::Bulk;
use tokio::sync::OnceCell;

use crate::envs::{Environment, Outcome};

#[derive(Debug)]
pub struct RewardModelEnv {
    run_id: String,
    subject: String,
    timeout: Duration,
    nats: async_nats::Client,
    bucket: String,
    bulk: OnceCell<Bulk>,
}

impl RewardModelEnv {
    pub fn new(
        config: &RewardModelConfig,
        nats: Option<async_nats::Client>,
        subjects: Subjects,
        bucket: &str,
    ) -> Result<Self, FieldError> {
        if !is_subject_token(&config.worker_id) {
            return Err(FieldError::new("worker_id", "must name a trainer worker (letters, digits, `-`, `_`)"));
        }
        if config.run_id.is_empty() {
            return Err(FieldError::new("run_id", "must name the run that holds the worker"));
        }
        let nats = nats.ok_or_else(|| {
            FieldError::new("name", "reward_model needs the service connected to NATS (its nats_url is empty)")
        })?;
        let timeout = Duration::from_millis(if config.timeout_ms == 0 { 30_000 } else { config.timeout_ms });
        Ok(Self {
            run_id: config.run_id.clone(),
            subject: subjects.trainer(&config.worker_id, ScoreRequest::OP),
            timeout,
            nats,
            bucket: bucket.to_string(),
            bulk: OnceCell::new(),
        })
    }

    async fn score(&self, input_ids: Vec<Vec<i64>>) -> Result<Vec<f32>, SampleError> {
        let n = input_ids.len();
        let trainer = |m: String| SampleError::new("trainer", m);
        let bulk_failed = |e: keel_service::BulkError| trainer(e.to_string());
        let bulk =
            self.bulk.get_or_try_init(|| Bulk::open(self.nats.clone(), &self.bucket)).await.map_err(bulk_failed)?;
        let batch = bulk.wrap(Sequences { input_ids }).await.map_err(bulk_failed)?;
        let request = ScoreRequest { run_id: self.run_id.clone(), batch };
        let body = serde_json::to_vec(&request).map_err(|e| SampleError::new("internal", e.to_string()))?;
        let headers = keel_telemetry::nats_headers();
        let message = keel_service::nats::request(&self.nats, self.subject.clone(), headers, body, self.timeout)
            .await
            .map_err(|e| match e.kind() {
                async_nats::RequestErrorKind::TimedOut => {
                    SampleError::new("timeout", format!("{} did not answer within {:?}", self.subject, self.timeout))
                }
                _ => trainer(format!("{}: {e}", self.subject)),
            })?;
        match serde_json::from_slice::<Reply<<ScoreRequest as TrainerCall>::Reply>>(&message.payload) {
            Ok(Reply::Ok(reply)) if reply.scores.len() == n => Ok(reply.scores),
            Ok(Reply::Ok(reply)) => Err(trainer(format!("{} scores for {n} sequences", reply.scores.len()))),
            Ok(Reply::Error(e)) => Err(trainer(e.to_string())),
            Err(e) => Err(trainer(format!("malformed trainer reply: {e}"))),
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
            if ready.is_empty() {
                return outcomes;
            }
            let ids = ready.iter().map(|i| samples[*i].token_ids.clone().unwrap_or_default()).collect();
            match self.score(ids).await {
                Ok(scores) => {
                    for (i, score) in ready.iter().zip(scores) {
                        if let Ok(result) = &mut outcomes[*i] {
                            result.reward = f64::from(score);
                        }
                    }
                }
                Err(e) => ready.iter().for_each(|i| outcomes[*i] = Err(e.clone())),
            }
            outcomes
        })
    }
}
