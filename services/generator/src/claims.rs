//! The generator as a run's, as trainer workers are: while free it is in the `generator`
//! queue group on `<prefix>.generator.claim`, so a claim reaches exactly one free generator;
//! once claimed it leaves the group and its own `<prefix>.generator.<id>.claim` refuses other
//! runs with `busy`. The run has it load its model (`load`: the run's directory or
//! checkpoint, dtype, `max_model_len`, tensor-parallel size), then sends its rollouts,
//! refits and memory changes on the run's own subjects ([`crate::rollout`]), which only its
//! generators hear. The OpenAI API serves the run's model under the run's name meanwhile.
//! Every request and heartbeat renews the lease; when the run releases the generator, or
//! its lease runs out with nothing in flight (the orchestrator disappeared), the run's model
//! is dropped, the start-up model (if the generator has one) is loaded again, and the
//! generator rejoins the claim group.
//!
//! Loads and unloads run one at a time: a load waits for the start-up model's reload after
//! the previous run.

use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, Message};
use futures::StreamExt;
use keel_protocol::agent::{AgentSessionClose, AgentSessionOpen, AgentSessionOpened};
use keel_protocol::generator::{GeneratorCall, LoadModel, ModelLoaded, error_types};
use keel_protocol::lease::{ClaimRequest, HeartbeatRequest, ReleaseRequest, Released};
use keel_protocol::subjects::{GENERATOR_QUEUE_GROUP, GeneratorOp};
use keel_protocol::{ErrorBody, Reply, Subjects};
use keel_service::lease::{ClaimGroup, Leases};
use keel_service::paths::PathRoots;
use tracing::{info, warn};

use crate::openai::AppState;
use crate::{Config, Serving, group, rollout};

/// How often an expired lease is looked for.
const LEASE_CHECK: Duration = Duration::from_millis(200);

/// A run's model, loaded and served on the run's subjects.
struct RunModel {
    run_id: String,
    state: AppState,
    /// The engine is the start-up model's, used as loaded.
    shared: bool,
    /// Stops the serving of the run's subjects.
    stop: tokio::sync::oneshot::Sender<()>,
    served: tokio::task::JoinHandle<()>,
}

/// What the generator holds: its start-up model while no run does, or the run's.
#[derive(Default)]
struct Slot {
    /// The start-up model, loaded (None while a run's model replaces it, or when there is
    /// none). `pristine`: no run has refit it, so a run of that same model may use it as is.
    startup: Option<(AppState, bool)>,
    run: Option<RunModel>,
}

type Answer<T> = Result<T, ErrorBody>;

fn refuse(kind: &str, message: impl std::fmt::Display) -> ErrorBody {
    ErrorBody { kind: kind.to_string(), message: message.to_string() }
}

/// A generator runs claim.
pub struct Generator {
    client: Client,
    subjects: Subjects,
    config: Config,
    roots: PathRoots,
    leases: Leases,
    /// What the OpenAI API serves.
    serving: Serving,
    slot: tokio::sync::Mutex<Slot>,
    /// Set from a run's release (or expiry) until the start-up model is back: the generator
    /// stays out of the claim group meanwhile, so the next run does not wait behind the
    /// reload of a model it is about to replace.
    restoring: std::sync::atomic::AtomicBool,
    /// When this generator leads a group of generator processes.
    leading: Option<group::Leading>,
}

impl std::fmt::Debug for Generator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generator").field("id", &self.id()).field("serving", &self.serving).finish()
    }
}

impl Generator {
    pub fn new(
        client: Client,
        subjects: Subjects,
        config: &Config,
        roots: PathRoots,
        serving: Serving,
        startup: Option<AppState>,
        leading: Option<group::Leading>,
    ) -> Arc<Self> {
        let id = config.generator_id.clone().unwrap_or_else(|| format!("g{}", rand::random::<u64>()));
        let leases = Leases::new("generator", id, config.max_lease_seconds);
        let slot = Slot { startup: startup.map(|s| (s, true)), run: None };
        Arc::new(Self {
            client,
            subjects,
            config: config.clone(),
            roots,
            leases,
            serving,
            slot: tokio::sync::Mutex::new(slot),
            restoring: std::sync::atomic::AtomicBool::new(false),
            leading,
        })
    }

