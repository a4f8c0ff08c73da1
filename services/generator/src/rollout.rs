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
    MemoryAction, MemoryChange, MemoryReport, RolloutReply, RolloutRequest, RolloutSample, WeightsUpdated, error_types,
};
use keel_protocol::subjects::GENERATOR_QUEUE_GROUP;
use keel_protocol::{Reply, Subjects};
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::Error;
use crate::openai::AppState;
use crate::refit::{new_weights, report_refit};
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
