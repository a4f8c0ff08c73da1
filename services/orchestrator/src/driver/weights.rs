//! The run's side of the generators it holds: announcing new weights (a directory or an
//! export's buckets) to each of them and waiting for the first to serve them, announcing again
//! when a rollout finds a generator behind, deleting exports no generator needs, and the
//! colocated sleep and wake.

use std::path::Path;
use std::time::{Duration, Instant};

use keel_protocol::Subjects;
use keel_protocol::generator::{
    MemoryAction, MemoryChange, MemoryReport, RefitMode, WeightBuckets, WeightsLoaded, WeightsUpdated,
};
use keel_protocol::run::RunSpec;
use keel_service::nats::Bulk;
use uuid::Uuid;

use super::{REANNOUNCE_AFTER, REFIT_WAIT, Result, Stop, StopFlag};
use crate::clients::Nats;

#[derive(Debug)]
pub struct WeightPublisher {
    run_id: Uuid,
    client: async_nats::Client,
    subjects: Subjects,
    /// The object store the trainer exports into (its buckets are deleted from here).
    bulk: Bulk,
    stop: StopFlag,
    /// Colocated runs: whether a sleeping generator moves its weights to host memory too.
    offload_weights: bool,
    /// Async runs: how a refit treats the samples running (None: as the generator is set).
    refit_mode: Option<RefitMode>,
    /// The weights last announced, and when (a refusal announces them again, at most every
    /// [`REANNOUNCE_AFTER`]).
    announced: std::sync::Mutex<Option<(WeightsUpdated, Instant)>>,
}

impl WeightPublisher {
    /// The publisher of run `run_id` (run as `spec` says), on the orchestrator's NATS
    /// connection. An async run's refits come while its rollouts run: they drain the
    /// generators' running requests first, or pause them with `in_flight_weight_updates`.
    pub fn new(run_id: Uuid, nats: &Nats, stop: StopFlag, spec: &RunSpec) -> Self {
        let asynchronous = &spec.grpo.async_grpo;
        let refit_mode = asynchronous.enabled.then_some(if asynchronous.in_flight_weight_updates {
            RefitMode::Pause
        } else {
            RefitMode::Drain
        });
        Self {
            run_id,
            client: nats.client.clone(),
            subjects: nats.subjects.clone(),
            bulk: nats.bulk.clone(),
            stop,
            offload_weights: spec.generation.colocated.generator_offload_weights,
            refit_mode,
            announced: std::sync::Mutex::new(None),
        }
    }

    /// Tells the run's generators to serve `dir` as its weights at `version`.
    pub async fn publish_dir(&self, dir: &Path, version: u64) -> Result<Announcement> {
        let path = dir.to_string_lossy().into_owned();
        let refit_mode = self.refit_mode;
        self.announce(WeightsUpdated { run_id: self.run_id.to_string(), version, path, weights: None, refit_mode })
            .await
    }

    /// Tells the run's generators to serve the exported `weights` as `version`.
    pub async fn publish_export(&self, version: u64, weights: &WeightBuckets) -> Result<Announcement> {
        let event = WeightsUpdated {
            run_id: self.run_id.to_string(),
            version,
            path: String::new(),
            weights: Some(weights.clone()),
            refit_mode: self.refit_mode,
        };
        self.announce(event).await
    }

    /// Announces the weights of `version` (or newer) again unless that was done within
    /// [`REANNOUNCE_AFTER`]: the last announcement when it was of that version or a newer one
    /// (an async run's rollouts may ask for older weights than it last sent), else `dir`.
    pub async fn reannounce(&self, dir: &Path, version: u64) -> Result<()> {
        let last = self.announced.lock().ok().and_then(|a| a.clone());
        match last {
            Some((_, at)) if at.elapsed() < REANNOUNCE_AFTER => Ok(()),
            Some((event, _)) if event.version >= version => self.announce(event).await.map(drop),
            _ => self.publish_dir(dir, version).await.map(drop),
        }
    }

    /// Deletes exported weight buckets no generator needs any more (best effort: the object
    /// store expires them after a day anyway).
    pub async fn delete_exported(&self, weights: &WeightBuckets) {
        // Files in shared memory and buffers in GPU memory are the trainer's to free (it keeps
        // the newest few).
        for object in weights.buckets.iter().filter_map(|b| b.at.object()) {
            if let Err(e) = self.bulk.delete(object).await {
                tracing::warn!(run_id = %self.run_id, "cannot delete exported weights: {e}");
            }
        }
    }