    pub fn id(&self) -> &str {
        self.leases.worker_id()
    }

    /// Loads run `request.run_id`'s model in place of what the generator holds, serves it on
    /// the run's subjects and the OpenAI API, and reports what it loaded.
    async fn load(self: &Arc<Self>, request: LoadModel) -> Answer<ModelLoaded> {
        let started = std::time::Instant::now();
        let dir = self.roots.check("path", &request.path).map_err(|e| refuse(error_types::INVALID_REQUEST, e))?;
        // An adapter directory inside the roots must not lead outside them to its base.
        if let Some(base) = keel_model::lora::adapter_base(&dir).map_err(|e| refuse(error_types::INVALID_REQUEST, e))? {
            let what = "path (its adapter's base_model_name_or_path)";
            self.roots.check(what, &base.display().to_string()).map_err(|e| refuse(error_types::INVALID_REQUEST, e))?;
        }
        let mut config = self.config.clone();
        config.served_model_name = Some(request.served_model_name.clone().unwrap_or_else(|| request.run_id.clone()));
        if let Some(dtype) = &request.dtype {
            config.dtype = Some(dtype.clone());
        }
        if let Some(len) = request.max_model_len {
            config.max_model_len = Some(len as i64);
        }
        if let Some(tp) = request.tensor_parallel_size {
            if let Some(group) = self.config.group.as_ref().filter(|g| g.size != tp) {
                return Err(refuse(
                    error_types::INVALID_REQUEST,
                    format!(
                        "tensor_parallel_size {tp}: this generator is a group of {} processes, which are its ranks",
                        group.size
                    ),
                ));
            }
            config.tensor_parallel_size = tp;
        }
        let mut slot = self.slot.lock().await;
        self.unload(&mut slot).await;
        let reusable = match &slot.startup {
            Some((state, true))
                if request.version == 0 && self.config.model.as_deref().is_some_and(|m| same_dir(m, &dir)) =>
            {
                let unchanged = (request.dtype.is_none() || request.dtype.as_deref() == Some(state.dtype))
                    && request.max_model_len.is_none_or(|l| l <= state.limits.max_model_len)
                    && request.tensor_parallel_size.is_none_or(|tp| tp == self.config.world_size());
                unchanged.then(|| state.clone())
            }
            _ => None,
        };
        let shared = reusable.is_some();
        let state = match reusable {
            Some(state) => {
                info!(run_id = %request.run_id, "the run's model is the start-up model: serving it as loaded");
                AppState { model_name: config.served_model_name.clone().unwrap_or_default(), ..state }
            }
            None => {
                // The start-up model leaves memory before the run's arrives.
                self.serving.set(None);
                if let Some((startup, _)) = slot.startup.take() {
                    give_back_device(&startup).await;
                }
                info!(run_id = %request.run_id, model = %dir.display(), "loading the run's model");
                crate::load_blocking(config.clone(), dir.clone(), self.leading.clone())
                    .await
                    .map_err(|e| refuse(error_types::LOAD_FAILED, format!("cannot load {}: {e}", dir.display())))?
            }
        };
        if let Some((_, pristine)) = slot.startup.as_mut() {
            // The run refits the engine it shares with the start-up model.
            *pristine = false;
        }
        state.engine.stats.weight_version.store(request.version, std::sync::atomic::Ordering::Relaxed);
        let subscribed = rollout::RunSubjects::subscribe(&self.client, &self.subjects, &request.run_id)
            .await
            .map_err(|e| refuse(error_types::UNAVAILABLE, e))?;
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let (client, roots, served_state) = (self.client.clone(), self.roots.clone(), state.clone());
        let run_id = request.run_id.clone();
        let served = tokio::spawn(async move {
            let stopped = async {
                let _ = stopped.await;
            };
            if let Err(e) = rollout::serve(client, subscribed, served_state, roots, stopped).await {
                warn!(%run_id, "serving the run's subjects ended: {e}");
            }
        });
        slot.run = Some(RunModel { run_id: request.run_id.clone(), state: state.clone(), shared, stop, served });
        self.serving.set(Some(&state));
        self.leases.set_loaded(&request.run_id, true);
        let loaded = ModelLoaded {
            generator_id: self.id().to_string(),
            served_model_name: state.model_name.clone(),
            dtype: state.dtype.to_string(),
            max_model_len: state.limits.max_model_len,
            tensor_parallel_size: config.world_size(),
            kv_blocks: state.engine.stats.blocks_total.load(std::sync::atomic::Ordering::Relaxed),
            seconds: started.elapsed().as_secs_f64(),
            base_url: self.serving.base_url().to_string(),
        };
        info!(run_id = %request.run_id, seconds = loaded.seconds, "the run's model is served");
        Ok(loaded)
    }

