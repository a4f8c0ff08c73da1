//! A run's side of the generators it holds: its rollout requests on
//! `<prefix>.run.<run>.generate` (queue group `generator`, so any of the run's generators may
//! answer), its weights-updated events on `<prefix>.run.<run>.weights` and its colocated
//! sleep and wake on `<prefix>.run.<run>.memory` (each of its generators hears them). No
//! other run's requests reach a generator while the run holds it. Replies use the
//! `{"ok"} / {"error": {type, message}}` envelope.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use keel_model::sampling::SamplingParams;
use keel_protocol::generator::{
    BucketAt, MemoryAction, MemoryChange, MemoryReport, RolloutReply, RolloutRequest, RolloutSample, WeightsLoaded,
    WeightsUpdated, error_types,
};
use keel_protocol::subjects::GENERATOR_QUEUE_GROUP;
use keel_protocol::trainer::{SendAccepted, SendWeights};
use keel_protocol::{Reply, Subjects};
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::Error;
use crate::openai::AppState;
use keel_generation::backend::Weights;
use keel_generation::engine::Memory;
use keel_generation::request::{Draft, collect};

/// The latest weight version this generator refused to load, and why: a rollout that needs
/// it is told so at once instead of waiting for weights that will never come.
type RefusedRefit = Arc<Mutex<Option<(u64, String)>>>;

/// Rollouts under way by `request_id`, each with the reply body it will send: a retry of
/// one (same id) waits for that reply instead of generating again.
type InFlight = Arc<Mutex<HashMap<String, tokio::sync::watch::Receiver<Option<Arc<Vec<u8>>>>>>>;

/// The request id of a rollout payload, if it names one (read before the full parse).
fn request_id(payload: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Id {
        request_id: Option<String>,
    }
    serde_json::from_slice::<Id>(payload).ok()?.request_id
}

/// Serves a rollout message once per request id: the first copy runs `work` and shares its
/// reply body; copies that arrive while it runs wait for that body (up to `deadline`).
async fn deduplicated<F>(
    in_flight: &InFlight,
    id: Option<String>,
    deadline: Option<tokio::time::Instant>,
    work: F,
) -> Vec<u8>
where
    F: std::future::Future<Output = Vec<u8>>,
{
    let Some(id) = id else { return work.await };
    let joined = {
        let Ok(mut map) = in_flight.lock() else { return work.await };
        match map.get(&id) {
            Some(receiver) => Err(receiver.clone()),
            None => {
                let (sender, receiver) = tokio::sync::watch::channel(None);
                map.insert(id.clone(), receiver);
                Ok(sender)
            }
        }
    };
    match joined {
        Ok(sender) => {
            let body = Arc::new(work.await);
            let _ = sender.send(Some(body.clone()));
            if let Ok(mut map) = in_flight.lock() {
                map.remove(&id);
            }
            body.as_ref().clone()
        }
        Err(mut receiver) => {
            info!(request_id = %id, "a retry joined the rollout already under way");
            let wait = receiver.wait_for(Option::is_some);
            let waited = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, wait).await.ok(),
                None => Some(wait.await),
            };
            match waited {
                Some(Ok(body)) => body.as_ref().map(|b| b.as_ref().clone()).unwrap_or_default(),
                _ => serde_json::to_vec(&Reply::<()>::error(
                    error_types::UNAVAILABLE,
                    "the rollout this retry joined did not finish in time",
                ))
                .unwrap_or_default(),
            }
        }
    }
}

