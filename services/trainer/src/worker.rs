//! The NATS side of a trainer worker.
//!
//! While free, the worker is in the `trainer` queue group on `<prefix>.trainer.claim`, so a
//! claim reaches exactly one free worker; once claimed it leaves the group, and its own
//! `<prefix>.trainer.<worker>.claim` refuses other runs with `busy`. The claiming run then
//! drives it on `<prefix>.trainer.<worker>.<op>`. Every request and heartbeat renews the
//! lease; when the lease runs out with nothing in flight (the orchestrator disappeared),
//! the worker drops the run's models and rejoins the group.
//!
//! Requests are answered from spawned tasks, so a heartbeat or a refused claim is answered
//! while a training step runs; model work is serialised on the [`EngineThread`].

use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::{Client, Message};
use bytes::Bytes;
use futures::StreamExt;
use keel_service::lease::ClaimGroup;
use keel_service::paths::PathRoots;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{Instrument, info, info_span, warn};

use keel_model::packing::{PackTarget, Packed};
use keel_protocol::generator::{AdapterRefit, BucketAt, CollectiveBuffer, WeightBucket, WeightBuckets};
use keel_protocol::subjects::{TRAINER_QUEUE_GROUP, TrainerOp};
use keel_protocol::trainer::{
    ClaimReply, ClaimRequest, EvaluateReply, EvaluateRequest, ExportReply, ExportRequest, ExportTo, HeartbeatReply,
    HeartbeatRequest, LoadReply, LoadRequest, Logprobs, LogprobsReply, LogprobsRequest, Memory, MemoryMoved,
    OffloadRequest, OnloadRequest, ReleaseRequest, Released, SaveReply, SaveRequest, ScoreReply, ScoreRequest,
    SendAccepted, SendWeights, Timing, TrainReply, TrainRequest, TrainerCall, error_types,
};
use keel_protocol::{Reply, Subjects, join_problems};
use keel_service::nats::Bulk;
use keel_training::Trainer;
use keel_training::actor::EngineThread;
use keel_training::{Error, Result};

use crate::group::{self, Command, Leader, Meeting};

mod collective;
mod export;
mod objects;
mod shared_memory;

use collective::{accept, send_weights};
use export::export;

/// How often an expired lease is looked for.
const LEASE_CHECK: Duration = Duration::from_millis(200);

/// What the request tasks share.
#[derive(Debug)]
struct Shared {
    client: Client,
    worker_id: String,
    device: String,
    /// Which run holds this worker, and its lease.
    leases: keel_service::lease::Leases,
    engine: EngineThread,
    bulk: Bulk,
    /// Where loads and saves may read and write.
    roots: PathRoots,
    /// The shared-memory directories the claiming run exported into, removed when it lets
    /// the worker go (or its lease runs out).
    exports: Mutex<Vec<std::path::PathBuf>>,
    /// The newest exports kept in one buffer (in GPU memory for CUDA IPC; on the training
    /// device for the collective transfer), by id, newest last, kept while generators may
    /// still copy them and freed when the run lets the worker go.
    device_exports: Mutex<std::collections::VecDeque<(String, tch::Tensor)>>,
    /// Where a generator receiving an export over TCP reaches this worker (or why no address
    /// towards NATS was found: the collective transfer on the CPU is then refused with it).
    send_ip: std::result::Result<std::net::IpAddr, keel_collective::Error>,
    /// This worker's subjects for the collective transfer: where generators ask, and the
    /// prefix the two sides meet under.
    send_subjects: (String, String),
    /// Communicators kept with generators by session, and the device they are on, newest
    /// last (see [`KEPT_LINKS`]).
    links: Mutex<std::collections::VecDeque<(String, tch::Device, keel_collective::SharedComm)>>,
    /// When this worker leads a group of trainer processes: the group, and where its ranks
    /// meet.
    group: Option<(Arc<Leader>, Meeting)>,
}

/// A request-level failure: a typed error reply.
#[derive(Debug)]
struct Refusal {
    kind: &'static str,
    message: String,
}

impl From<Error> for Refusal {
    fn from(e: Error) -> Self {
        Self { kind: e.kind(), message: e.to_string() }
    }
}