    /// Opens an agent session for one sample of the run, on the run's model at the version
    /// the run asks for or newer.
    async fn agent_open(&self, request: AgentSessionOpen) -> Answer<AgentSessionOpened> {
        let slot = self.slot.lock().await;
        let run = slot.run.as_ref().filter(|run| run.run_id == request.run_id).ok_or_else(|| {
            refuse(error_types::INVALID_REQUEST, format!("run {} has not loaded its model here", request.run_id))
        })?;
        let version = run.state.engine.weight_version();
        if version < request.min_weight_version {
            return Err(refuse(
                error_types::STALE_WEIGHTS,
                format!("this generator serves weights {version}, the session needs {}", request.min_weight_version),
            ));
        }
        self.serving.sessions().open(&request).map_err(|e| refuse(error_types::INVALID_REQUEST, e))?;
        Ok(AgentSessionOpened {
            generator_id: self.id().to_string(),
            base_url: self.serving.base_url().to_string(),
            model: run.state.model_name.clone(),
        })
    }

    /// Stops serving the run's model (its rollouts in flight are abandoned) and drops it.
    async fn unload(&self, slot: &mut Slot) {
        if let Some(run) = slot.run.take() {
            self.serving.sessions().close_run(&run.run_id);
            let _ = run.stop.send(());
            if let Err(e) = run.served.await {
                warn!(run_id = %run.run_id, "serving the run's subjects failed: {e}");
            }
            self.serving.set(slot.startup.as_ref().map(|(state, _)| state));
            if !run.shared {
                give_back_device(&run.state).await;
            }
            info!(run_id = %run.run_id, "the run's model is dropped");
        }
    }

    /// After a run: its model dropped, and the start-up model served again: its weights
    /// loaded back in place when the run refit it, loaded anew when the run replaced it.
    async fn restore(&self) {
        let mut slot = self.slot.lock().await;
        self.unload(&mut slot).await;
        if let (Some((state, pristine)), Some(dir)) = (slot.startup.as_mut(), self.config.model.clone())
            && !*pristine
        {
            // A colocated run may have left it asleep.
            if state.engine.stats.asleep.load(std::sync::atomic::Ordering::Relaxed) != 0
                && let Err(e) = state.engine.change_memory(keel_generation::engine::Memory::Wake).await
            {
                warn!("cannot wake the start-up model: {e}");
            }
            let weights = keel_generation::backend::Weights::Dir(dir);
            match state.engine.refit(weights, 0, None).await {
                Ok(_) => *pristine = true,
                Err(e) => warn!("cannot load the start-up model's weights back: {e}"),
            }
        }
        if slot.startup.as_ref().is_some_and(|(_, pristine)| !pristine) {
            slot.startup = None;
            self.serving.set(None);
        }
        if slot.startup.is_none()
            && let Some(dir) = self.config.model.clone()
        {
            match crate::load_blocking(self.config.clone(), dir, self.leading.clone()).await {
                Ok(state) => {
                    self.serving.set(Some(&state));
                    slot.startup = Some((state, true));
                    info!("the start-up model is served again");
                }
                Err(e) => warn!("cannot load the start-up model again: {e}"),
            }
        }
    }