/// Serves one rollout request. When the caller said how long it waits
/// ([`keel_service::nats::caller_timeout`]), the samples are abandoned at that deadline: the
/// engine stops decoding them at its next step instead of finishing work nobody reads.
async fn rollout(
    state: &AppState,
    refused: &RefusedRefit,
    payload: &[u8],
    deadline: Option<tokio::time::Instant>,
) -> Reply<RolloutReply> {
    let request: RolloutRequest = match serde_json::from_slice(payload) {
        Ok(request) => request,
        Err(e) => return Reply::error(error_types::INVALID_REQUEST, format!("malformed request: {e}")),
    };
    let refusal = refused.lock().ok().and_then(|r| r.clone());
    if let Some((version, why)) = refusal
        && request.min_weight_version > 0
        && version >= request.min_weight_version
        && state.engine.weight_version() < request.min_weight_version
    {
        return Reply::error(
            error_types::REFIT_FAILED,
            format!("this generator could not load run {}'s weights (version {version}): {why}", request.run_id),
        );
    }
    let serving = state.engine.weight_version();
    if serving < request.min_weight_version {
        return Reply::error(
            error_types::STALE_WEIGHTS,
            format!(
                "this generator serves weight version {serving}; run {} needs {}",
                request.run_id, request.min_weight_version
            ),
        );
    }
    let s = &request.sampling;
    let draft = Draft {
        prompt: request.prompt_token_ids,
        n: request.n,
        max_tokens: Some(request.max_tokens),
        sampling: SamplingParams {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            min_p: s.min_p,
            seed: s.seed.unwrap_or_else(rand::random),
        },
        stop_token_ids: request.stop_token_ids,
        stop: request.stop,
        include_stop_str_in_output: request.include_stop_str_in_output,
        ignore_eos: request.ignore_eos,
        top_logprobs: 0,
        min_tokens: 0,
    };
    let generation = match state.limits.check(draft) {
        Ok(generation) => generation,
        Err(e) => return Reply::error(error_types::INVALID_REQUEST, format!("{}: {}", e.param, e.message)),
    };
    let Ok(_permit) = state.admission.clone().try_acquire_owned() else {
        return Reply::error(error_types::UNAVAILABLE, "the generator's queue is full; retry another replica or later");
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let n = generation.n;
    if let Err(e) = state.engine.submit(generation, tx) {
        return Reply::error(error_types::UNAVAILABLE, e.to_string());
    }
    let collected = match deadline {
        Some(deadline) => match tokio::time::timeout_at(deadline, collect(rx, n)).await {
            Ok(collected) => collected,
            Err(_) => {
                // Dropping the receiver (inside the timed-out future) aborts the samples.
                warn!(run_id = %request.run_id, "rollout abandoned: its caller's timeout passed");
                return Reply::error(
                    error_types::UNAVAILABLE,
                    "the caller's timeout passed before the rollout finished",
                );
            }
        },
        None => collect(rx, n).await,
    };
    let samples = match collected {
        Ok(samples) => samples,
        // The request was checked before it ran: a failure now is the engine's (a step that
        // failed, a generator group that broke), and another replica or a later try may serve it.
        Err(e) => return Reply::error(error_types::UNAVAILABLE, format!("generation failed: {e}")),
    };
    let weight_version = samples.iter().map(|s| s.version).max().unwrap_or(serving);
    let samples = samples
        .into_iter()
        .map(|s| RolloutSample {
            finish_reason: s.finish_reason().unwrap_or_else(|| "abort".into()),
            stop_reason: s.stop().map(str::to_string),
            token_ids: s.tokens,
            logprobs: s.logprobs,
        })
        .collect();
    Reply::Ok(RolloutReply { weight_version, samples })
}

/// The subscriptions of run `run_id`'s subjects on a generator it holds.
pub struct RunSubjects {
    run_id: String,
    requests: async_nats::Subscriber,
    updates: async_nats::Subscriber,
    memory: async_nats::Subscriber,
}

impl std::fmt::Debug for RunSubjects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunSubjects").field("run_id", &self.run_id).finish()
    }
}

impl RunSubjects {
    /// Subscribes to run `run_id`'s rollouts (in the queue group of its generators), refits
    /// and memory changes; they are heard once this returns.
    pub async fn subscribe(client: &async_nats::Client, subjects: &Subjects, run_id: &str) -> crate::Result<Self> {
        let failed = |subject: &str| {
            let subject = subject.to_string();
            move |e: async_nats::SubscribeError| keel_service::Error::Subscribe { subject, reason: e.to_string() }
        };
        let generate = subjects.generate(run_id);
        let requests = client
            .queue_subscribe(generate.clone(), GENERATOR_QUEUE_GROUP.to_string())
            .await
            .map_err(failed(&generate))?;
        let (weights, memory) = (subjects.weights_updated(run_id), subjects.generator_memory(run_id));
        let updates = client.subscribe(weights.clone()).await.map_err(failed(&weights))?;
        let memory = client.subscribe(memory.clone()).await.map_err(failed(&memory))?;
        client.flush().await.map_err(|e| Error::Flush(e.to_string()))?;
        info!(subject = %generate, "serving the run's rollouts");
        Ok(Self { run_id: run_id.to_string(), requests, updates, memory })
    }
}