    /// Colocated runs: has the generators sleep or wake, and waits for the first one's
    /// answer (up to [`REFIT_WAIT`]); a failure it reports fails the run.
    pub async fn generator_memory(&self, action: MemoryAction) -> Result<()> {
        let change = MemoryChange { run_id: self.run_id.to_string(), action, offload_weights: self.offload_weights };
        let subject = self.subjects.generator_memory(&self.run_id.to_string());
        let mut replies = self.broadcast(subject, &change, "a memory change").await?;
        let answer = first_answer(&mut replies, REFIT_WAIT, &self.stop, |_: &MemoryReport| true).await?;
        match answer {
            Some(MemoryReport { error: Some(e), .. }) => {
                Err(Stop::Failed(format!("the generator could not {}: {e}", action.verb())))
            }
            Some(_) => Ok(()),
            None => {
                tracing::warn!(run_id = %self.run_id, "no generator answered {action:?} within {REFIT_WAIT:?}");
                Ok(())
            }
        }
    }

    /// Publishes `event` with a reply subject of its own, on which generators report when
    /// they have loaded it.
    async fn announce(&self, event: WeightsUpdated) -> Result<Announcement> {
        let reports = self.broadcast(self.subjects.weights_updated(&event.run_id), &event, "weights").await?;
        let version = event.version;
        if let Ok(mut announced) = self.announced.lock() {
            *announced = Some((event, Instant::now()));
        }
        Ok(Announcement { version, reports, stop: self.stop.clone() })
    }

    /// Publishes `body` on `subject` (each of the run's generators hears it) with a reply subject of its
    /// own, and returns the subscription on which the answers come.
    async fn broadcast(
        &self,
        subject: String,
        body: &impl serde::Serialize,
        what: &str,
    ) -> Result<async_nats::Subscriber> {
        let failed = |e: &dyn std::fmt::Display| Stop::Failed(format!("cannot publish {what}: {e}"));
        let body = serde_json::to_vec(body).map_err(|e| Stop::Failed(e.to_string()))?;
        let inbox = self.client.new_inbox();
        let replies = self.client.subscribe(inbox.clone()).await.map_err(|e| failed(&e))?;
        self.client
            .publish_with_reply_and_headers(subject, inbox, keel_telemetry::nats_headers(), body.into())
            .await
            .map_err(|e| failed(&e))?;
        self.client.flush().await.map_err(|e| failed(&e))?;
        Ok(replies)
    }
}

/// Weights published to the generators, whose reports of loading them can be waited for.
#[derive(Debug)]
pub struct Announcement {
    version: u64,
    reports: async_nats::Subscriber,
    stop: StopFlag,
}

impl Announcement {
    /// The first generator's report of loading the announced version, waited for up to
    /// `limit` (None when no generator answered in time: the run's rollouts then wait for
    /// the weights themselves). A cancelled or lost run stops waiting.
    pub async fn first_report(mut self, limit: Duration) -> Result<Option<WeightsLoaded>> {
        let version = self.version;
        first_answer(&mut self.reports, limit, &self.stop, |r: &WeightsLoaded| r.version == version).await
    }
}

/// The first answer on `replies` that parses as a `T` that `wanted` accepts, waited for up
/// to `limit`; a cancelled or lost run stops waiting.
async fn first_answer<T: serde::de::DeserializeOwned>(
    replies: &mut async_nats::Subscriber,
    limit: Duration,
    stop: &StopFlag,
    wanted: impl Fn(&T) -> bool,
) -> Result<Option<T>> {
    use futures::StreamExt;
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        stop.check()?;
        let tick = (tokio::time::Instant::now() + Duration::from_secs(1)).min(deadline);
        match tokio::time::timeout_at(tick, replies.next()).await {
            Ok(Some(message)) => match serde_json::from_slice::<T>(&message.payload) {
                Ok(answer) if wanted(&answer) => return Ok(Some(answer)),
                Ok(_) => {}
                Err(e) => tracing::warn!("malformed answer ignored: {e}"),
            },
            Ok(None) => return Ok(None),
            Err(_) if tick >= deadline => return Ok(None),
            Err(_) => {}
        }
    }
}