    async fn release(&self, request: ReleaseRequest, holder: Option<&str>) -> Answer<Released> {
        self.restoring.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Err(refused) = self.leases.release(&request.run_id, holder) {
            self.restoring.store(false, std::sync::atomic::Ordering::SeqCst);
            return Err(refused);
        }
        info!(run_id = %request.run_id, "released");
        self.restore().await;
        self.restoring.store(false, std::sync::atomic::Ordering::SeqCst);
        Ok(Released { worker_id: self.id().to_string() })
    }

    /// Releases the claim when its lease ran out with nothing in flight; the start-up model
    /// comes back in a task of its own, so claims are answered meanwhile (a load waits for
    /// it).
    fn expire(self: &Arc<Self>) {
        if let Some(held) = self.leases.take_expired() {
            warn!(run_id = %held.run_id, "lease expired; releasing the generator");
            self.restoring.store(true, std::sync::atomic::Ordering::SeqCst);
            let me = self.clone();
            tokio::spawn(async move {
                me.restore().await;
                me.restoring.store(false, std::sync::atomic::Ordering::SeqCst);
            });
        }
    }

    /// Serves operation `op` with `work`, whose request type names that operation.
    async fn op<R, Fut>(
        self: &Arc<Self>,
        payload: &[u8],
        holder: Option<&str>,
        work: impl FnOnce(Arc<Self>, R) -> Fut,
    ) -> Answer<R::Reply>
    where
        R: GeneratorCall,
        Fut: std::future::Future<Output = Answer<R::Reply>>,
    {
        let request: R = parse(payload)?;
        let run_id = request.run_id().to_string();
        tracing::Span::current().record("run_id", run_id.as_str());
        self.leases.admit(&run_id, holder)?;
        let outcome = work(self.clone(), request).await;
        self.leases.finish(&run_id);
        outcome
    }

    async fn handle(self: Arc<Self>, op: GeneratorOp, payload: &[u8], holder: Option<String>) -> Vec<u8> {
        let h = holder.as_deref();
        match op {
            GeneratorOp::Claim => encode(parse::<ClaimRequest>(payload).and_then(|r| self.leases.claim(r))),
            GeneratorOp::Heartbeat => {
                encode(self.op(payload, h, |me, _: HeartbeatRequest| async move { me.leases.heartbeat() }).await)
            }
            GeneratorOp::Load => encode(self.op(payload, h, |me, r: LoadModel| async move { me.load(r).await }).await),
            GeneratorOp::AgentOpen => {
                encode(self.op(payload, h, |me, r: AgentSessionOpen| async move { me.agent_open(r).await }).await)
            }
            GeneratorOp::AgentClose => encode(
                self.op(payload, h, |me, r: AgentSessionClose| async move {
                    me.serving.sessions().close(&r.run_id, &r.key).map_err(|e| refuse(error_types::INVALID_REQUEST, e))
                })
                .await,
            ),
            GeneratorOp::Release => match parse::<ReleaseRequest>(payload) {
                Ok(request) => encode(self.release(request, h).await),
                Err(e) => encode::<Released>(Err(e)),
            },
        }
    }