/// Serves the rollouts, refits and memory changes of the run `subscribed` names on `state`
/// until `shutdown` completes (the run let the generator go) or the subscriptions end.
pub async fn serve(
    client: async_nats::Client,
    subscribed: RunSubjects,
    state: AppState,
    roots: keel_service::paths::PathRoots,
    shutdown: impl std::future::Future<Output = ()>,
) -> crate::Result<()> {
    let RunSubjects { run_id, mut requests, mut updates, mut memory } = subscribed;
    let refused = RefusedRefit::default();
    let in_flight = InFlight::default();
    // Every request's task: aborted when the run lets the generator go, so that no refit
    // of this run's weights lands after the next model (or the start-up one) is in place.
    let mut tasks = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        while tasks.try_join_next().is_some() {}
        tokio::select! {
            () = &mut shutdown => {
                tasks.abort_all();
                while tasks.join_next().await.is_some() {}
                return Ok(());
            }
            message = requests.next() => {
                let Some(message) = message else { return Err(Error::SubscriptionEnded("rollout")) };
                let (state, client, refused, in_flight) =
                    (state.clone(), client.clone(), refused.clone(), in_flight.clone());
                let deadline = keel_service::nats::caller_timeout(&message).map(|t| tokio::time::Instant::now() + t);
                tasks.spawn(async move {
                    let id = request_id(&message.payload);
                    let body = keel_service::nats::served(&client, "generator.generate", &message, async {
                        deduplicated(&in_flight, id, deadline, async {
                            let reply = rollout(&state, &refused, &message.payload, deadline).await;
                            serde_json::to_vec(&reply).unwrap_or_default()
                        })
                        .await
                    })
                    .await;
                    if let Some(to) = message.reply
                        && let Err(e) = client.publish(to, body.into()).await
                    {
                        warn!("cannot send a rollout reply: {e}");
                    }
                });
            }
            message = memory.next() => {
                let Some(message) = message else { return Err(Error::SubscriptionEnded("memory")) };
                let (engine, client) = (state.engine.clone(), client.clone());
                tasks.spawn(async move { change_memory(&engine, &client, message).await });
            }
            message = updates.next() => {
                let Some(message) = message else { return Err(Error::SubscriptionEnded("weights")) };
                match serde_json::from_slice::<WeightsUpdated>(&message.payload) {
                    Ok(update) if update.run_id != run_id => {
                        warn!(run_id = %update.run_id, "weights of another run ignored");
                    }
                    Ok(update) => {
                        let (engine, refused) = (state.engine.clone(), refused.clone());
                        let span = keel_service::nats::server_span("generator.refit", &message);
                        span.record("run_id", update.run_id.as_str());
                        let (client, roots, dtype, device) = (client.clone(), roots.clone(), state.dtype, state.device);
                        let links = state.links.clone();
                        tasks.spawn(tracing::Instrument::instrument(async move {
                            let arrived = std::time::Instant::now();
                            let refit = async {
                                let weights = new_weights(&client, &roots, &update, device, &links).await?;
                                Ok(engine.refit(weights, update.version, update.refit_mode).await?)
                            }
                            .await;
                            if let Some(to) = message.reply.clone() {
                                report_refit(&client, to, &update, arrived, &refit, dtype).await;
                            }
                            match refit {
                                Ok(seconds) => {
                                    if let Ok(mut refused) = refused.lock() {
                                        *refused = None;
                                    }
                                    info!(version = update.version, run_id = %update.run_id, seconds, "weights updated");
                                }
                                // A refit a newer one replaced before it ran is not a refusal of its weights.
                                Err(e @ Error::Engine(keel_generation::Error::RefitSuperseded(_))) => {
                                    info!(version = update.version, "{e}")
                                }
                                Err(e) => {
                                    warn!(version = update.version, "refit refused: {e}");
                                    if let Ok(mut refused) = refused.lock() {
                                        *refused = Some((update.version, e.to_string()));
                                    }
                                }
                            }
                        }, span));
                    }
                    Err(e) => warn!("malformed weights-updated event ignored: {e}"),
                }
            }
        }
    }
}