impl From<keel_protocol::ErrorBody> for Refusal {
    fn from(e: keel_protocol::ErrorBody) -> Self {
        let kind = [error_types::BUSY, error_types::WRONG_RUN, error_types::STALE_HOLDER, error_types::INVALID_REQUEST]
            .into_iter()
            .find(|k| *k == e.kind)
            .unwrap_or(error_types::INTERNAL);
        Self { kind, message: e.message }
    }
}

fn refuse(kind: &'static str, message: impl std::fmt::Display) -> Refusal {
    Refusal { kind, message: message.to_string() }
}

type Answer<T> = std::result::Result<T, Refusal>;

fn parse<T: DeserializeOwned>(payload: &[u8]) -> Answer<T> {
    serde_json::from_slice(payload).map_err(|e| refuse(error_types::INVALID_REQUEST, format!("malformed request: {e}")))
}

fn memory() -> Memory {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kb| kb.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    Memory { rss_bytes: field("VmRSS:"), peak_rss_bytes: field("VmHWM:") }
}

impl Shared {
    fn is_claimed(&self) -> bool {
        self.leases.is_claimed()
    }

    /// Whether the worker can take a run: it is no group's leader, or its group is whole.
    fn is_ready(&self) -> bool {
        self.group.as_ref().is_none_or(|(leader, _)| leader.is_whole())
    }

    /// `make()` for the other ranks of this worker's group (`None`: no group, and `make` is
    /// not called).
    fn command(&self, make: impl FnOnce() -> Command) -> Option<Command> {
        self.group.as_ref().map(|_| make())
    }

    /// Runs `work` on the engine thread; in a group, every other rank runs `command` (made
    /// by [`Shared::command`]) alongside it and the leader answers for all of them.
    async fn on_ranks<R: Send + 'static>(
        &self,
        command: Option<Command>,
        work: impl FnOnce(&mut Option<Trainer>) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        match (&self.group, command) {
            (Some((leader, _)), Some(command)) => {
                let _turn = leader.turn.lock().await;
                let control = leader.control()?;
                let lead = leader.clone();
                self.engine.call(move |slot| lead.lead(&control, &command, || group::run_rank(slot, work))).await
            }
            _ => self.engine.call(work).await,
        }
    }

    fn claim(&self, request: ClaimRequest) -> Answer<ClaimReply> {
        if let Some((leader, _)) = self.group.as_ref().filter(|(leader, _)| !leader.is_whole()) {
            return Err(refuse(
                error_types::BUSY,
                format!(
                    "worker {} leads trainer group `{}`, which is waiting for its {} ranks",
                    self.worker_id, leader.config.name, leader.config.size
                ),
            ));
        }
        Ok(self.leases.claim(request)?)
    }

    fn claim_body(&self, payload: &[u8]) -> Vec<u8> {
        encode(parse(payload).and_then(|r| self.claim(r)))
    }

    /// Records whether `run_id`'s models are loaded (reported by heartbeats).
    fn set_loaded(&self, run_id: &str, loaded: bool) {
        self.leases.set_loaded(run_id, loaded);
    }

    /// Releases the claim when its lease ran out with nothing in flight.
    async fn expire(&self) {
        if let Some(held) = self.leases.take_expired() {
            warn!(run_id = %held.run_id, "lease expired; releasing the worker");
            self.drop_models().await;
            self.drop_exports().await;
        }
    }

    /// Removes the run's exports in shared memory (on the blocking pool) and in GPU memory.
    async fn drop_exports(&self) {
        self.device_exports.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
        let dirs = std::mem::take(&mut *self.exports.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        let removed = tokio::task::spawn_blocking(move || {
            for dir in dirs {
                if let Err(e) = std::fs::remove_dir_all(&dir)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    warn!("cannot remove the exports in {}: {e}", dir.display());
                }
            }
        });
        if let Err(e) = removed.await {
            warn!("removing the exports failed: {e}");
        }
    }

    /// Drops the run's models (on every rank of a group that is whole).
    async fn drop_models(&self) {
        let whole = self.group.as_ref().is_some_and(|(leader, _)| leader.is_whole());
        if !whole {
            return group::drop_models(&self.engine).await;
        }
        let dropped = self
            .on_ranks(Some(Command::Drop), |engine| {
                *engine = None;
                Ok(())
            })
            .await;
        if let Err(e) = dropped {
            warn!("could not drop the models on every rank: {e}");
            group::drop_models(&self.engine).await;
        }
    }

    /// Serves operation `op` with `work`, whose request type names that operation (checked)
    /// and whose answer is that operation's reply (by its type).
    async fn op<R, Fut>(
        self: &Arc<Self>,
        op: TrainerOp,
        payload: &[u8],
        holder: Option<&str>,
        work: impl FnOnce(Arc<Self>, R) -> Fut,
    ) -> Answer<R::Reply>
    where
        R: TrainerCall,
        Fut: std::future::Future<Output = Answer<R::Reply>>,
    {
        if R::OP != op {
            return Err(refuse(
                error_types::INTERNAL,
                format!("operation {} was routed to the handler of {}", op.name(), R::OP.name()),
            ));
        }
        let request: R = parse(payload)?;
        let run_id = request.run_id().to_string();
        tracing::Span::current().record("run_id", run_id.as_str());
        self.leases.admit(&run_id, holder)?;
        let outcome = work(self.clone(), request).await;
        self.leases.finish(&run_id);
        outcome
    }

    async fn handle(self: Arc<Self>, op: TrainerOp, payload: Bytes, holder: Option<String>) -> Vec<u8> {
        let payload = &payload[..];
        let h = holder.as_deref();
        match op {
            TrainerOp::Claim => self.claim_body(payload),
            TrainerOp::Heartbeat => encode(self.op(op, payload, h, heartbeat).await),
            TrainerOp::Release => encode(self.release(payload, h).await),
            TrainerOp::Load => encode(self.op(op, payload, h, load).await),
            TrainerOp::Logprobs => encode(self.op(op, payload, h, logprobs).await),
            TrainerOp::Train => encode(self.op(op, payload, h, train).await),
            TrainerOp::Evaluate => encode(self.op(op, payload, h, evaluate).await),
            TrainerOp::Score => encode(self.op(op, payload, h, score).await),
            TrainerOp::Save => encode(self.op(op, payload, h, save).await),
            TrainerOp::Export => encode(self.op(op, payload, h, export).await),
            TrainerOp::Offload => encode(self.op(op, payload, h, offload).await),
            TrainerOp::Onload => encode(self.op(op, payload, h, onload).await),
        }
    }

    async fn release(&self, payload: &[u8], holder: Option<&str>) -> Answer<Released> {
        let request: ReleaseRequest = parse(payload)?;
        self.leases.release(&request.run_id, holder)?;
        info!(run_id = %request.run_id, "released");
        self.drop_models().await;
        self.drop_exports().await;
        Ok(Released { worker_id: self.worker_id.clone() })
    }
}