    /// Answers `message` (operation `op`) from a task of its own; a claim is decided here,
    /// before the loop updates the queue-group membership.
    fn respond(self: &Arc<Self>, message: Message, op: GeneratorOp) {
        let Some(reply_to) = message.reply.clone() else {
            warn!(subject = %message.subject, "request without a reply subject ignored");
            return;
        };
        let decided = (op == GeneratorOp::Claim)
            .then(|| encode(parse::<ClaimRequest>(&message.payload).and_then(|r| self.leases.claim(r))));
        let me = self.clone();
        tokio::spawn(async move {
            let client = me.client.clone();
            let operation = format!("generator.{}", op.name());
            let body = keel_service::nats::served(&client, &operation, &message, async {
                match decided {
                    Some(body) => body,
                    None => {
                        let holder = keel_service::lease::holder_of(&message);
                        me.handle(op, &message.payload, holder).await
                    }
                }
            })
            .await;
            if let Err(e) = client.publish(reply_to, body.into()).await {
                warn!("cannot send a reply: {e}");
            }
        });
    }

    /// Whether the generator can take a run: nobody holds it and its start-up model is back.
    fn is_free(&self) -> bool {
        !self.leases.is_claimed() && !self.restoring.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Serves claims and the claiming runs until `shutdown` completes.
    pub async fn serve(self: Arc<Self>, shutdown: impl std::future::Future<Output = ()>) -> crate::Result<()> {
        let own_subjects = self.subjects.generator_all(self.id());
        let mut own = self
            .client
            .subscribe(own_subjects.clone())
            .await
            .map_err(|e| keel_service::Error::Subscribe { subject: own_subjects.clone(), reason: e.to_string() })?;
        let mut group = ClaimGroup::new(self.client.clone(), self.subjects.generator_claim(), GENERATOR_QUEUE_GROUP);
        group.set_free(true).await?;
        self.client.flush().await.map_err(|e| crate::Error::Flush(e.to_string()))?;
        info!(generator_id = %self.id(), claim = %self.subjects.generator_claim(), "generator ready for runs");
        let mut tick = tokio::time::interval(LEASE_CHECK);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                message = own.next() => {
                    let Some(message) = message else { return Err(crate::Error::SubscriptionEnded("generator")) };
                    match message.subject.rsplit('.').next().and_then(GeneratorOp::from_name) {
                        Some(op) => self.respond(message, op),
                        None => warn!(subject = %message.subject, "unknown generator operation"),
                    }
                }
                Some(message) = group.next() => self.respond(message, GeneratorOp::Claim),
                _ = tick.tick() => self.expire(),
            }
            if let Err(e) = group.set_free(self.is_free()).await {
                warn!("cannot rejoin the generator claim group: {e}");
            }
        }
        info!("generator stopping");
        Ok(())
    }
}

/// On a GPU, a model about to be dropped gives its memory back first (its KV pool freed, its
/// weights moved to host memory, libtorch's cache returned to the driver), so the next
/// model's KV cache is sized from memory that is really free: the engine itself goes only
/// when the last request holding it ends.
async fn give_back_device(state: &AppState) {
    if state.device == tch::Device::Cpu {
        return;
    }
    let sleep = keel_generation::engine::Memory::Sleep { offload_weights: true };
    if let Err(e) = state.engine.change_memory(sleep).await {
        warn!("cannot free the model's GPU memory before dropping it: {e}");
    }
}

/// Whether two paths name the same directory.
fn same_dir(a: &std::path::Path, b: &std::path::Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

fn parse<T: serde::de::DeserializeOwned>(payload: &[u8]) -> Answer<T> {
    serde_json::from_slice(payload).map_err(|e| refuse(error_types::INVALID_REQUEST, format!("malformed request: {e}")))
}

fn encode<T: serde::Serialize>(answer: Answer<T>) -> Vec<u8> {
    let reply = match answer {
        Ok(value) => Reply::Ok(value),
        Err(body) => Reply::Error(body),
    };
    serde_json::to_vec(&reply).unwrap_or_default()
}