/// Sleeps or wakes the engine as a colocated run's orchestrator asks, and answers it.
async fn change_memory(
    engine: &keel_generation::engine::Engine,
    client: &async_nats::Client,
    message: async_nats::Message,
) {
    let report = match serde_json::from_slice::<MemoryChange>(&message.payload) {
        Ok(request) => {
            let change = match request.action {
                MemoryAction::Sleep => Memory::Sleep { offload_weights: request.offload_weights },
                MemoryAction::Wake => Memory::Wake,
            };
            info!(run_id = %request.run_id, ?change, "memory change asked for");
            match engine.change_memory(change).await {
                Ok((seconds, bytes)) => MemoryReport { seconds, bytes, error: None },
                Err(e) => MemoryReport { seconds: 0.0, bytes: 0, error: Some(e.to_string()) },
            }
        }
        Err(e) => MemoryReport { seconds: 0.0, bytes: 0, error: Some(format!("malformed memory change: {e}")) },
    };
    if let Some(to) = message.reply {
        let body = serde_json::to_vec(&report).unwrap_or_default();
        if let Err(e) = client.publish(to, body.into()).await {
            warn!("cannot answer a memory change: {e}");
        }
    }
}

/// Answers the orchestrator that published `update` with a reply subject: the version now
/// served, or why it is not.
async fn report_refit(
    client: &async_nats::Client,
    to: async_nats::Subject,
    update: &WeightsUpdated,
    arrived: std::time::Instant,
    refit: &crate::Result<f64>,
    dtype: &str,
) {
    let report = WeightsLoaded {
        run_id: update.run_id.clone(),
        version: update.version,
        seconds: arrived.elapsed().as_secs_f64(),
        dtype: Some(dtype.to_string()),
        error: refit.as_ref().err().map(ToString::to_string),
    };
    let body = serde_json::to_vec(&report).unwrap_or_default();
    if let Err(e) = client.publish(to, body.into()).await {
        warn!(version = update.version, "cannot report the refit: {e}");
    }
}

/// How long a collective transfer may take, from the request to the last bucket (the
/// trainer waits as long for this generator to join).
const RECEIVE_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// The communicators this generator keeps with trainers for the collective transfer: per
/// trainer (the subject it takes requests on), the session and the communicator. Transfers
/// take the lock for their whole length, so one runs at a time. `formed` counts the ones
/// formed (`/metrics`: a kept one saves the set-up, NCCL's on GPUs).
#[derive(Debug, Default)]
pub struct WeightLinks {
    kept: tokio::sync::Mutex<HashMap<String, (String, keel_collective::SharedComm)>>,
    pub formed: std::sync::atomic::AtomicU64,
}