fn encode<T: Serialize>(answer: Answer<T>) -> Vec<u8> {
    let reply = match answer {
        Ok(value) => Reply::Ok(value),
        Err(refusal) => Reply::error(refusal.kind, refusal.message),
    };
    serde_json::to_vec(&reply).unwrap_or_else(|e| {
        format!(r#"{{"error":{{"type":"internal","message":"cannot encode the reply: {e}"}}}}"#).into_bytes()
    })
}

async fn heartbeat(shared: Arc<Shared>, _: HeartbeatRequest) -> Answer<HeartbeatReply> {
    Ok(shared.leases.heartbeat()?)
}

async fn load(shared: Arc<Shared>, request: LoadRequest) -> Answer<LoadReply> {
    let paths = std::iter::once(("policy.path", &request.policy))
        .chain(request.reference.iter().map(|r| ("reference.path", r)));
    for (what, source) in paths {
        let dir = shared.roots.check(what, &source.path).map_err(|e| refuse(error_types::INVALID_REQUEST, e))?;
        // An adapter directory inside the roots must not lead outside them to its base.
        if let Some(base) = keel_model::lora::adapter_base(&dir).map_err(|e| refuse(error_types::INVALID_REQUEST, e))? {
            let what = format!("{what} (its adapter's base_model_name_or_path)");
            shared
                .roots
                .check(&what, &base.display().to_string())
                .map_err(|e| refuse(error_types::INVALID_REQUEST, e))?;
        }
    }
    let problems = request.training.problems("training");
    if !problems.is_empty() {
        return Err(Error::InvalidConfig(join_problems(&problems)).into());
    }
    let started = Instant::now();
    let device = shared.device.clone();
    let run_id = request.run_id.clone();
    let span = info_span!("load", run_id = %request.run_id, policy = %request.policy.path);
    let summary = |engine: &Trainer| {
        let summary = (engine.parameters(), engine.step(), engine.has_reference(), engine.has_value_head());
        let tensor_parallel_size = engine.tensor_parallel_size();
        let data_parallel_size = engine.data_parallel_size();
        info!(parameters = summary.0, step = summary.1, tensor_parallel_size, data_parallel_size, "models loaded");
        (summary, tensor_parallel_size)
    };
    let loaded = match &shared.group {
        Some((leader, meeting)) => {
            group::lead_load(leader, meeting, &shared.engine, request, &device, summary).instrument(span).await
        }
        None => {
            shared
                .engine
                .call(move |slot| {
                    *slot = None;
                    let engine = Trainer::load(&request, &device)?;
                    let read = summary(&engine);
                    *slot = Some(engine);
                    Ok(read)
                })
                .instrument(span)
                .await
        }
    };
    // A failed load leaves no models (the old ones were dropped first).
    shared.set_loaded(&run_id, loaded.is_ok());
    let ((parameters, step, has_reference, has_value_head), tensor_parallel_size) = loaded?;
    let timing = Timing::from([("load".to_string(), started.elapsed().as_secs_f64())]);
    Ok(LoadReply { parameters, step, has_reference, has_value_head, tensor_parallel_size, timing, memory: memory() })
}

fn loaded(slot: &mut Option<Trainer>) -> Result<&mut Trainer> {
    slot.as_mut().ok_or(Error::NotLoaded)
}

async fn fetch<T: DeserializeOwned>(shared: &Shared, payload: keel_protocol::Payload<T>) -> Answer<T> {
    shared.bulk.fetch(payload).await.map_err(|e| refuse(error_types::PAYLOAD, e))
}

async fn logprobs(shared: Arc<Shared>, request: LogprobsRequest) -> Answer<LogprobsReply> {
    let started = Instant::now();
    let sequences = fetch(&shared, request.batch).await?;
    let (scorer, temperature) = (request.model, request.temperature);
    let command = shared.command(|| Command::Logprobs { scorer, sequences: sequences.input_ids.clone(), temperature });
    let rows = shared
        .on_ranks(command, move |slot| loaded(slot)?.logprobs(scorer, sequences.input_ids, temperature))
        .instrument(info_span!("logprobs", run_id = %request.run_id))
        .await?;
    let logprobs = shared.bulk.wrap(Logprobs { logprobs: rows }).await.map_err(|e| refuse(error_types::PAYLOAD, e))?;
    let timing = Timing::from([("logprobs".to_string(), started.elapsed().as_secs_f64())]);
    Ok(LogprobsReply { logprobs, timing, memory: memory() })
}

/// A sampling temperature the logits can be divided by.
fn positive_temperature(temperature: f64) -> Answer<f64> {
    if temperature.is_finite() && temperature > 0.0 {
        Ok(temperature)
    } else {
        Err(refuse(error_types::INVALID_REQUEST, format!("temperature must be positive, got {temperature}")))
    }
}

async fn train(shared: Arc<Shared>, request: TrainRequest) -> Answer<TrainReply> {
    let batch = fetch(&shared, request.batch).await?;
    let temperature = positive_temperature(request.temperature)?;
    let command = shared.command(|| Command::Train { batch: batch.clone(), temperature });
    let trained = shared
        .on_ranks(command, move |slot| loaded(slot)?.train(batch, temperature))
        .instrument(info_span!("train", run_id = %request.run_id))
        .await?;
    Ok(TrainReply { steps: trained.steps, tokens: trained.tokens, timing: trained.timing, memory: memory() })
}

async fn evaluate(shared: Arc<Shared>, request: EvaluateRequest) -> Answer<EvaluateReply> {
    let batch = fetch(&shared, request.batch).await?;
    let temperature = positive_temperature(request.temperature)?;
    let command = shared.command(|| Command::Evaluate { batch: batch.clone(), temperature });
    let evaluated = shared
        .on_ranks(command, move |slot| loaded(slot)?.evaluate(batch, temperature))
        .instrument(info_span!("evaluate", run_id = %request.run_id))
        .await?;
    Ok(EvaluateReply {
        metrics: evaluated.metrics,
        tokens: evaluated.tokens,
        timing: evaluated.timing,
        memory: memory(),
    })
}

async fn score(shared: Arc<Shared>, request: ScoreRequest) -> Answer<ScoreReply> {
    let started = Instant::now();
    let sequences = fetch(&shared, request.batch).await?;
    let command = shared.command(|| Command::Scores { sequences: sequences.input_ids.clone() });
    let scores = shared
        .on_ranks(command, move |slot| loaded(slot)?.scores(&sequences.input_ids))
        .instrument(info_span!("score", run_id = %request.run_id))
        .await?;
    let timing = Timing::from([("score".to_string(), started.elapsed().as_secs_f64())]);
    Ok(ScoreReply { scores, timing })
}

async fn save(shared: Arc<Shared>, request: SaveRequest) -> Answer<SaveReply> {
    shared.roots.check("path", &request.path).map_err(|e| refuse(error_types::INVALID_REQUEST, e))?;
    let started = Instant::now();
    let path = request.path.clone();
    let command = shared.command(|| Command::Save { path: request.path.clone(), info: request.info.clone() });
    let (step, files) = shared
        .on_ranks(command, move |slot| loaded(slot)?.save(std::path::PathBuf::from(&request.path), request.info))
        .instrument(info_span!("save", path = %path))
        .await?;
    let timing = Timing::from([("save".to_string(), started.elapsed().as_secs_f64())]);
    Ok(SaveReply { path, step, files, timing })
}

/// Colocated runs: the optimiser's state (and the weights, by request) to host memory.
async fn offload(shared: Arc<Shared>, request: OffloadRequest) -> Answer<MemoryMoved> {
    let started = Instant::now();
    let weights = request.weights;
    let command = shared.command(|| Command::Offload { weights });
    let bytes = shared
        .on_ranks(command, move |slot| loaded(slot)?.offload(weights))
        .instrument(info_span!("offload", weights))
        .await?;
    Ok(MemoryMoved { bytes, seconds: started.elapsed().as_secs_f64() })
}

/// What `offload` moved, back on the training device.
async fn onload(shared: Arc<Shared>, _request: OnloadRequest) -> Answer<MemoryMoved> {
    let started = Instant::now();
    let command = shared.command(|| Command::Onload);
    let bytes = shared.on_ranks(command, |slot| loaded(slot)?.onload()).instrument(info_span!("onload")).await?;
    Ok(MemoryMoved { bytes, seconds: started.elapsed().as_secs_f64() })
}

/// A running worker; dropping the shutdown future's sender or completing it stops it.
#[derive(Debug)]
pub struct Worker {
    shared: Arc<Shared>,
    subjects: Subjects,
}

impl Worker {
    pub fn new(
        client: Client,
        subjects: Subjects,
        worker_id: String,
        config: &crate::Config,
        bulk: Bulk,
        roots: PathRoots,
        group: Option<Meeting>,
    ) -> std::io::Result<Self> {
        let device = config.device.clone();
        let leases = keel_service::lease::Leases::new("worker", worker_id.clone(), config.max_lease_seconds);
        let engine = EngineThread::start()?;
        let (exports, device_exports) = (Mutex::default(), Mutex::default());
        let send_ip = match &group {
            Some(meeting) => Ok(meeting.ip),
            None => keel_collective::process::ip_towards_nats(&config.nats_url),
        };
        let send_subjects = (subjects.trainer_send_weights(&worker_id), subjects.trainer_weights_meeting(&worker_id));
        let group = group.map(|meeting| (Arc::new(Leader::new(meeting.config.clone())), meeting));
        let shared = Shared {
            client,
            worker_id,
            device,
            leases,
            engine,
            bulk,
            roots,
            exports,
            device_exports,
            send_ip,
            send_subjects,
            links: Mutex::default(),
            group,
        };
        Ok(Self { shared: Arc::new(shared), subjects })
    }

    pub fn id(&self) -> &str {
        &self.shared.worker_id
    }

    /// Whether a run holds this worker, readable after [`Worker::serve`] took the worker.
    pub fn claimed_probe(&self) -> impl Fn() -> bool + Clone + Send + Sync + 'static {
        let shared = self.shared.clone();
        move || shared.is_claimed()
    }

    fn respond(&self, message: Message, op: TrainerOp) {
        let Some(reply_to) = message.reply.clone() else {
            warn!(subject = %message.subject, "request without a reply subject ignored");
            return;
        };
        let shared = self.shared.clone();
        // Claims are decided here, before the loop updates the queue-group membership;
        // everything else runs in its own task.
        let decided = (op == TrainerOp::Claim).then(|| shared.claim_body(&message.payload));
        tokio::spawn(async move {
            let client = shared.client.clone();
            let operation = format!("trainer.{}", op.name());
            let body = keel_service::nats::served(&client, &operation, &message, async {
                match decided {
                    Some(body) => body,
                    None => {
                        let holder = keel_service::lease::holder_of(&message);
                        shared.handle(op, message.payload.clone(), holder).await
                    }
                }
            })
            .await;
            if let Err(e) = client.publish(reply_to, body.into()).await {
                warn!("cannot send a reply: {e}");
            }
        });
    }

    /// Answers a generator's [`SendWeights`] at once (accepted, or why not), then sends.
    fn send(&self, message: Message) {
        let Some(reply_to) = message.reply.clone() else {
            warn!(subject = %message.subject, "request without a reply subject ignored");
            return;
        };
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let client = shared.client.clone();
            let mut accepted = None;
            let body = keel_service::nats::served(&client, "trainer.send_weights", &message, async {
                let decided = accept(&shared, &message.payload);
                let answer = decided.map(|(reply, transfer)| {
                    accepted = Some(transfer);
                    reply
                });
                encode(answer)
            })
            .await;
            if let Err(e) = client.publish(reply_to, body.into()).await {
                warn!("cannot answer a request for weights: {e}");
                return;
            }
            if let Some(transfer) = accepted {
                let span = info_span!("send_weights", export = %transfer.export, reused = transfer.link.is_some());
                if let Err(e) = send_weights(shared, transfer).instrument(span).await {
                    warn!("a collective transfer failed: {e}");
                }
            }
        });
    }

    /// Serves until `shutdown` completes.
    pub async fn serve(self, shutdown: impl std::future::Future<Output = ()>) -> keel_service::Result<()> {
        use keel_service::Error;
        let client = self.shared.client.clone();
        let subscribe_failed =
            |subject: String| move |e: async_nats::SubscribeError| Error::Subscribe { subject, reason: e.to_string() };
        let own_subjects = self.subjects.trainer_all(self.id());
        let mut own = client.subscribe(own_subjects.clone()).await.map_err(subscribe_failed(own_subjects))?;
        // A group's leader takes claims once its group is whole (its keeper forms it).
        let keeper = self.shared.group.as_ref().map(|(leader, meeting)| {
            tokio::spawn(group::keep(leader.clone(), meeting.clone(), self.shared.engine.clone()))
        });
        let mut group = ClaimGroup::new(client.clone(), self.subjects.trainer_claim(), TRAINER_QUEUE_GROUP);
        group.set_free(self.shared.is_ready()).await?;
        client.flush().await.map_err(|e| Error::start("flush NATS", e))?;
        info!(worker_id = %self.id(), claim = %self.subjects.trainer_claim(), "trainer worker ready");
        let mut tick = tokio::time::interval(LEASE_CHECK);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                message = own.next() => {
                    let Some(message) = message else { return Err(Error::PartStopped("the NATS subscription")) };
                    if message.subject.as_str() == self.shared.send_subjects.0 {
                        self.send(message);
                        continue;
                    }
                    let op = message.subject.rsplit('.').next().and_then(TrainerOp::from_name);
                    match op {
                        Some(op) => self.respond(message, op),
                        None => warn!(subject = %message.subject, "unknown trainer operation"),
                    }
                }
                Some(message) = group.next() => self.respond(message, TrainerOp::Claim),
                _ = tick.tick() => self.shared.expire().await,
            }
            // Free workers are in the claim group; held ones, and leaders of a group that is
            // not whole, are not.
            if let Err(e) = group.set_free(!self.shared.is_claimed() && self.shared.is_ready()).await {
                warn!("cannot rejoin the trainer queue group: {e}");
            }
        }
        if let Some(keeper) = keeper {
            keeper.abort();
        }
        info!("trainer worker stopping");
        Ok(())
    }
}