/// The buckets of `buckets` the trainer keeps for the collective transfer, in their order,
/// received on `device` (none when no bucket is one), over the communicator kept with that
/// trainer from an earlier transfer — or, when there is none or it fails (the trainer
/// restarted, or let it go), a new one formed for this transfer and kept for the next.
async fn receive(
    client: &async_nats::Client,
    links: &WeightLinks,
    buckets: &[keel_protocol::generator::WeightBucket],
    device: tch::Device,
) -> crate::Result<Vec<tch::Tensor>> {
    let sent: Vec<_> = buckets.iter().filter_map(|b| b.at.collective().map(|c| (c, b.bytes))).collect();
    let Some(&(first, _)) = sent.first() else { return Ok(Vec::new()) };
    if sent.iter().any(|(c, _)| (&c.export, &c.subject, &c.meeting) != (&first.export, &first.subject, &first.meeting))
    {
        return Err(Error::Receive("the buckets name more than one export".into()));
    }
    if let (tch::Device::Cuda(ordinal), Some(trainer)) = (device, &first.gpu_uuid)
        && keel_model::cuda::ipc::device_uuid(ordinal).is_ok_and(|mine| mine == *trainer)
    {
        return Err(Error::Receive(format!(
            "the export is on this generator's own GPU (cuda:{ordinal}), and NCCL joins processes on different \
             GPUs only: use the cuda_ipc transfer"
        )));
    }
    let ranges: Vec<(u64, u64)> = sent.iter().map(|(c, bytes)| (c.offset, *bytes)).collect();
    let mut kept = links.kept.lock().await;
    let reused = match kept.remove(&first.subject) {
        Some(link) => fetch(client, first, &ranges, device, Some(link))
            .await
            .inspect_err(|e| info!("the communicator kept with the trainer failed ({e}); forming a new one"))
            .ok(),
        None => None,
    };
    let (tensors, session, comm) = match reused {
        Some(received) => received,
        None => {
            let received = fetch(client, first, &ranges, device, None).await?;
            links.formed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            received
        }
    };
    kept.insert(first.subject.clone(), (session, comm));
    Ok(tensors)
}

/// One collective transfer of `ranges` of `first`'s export: the request (refused at once
/// by the trainer, or accepted), then the communicator — `kept`, or a new one on a session
/// of its own — and every range received on `device`. Returns the buckets, and the session
/// and communicator to keep.
async fn fetch(
    client: &async_nats::Client,
    first: &keel_protocol::generator::CollectiveBuffer,
    ranges: &[(u64, u64)],
    device: tch::Device,
    kept: Option<(String, keel_collective::SharedComm)>,
) -> crate::Result<(Vec<tch::Tensor>, String, keel_collective::SharedComm)> {
    let failed = |e: &dyn std::fmt::Display| Error::Receive(e.to_string());
    let session = match &kept {
        Some((session, _)) => session.clone(),
        None => format!("{:032x}", rand::random::<u128>()),
    };
    let request = SendWeights {
        export: first.export.clone(),
        session: session.clone(),
        device: keel_model::device::memory_name(device).into(),
        ranges: ranges.to_vec(),
        reuse: kept.is_some(),
    };
    let body = serde_json::to_vec(&request).map_err(|e| failed(&e))?;
    let ask = async_nats::Request::new().payload(body.into()).timeout(Some(RECEIVE_WAIT));
    let answer = client.send_request(first.subject.clone(), ask).await.map_err(|e| failed(&e))?;
    match serde_json::from_slice::<Reply<SendAccepted>>(&answer.payload) {
        Ok(Reply::Ok(_)) => {}
        Ok(Reply::Error(e)) => return Err(Error::Receive(format!("the trainer refused: {e}"))),
        Err(e) => return Err(Error::Receive(format!("a malformed answer from the trainer: {e}"))),
    }
    let comm = match kept {
        Some((_, comm)) => comm,
        None => {
            let meeting = format!("{}.{session}", first.meeting);
            let unused = std::net::IpAddr::from([0, 0, 0, 0]);
            keel_collective::join_process_group(client, &meeting, 1, 2, device, unused, RECEIVE_WAIT)
                .await
                .map_err(|e| failed(&e))?
        }
    };
    let sizes: Vec<u64> = ranges.iter().map(|(_, bytes)| *bytes).collect();
    let received = tokio::task::spawn_blocking(move || {
        let mut received = Vec::with_capacity(sizes.len());
        for bytes in sizes {
            let mut bucket =
                tch::Tensor::f_empty([bytes as i64], (tch::Kind::Uint8, device)).map_err(|e| e.to_string())?;
            comm.broadcast(&mut bucket, 0).map_err(|e| e.to_string())?;
            received.push(bucket);
        }
        if let tch::Device::Cuda(ordinal) = device {
            tch::Cuda::synchronize(ordinal as i64);
        }
        Ok::<_, String>((received, comm))
    });
    let (received, comm) =
        received.await.map_err(|e| Error::Task("receiving the weights", e))?.map_err(Error::Receive)?;
    Ok((received, session, comm))
}

/// A weight bucket's bytes from the object store, the shared-memory file it is in, its
/// copy out of the trainer's GPU memory (CUDA IPC; made on the blocking pool), or what the
/// trainer sent over a communicator.
enum Fetched {
    Bytes(Vec<u8>),
    File(String),
    Device,
    Received(tch::Tensor),
}

/// The weights a refit names: fetched from the object store (all buckets, every tensor
/// checked) when it carries them in memory, else its directory inside the path roots.
/// Nothing reaches the model until every bucket is here. Objects are fetched here; making
/// tensors of them, mapping shared-memory files and copying buckets out of the trainer's GPU
/// memory run on the blocking pool. Buckets the trainer sends over a communicator (kept in
/// `links` for the next refit) arrive on `device`, all of them before any other is fetched.
async fn new_weights(
    client: &async_nats::Client,
    roots: &keel_service::paths::PathRoots,
    update: &WeightsUpdated,
    device: tch::Device,
    links: &WeightLinks,
) -> crate::Result<Weights> {
    let Some(weights) = &update.weights else {
        return Ok(Weights::Dir(roots.check("path", &update.path)?));
    };
    let kind = keel_model::device::parse_kind(&weights.dtype)?;
    let mut stores: std::collections::HashMap<String, keel_service::nats::Bulk> = std::collections::HashMap::new();
    let mut received = receive(client, links, &weights.buckets, device).await?.into_iter();
    let mut fetched = Vec::with_capacity(weights.buckets.len());
    for bucket in &weights.buckets {
        fetched.push(match &bucket.at {
            BucketAt::Object(object) => {
                if !stores.contains_key(&object.bucket) {
                    let store = keel_service::nats::Bulk::open(client.clone(), &object.bucket).await?;
                    stores.insert(object.bucket.clone(), store);
                }
                let bytes = stores[&object.bucket].get(object).await?;
                if bytes.len() as u64 != bucket.bytes {
                    return Err(Error::BucketSize {
                        name: object.name.clone(),
                        got: bytes.len(),
                        expected: bucket.bytes,
                    });
                }
                Fetched::Bytes(bytes)
            }
            BucketAt::File(file) => Fetched::File(file.clone()),
            BucketAt::CudaIpc(_) => Fetched::Device,
            BucketAt::Collective(_) => Fetched::Received(received.next().ok_or(Error::BucketMissing)?),
        });
    }
    let lora = match &weights.lora {
        Some(lora) => Some((lora.scale, roots.check("lora.base", &lora.base)?)),
        None => None,
    };
    let (buckets, roots) = (weights.buckets.clone(), roots.clone());
    tokio::task::spawn_blocking(move || {
        // Every bucket in GPU memory copied at once: each allocation is mapped once.
        let shared: Vec<_> = buckets.iter().filter_map(|b| b.at.cuda_ipc().map(|ipc| (ipc, b.bytes))).collect();
        let mut copies = keel_model::cuda::ipc::fetch(&shared)?.into_iter();
        let mut tensors = std::collections::HashMap::new();
        for (bucket, bytes) in buckets.iter().zip(fetched) {
            let unpacked = match bytes {
                Fetched::Bytes(bytes) => keel_model::packing::unpack(&bytes, &bucket.tensors, kind),
                Fetched::Received(flat) => keel_model::packing::unpack_tensor(&flat, &bucket.tensors, kind),
                Fetched::Device => match copies.next() {
                    Some(copy) => keel_model::packing::unpack_tensor(&copy, &bucket.tensors, kind),
                    None => return Err(Error::BucketMissing),
                },
                // A file in shared memory is mapped, not read: its bytes are copied once,
                // into the model.
                Fetched::File(file) => {
                    let path = roots.check("file", &file)?;
                    keel_model::packing::unpack_file(&path, bucket.bytes, &bucket.tensors, kind)
                }
            };
            for (name, tensor) in unpacked? {
                if tensors.insert(name.clone(), tensor).is_some() {
                    return Err(Error::DuplicateTensor(name));
                }
            }
        }
        Ok(match lora {
            Some((scale, base)) => Weights::Adapters { tensors, scale, base },
            None => Weights::Tensors(tensors),
        })
    })
    .await
    .map_err(|e| Error::Task("unpacking the weights", e))?
}
