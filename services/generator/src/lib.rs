//! keel-generator: the inference engine behind an OpenAI-compatible API.
//!
//! The engine (scheduler, KV cache, sampling) is the `keel-generation` library; this crate
//! is its process:
//! - [`wire`]: the OpenAI-compatible wire types.
//! - [`openai`]: `/v1/completions`, `/v1/chat/completions` (SSE streaming), `/v1/models`,
//!   `/tokenize`, `/detokenize`, `/metrics`; OpenAI error objects; 429 when the queue is full;
//!   the OpenAPI document (`ApiDoc`).
//! - [`agent`]: agent sessions: keys scoped to one sample of a run, and the record of
//!   every completion made under them, token for token.
//! - [`claims`]: the generator as a run's: claimed (queue group `generator` on
//!   `<prefix>.generator.claim` while free), loading the run's model, serving it, released
//!   (or its lease running out), then back to its start-up model.
//! - [`rollout`]: the claiming run's NATS rollout requests, weights-updated refits,
//!   colocated sleep and wake.
//! - [`group`]: the tensor-parallel ranks as generator processes of their own (one per GPU,
//!   on one machine or several), led by the group's rank 0.
//! - [`error`]: what start-up and the NATS side can fail with.
//! - this file: configuration, loading the model into an engine (KV cache size, CUDA kernels
//!   and graphs), lifecycle.
//!
//! Without a `model` configured the service starts with nothing loaded: `/healthz` answers,
//! the OpenAI API answers 503 until a run claims the generator and has it load its model.

pub mod agent;
pub mod claims;
pub mod error;
pub mod fields;
pub mod group;
pub mod openai;
pub mod refit;
pub mod rollout;
pub mod structured;
pub mod tools;
pub mod wire;

use keel_generation::{backend, engine, request};
use keel_protocol::FieldError;

pub use error::{Error, Result};

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use keel_collective::process::GroupConfig;
use serde::{Deserialize, Serialize};

pub const SERVICE: &str = "generator";

/// Configuration: defaults, then `--config FILE`, then `KEEL_GENERATOR__<FIELD>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub listen: SocketAddr,
    /// A Hugging Face model directory served while no run holds the generator (none:
    /// nothing is served until a run loads its model).
    pub model: Option<PathBuf>,
    /// The name clients use in `model` (default: the directory's name).
    pub served_model_name: Option<String>,
    /// cpu, cuda or cuda:N.
    pub device: String,
    /// f32, bf16 or f16 (default: f32 on CPU, bf16 on CUDA).
    pub dtype: Option<String>,
    /// Sequences running at once (a scheduling limit; memory is the KV cache's).
    pub max_num_seqs: usize,
    /// Tokens one engine step computes: the running decodes plus prompt chunks.
    pub max_num_batched_tokens: usize,
    /// Tokens per request, prompt included (default: the model's context, at most 4096).
    pub max_model_len: Option<i64>,
    /// Bytes of KV cache. Default on the CPU: 2 GiB (committed as blocks are first used); on CUDA: what `gpu_memory_utilization`
    /// leaves.
    pub kv_cache_memory_bytes: Option<u64>,
    /// On CUDA, the fraction of the GPU's memory this generator may use (weights, KV cache
    /// and activations), as vLLM's option of the same name.
    pub gpu_memory_utilization: f64,
    /// On CUDA, Keel's own kernels for RMSNorm, rotary embedding, SiLU·mul and decode
    /// attention, each checked against its tch path at start-up (false: tch everywhere).
    pub cuda_kernels: bool,
    /// On CUDA, run every step eagerly instead of replaying decode steps captured as CUDA
    /// graphs at start-up (vLLM's `enforce_eager`).
    pub enforce_eager: bool,
    /// Requests waiting to run before new ones get 429.
    pub max_waiting: usize,
    /// NATS server for rollouts and refits (default `KEEL_NATS_URL` or nats://127.0.0.1:4222);
    /// empty: serve the HTTP API only, as a standalone OpenAI-compatible server.
    pub nats_url: String,
    /// Prefix of every subject (`keel.v1`).
    pub subject_prefix: String,
    /// `drain` (no sample mixes weight versions) or `pause` (swap at the next token).
    pub refit_mode: engine::RefitMode,
    /// Ranks the model is split over (tensor parallelism; 1: none). On the CPU the ranks
    /// are threads; on CUDA rank r uses `cuda:N+r` from `device`, over NCCL. In a `group`
    /// the ranks are the group's processes: leave it at 1 or set it to `group.size`.
    pub tensor_parallel_size: usize,
    /// This process as one tensor-parallel rank of a group of generator processes
    /// (`{name, rank, size}`; see [`group`]): rank 0 serves, the others follow it and need
    /// no `model`. Unset: the ranks are threads of this process.
    #[serde(default)]
    pub group: Option<GroupConfig>,
    /// When set, the OpenAI API wants `Authorization: Bearer <api_key>` (vLLM's `--api-key`);
    /// `/healthz` stays open. Default: `KEEL_GENERATOR_API_KEY` when set.
    pub api_key: Option<String>,
    /// The directories a run's model and its refits may be loaded from (the path a request
    /// names must resolve inside one). Default: `.keel`, `/var/lib/keel`, the system's
    /// temporary directory and the Hugging Face cache.
    pub path_roots: Vec<PathBuf>,
    /// This generator's id in its subjects (default: a new random id).
    pub generator_id: Option<String>,
    /// The longest lease a run's claim may ask for, in seconds.
    pub max_lease_seconds: f64,
    /// How the served model writes tool calls, for chat requests with `tools` (vLLM's
    /// `--tool-call-parser`): `hermes` (Hermes, Qwen 2.5 and 3, SmolLM3), `llama3_json`
    /// (Llama 3.1 to 3.3) or `granite` (Granite 3). Unset: requests with tools are refused.
    #[serde(default)]
    pub tool_call_parser: Option<tools::ToolParser>,
    /// The URL agents reach this generator's OpenAI API at (`/v1` is added): what a run's
    /// agent environment is given. Default: the address it listens on (loopback for
    /// `0.0.0.0`); set it when agents run on other hosts or in other containers.
    #[serde(default)]
    pub public_url: Option<String>,
}

impl keel_service::ServiceConfig for Config {
    fn validate(&self) -> Result<(), FieldError> {
        keel_service::refuse_published_token(self.listen, self.api_key.as_deref(), "api_key")?;
        if self.max_num_seqs == 0 {
            return Err(FieldError::new("max_num_seqs", "must be at least 1"));
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return Err(FieldError::new(
                "max_num_batched_tokens",
                format!(
                    "must be at least max_num_seqs ({}), so that every running sequence decodes each step; got {}",
                    self.max_num_seqs, self.max_num_batched_tokens
                ),
            ));
        }
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            return Err(FieldError::new(
                "gpu_memory_utilization",
                format!("must be in (0, 1], got {}", self.gpu_memory_utilization),
            ));
        }
        if self.kv_cache_memory_bytes == Some(0) {
            return Err(FieldError::new("kv_cache_memory_bytes", "must be positive"));
        }
        if !(1..=64).contains(&self.tensor_parallel_size) {
            return Err(FieldError::new(
                "tensor_parallel_size",
                format!("must be 1 to 64, got {}", self.tensor_parallel_size),
            ));
        }
        if let Some(group) = &self.group {
            if let Some((field, why)) = group.problem() {
                return Err(FieldError::new(field, why));
            }
            if self.tensor_parallel_size != 1 && self.tensor_parallel_size != group.size {
                return Err(FieldError::new(
                    "tensor_parallel_size",
                    format!(
                        "a group's ranks are its tensor-parallel ranks: leave it at 1 or set it to group.size ({}), \
                         got {}",
                        group.size, self.tensor_parallel_size
                    ),
                ));
            }
            if self.nats_url.is_empty() {
                return Err(FieldError::new("nats_url", "a group's ranks meet over NATS: it must be set"));
            }
            if group.rank == 0 && self.model.is_none() {
                return Err(FieldError::new("model", "the leader of a group (group.rank 0) needs a model"));
            }
        }
        if self.max_model_len.is_some_and(|l| l < 2) {
            return Err(FieldError::new("max_model_len", "must be at least 2"));
        }
        keel_protocol::Subjects::new(&self.subject_prefix)
            .map_err(|e| FieldError::new("subject_prefix", e.to_string()))?;
        if let Some(url) = &self.public_url
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            return Err(FieldError::new("public_url", format!("`{url}` must be an http:// or https:// URL")));
        }
        if self.api_key.as_deref() == Some("") {
            return Err(FieldError::new("api_key", "must not be empty (leave it unset for no key)"));
        }
        if let Some(id) = &self.generator_id {
            if !keel_protocol::subjects::is_subject_token(id) {
                return Err(FieldError::new("generator_id", format!("`{id}` must be letters, digits, `-` and `_`")));
            }
            if id == "group" || id == "claim" {
                return Err(FieldError::new("generator_id", format!("`{id}` is reserved (a subject of its own)")));
            }
        }
        if !(self.max_lease_seconds.is_finite() && self.max_lease_seconds > 0.0) {
            return Err(FieldError::new(
                "max_lease_seconds",
                format!("must be positive, got {}", self.max_lease_seconds),
            ));
        }
        Ok(())
    }
}

pub fn default_config() -> Config {
    Config {
        listen: SocketAddr::from(([127, 0, 0, 1], 8081)),
        model: None,
        served_model_name: None,
        device: "cpu".into(),
        dtype: None,
        max_num_seqs: 16,
        max_num_batched_tokens: 8192,
        max_model_len: None,
        kv_cache_memory_bytes: None,
        gpu_memory_utilization: 0.85,
        cuda_kernels: true,
        enforce_eager: false,
        max_waiting: 64,
        nats_url: keel_service::nats::default_url(),
        subject_prefix: keel_protocol::Subjects::default().prefix().to_string(),
        refit_mode: engine::RefitMode::Drain,
        tensor_parallel_size: 1,
        api_key: std::env::var("KEEL_GENERATOR_API_KEY").ok().filter(|k| !k.is_empty()),
        path_roots: keel_service::paths::default_roots(),
        group: None,
        generator_id: None,
        max_lease_seconds: 3600.0,
        tool_call_parser: None,
        public_url: None,
    }
}

impl Config {
    /// The ranks the model is split over: the group's size in a group, else
    /// `tensor_parallel_size`.
    pub fn world_size(&self) -> usize {
        self.group.as_ref().map_or(self.tensor_parallel_size, |g| g.size)
    }
}

/// Loads the model and starts the engine; the handlers' state. `leading`: this process
/// leads a group of generator processes, which load their shares with it.
pub fn load(config: &Config, model_dir: &std::path::Path, leading: Option<group::Leading>) -> Result<openai::AppState> {
    let device = keel_model::device::parse_device(&config.device)?;
    let kind = match &config.dtype {
        Some(name) => keel_model::device::parse_kind(name)?,
        None if device == tch::Device::Cpu => tch::Kind::Float,
        None => tch::Kind::BFloat16,
    };
    // An adapter directory (a LoRA run's checkpoint) loads as its base with the adapters
    // merged: the base says what the model is; the tokenizer is the directory's own when
    // it has one.
    let config_dir = keel_model::lora::model_config_dir(model_dir)?;
    let model_config = keel_model::ModelConfig::load(&config_dir)?;
    let tokenizer = keel_model::Tokenizer::load(model_dir)
        .or_else(|_| keel_model::Tokenizer::load(&config_dir))
        .map_err(keel_model::Error::from)?;
    let context = model_config.max_position_embeddings;
    let max_model_len = config.max_model_len.unwrap_or(context.min(4096));
    if max_model_len > context {
        return Err(Error::ContextTooShort { max_model_len, context });
    }
    let vocab_size = model_config.vocab_size;
    let world = config.world_size();
    let blocks = kv_cache_blocks(config, &model_config, device, kind)?;
    let dir = model_dir.to_path_buf();
    // Kernels on and off, and CUDA graph buckets captured, for /metrics.
    let counts = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0), AtomicUsize::new(0)]);
    let use_kernels = config.cuda_kernels && device != tch::Device::Cpu && world == 1;
    let use_graphs = use_kernels && !config.enforce_eager;
    let (max_num_seqs, max_len) = (config.max_num_seqs, max_model_len as usize);
    let loaded_counts = counts.clone();
    let backend = move || {
        if let Some(leading) = leading {
            return leading.backend(&dir, device, kind, blocks);
        }
        if world > 1 {
            return backend::Backend::sharded(&dir, world, device, kind, blocks);
        }
        let mut model = keel_model::CausalLm::load(&dir, device, kind)?;
        if use_kernels {
            let (on, off) = backend::attach_kernels(&mut model, device, kind);
            loaded_counts[0].store(on, Ordering::Relaxed);
            loaded_counts[1].store(off, Ordering::Relaxed);
        }
        let mut backend = backend::Backend::whole(model, blocks)?;
        if use_graphs {
            loaded_counts[2].store(backend.capture_graphs_or_run_eagerly(max_num_seqs, max_len), Ordering::Relaxed);
        }
        Ok(backend)
    };
    let mut eos_token_ids = tokenizer.eos_token_ids().to_vec();
    if eos_token_ids.is_empty() {
        eos_token_ids = model_config.eos_token_ids.clone();
    }
    let model_name = config.served_model_name.clone().unwrap_or_else(|| {
        model_dir.file_name().map_or_else(|| model_dir.display().to_string(), |n| n.to_string_lossy().into_owned())
    });
    let tokenizer = Arc::new(tokenizer);
    let engine_config = engine::EngineConfig {
        max_num_seqs: config.max_num_seqs,
        max_num_batched_tokens: config.max_num_batched_tokens,
        max_model_len: max_model_len as usize,
        refit_mode: config.refit_mode,
        model_name: model_name.clone(),
    };
    // Before the engine starts: it records its request metrics from the first request on.
    keel_service::metrics::install();
    keel_generation::served::describe();
    let engine = engine::Engine::start_with(backend, Some(tokenizer.clone()), engine_config)?;
    engine.stats.kernels_on.store(counts[0].load(Ordering::Relaxed), Ordering::Relaxed);
    engine.stats.kernels_off.store(counts[1].load(Ordering::Relaxed), Ordering::Relaxed);
    engine.stats.graph_buckets.store(counts[2].load(Ordering::Relaxed), Ordering::Relaxed);
    let limits = request::Limits {
        vocab_size,
        max_model_len: max_model_len as usize,
        max_num_seqs: config.max_num_seqs,
        eos_token_ids,
    };
    let capacity = config.max_num_seqs + config.max_waiting;
    let admission = Arc::new(tokio::sync::Semaphore::new(capacity));
    let dtype = keel_model::weights::dtype_name(kind);
    let links = Arc::default();
    let tool_parser = config.tool_call_parser;
    let eos = limits.eos_token_ids.first().copied().unwrap_or(0) as u32;
    // The tokenizer's files, from the directory the tokenizer was loaded from (an adapter
    // directory's own, else its base's).
    let tokenizer_file =
        |name: &str| [model_dir, config_dir.as_path()].map(|dir| dir.join(name)).into_iter().find(|p| p.is_file());
    let tokenizer_info = Arc::new(openai::tokenizer_info(tokenizer_file("tokenizer_config.json"), max_model_len));
    let guides = tokenizer_file("tokenizer.json")
        .ok_or_else(|| "no tokenizer.json".to_string())
        .and_then(|path| structured::Guides::load(&path, model_config.vocab_size as usize, eos))
        .inspect_err(|e| tracing::warn!("structured output is off for this model: {e}"))
        .ok()
        .map(Arc::new);
    Ok(openai::AppState {
        engine,
        tokenizer,
        model_name,
        dtype,
        device,
        links,
        limits,
        admission,
        capacity,
        tool_parser,
        tokenizer_info,
        guides,
    })
}

/// Default KV-cache bytes on the CPU.
const CPU_KV_CACHE_BYTES: u64 = 2 << 30;

/// Blocks per device of the KV cache: `kv_cache_memory_bytes` when set; on the CPU 2 GiB;
/// on CUDA the share of the GPU that `gpu_memory_utilization` allows, less what is in use
/// before loading, the weights (each rank's share) and an estimate of the activations of
/// one step of `max_num_batched_tokens` tokens.
fn kv_cache_blocks(
    config: &Config,
    cfg: &keel_model::ModelConfig,
    device: tch::Device,
    kind: tch::Kind,
) -> Result<usize> {
    let world = config.world_size() as i64;
    let kv_heads = (cfg.num_key_value_heads / world).max(1);
    let bytes = match (config.kv_cache_memory_bytes, device) {
        (Some(bytes), _) => bytes,
        (None, tch::Device::Cuda(ordinal)) => {
            let (free, total) = keel_collective::nccl::device_memory(ordinal).map_err(keel_model::Error::from)?;
            let element = kind.elt_size_in_bytes() as i64;
            let (h, i, l, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size);
            let attention = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim * 2;
            let embeddings = if cfg.tie_word_embeddings { v * h } else { 2 * v * h };
            let mlps: i64 = (0..l as usize).map(|layer| cfg.mlp_parameters(layer)).sum();
            let weights = (embeddings + l * attention + mlps) * element / world;
            let tokens = config.max_num_batched_tokens as i64;
            let activations = tokens * (4 * h + 3 * i / world) * element + config.max_num_seqs as i64 * v * 4 * 4;
            let allowed = (total as f64 * config.gpu_memory_utilization) as i64;
            let budget = allowed - (total - free) as i64 - weights - activations;
            tracing::info!(
                total_gib = total as f64 / (1u64 << 30) as f64,
                kv_cache_gib = budget as f64 / (1u64 << 30) as f64,
                "KV cache sized from gpu_memory_utilization"
            );
            if budget <= 0 {
                return Err(Error::NoRoomForKvCache {
                    utilization: config.gpu_memory_utilization,
                    ordinal,
                    free_mib: free >> 20,
                    total_mib: total >> 20,
                    weights_mib: weights >> 20,
                    activations_mib: activations >> 20,
                });
            }
            budget as u64
        }
        (None, _) => CPU_KV_CACHE_BYTES,
    };
    Ok(backend::blocks_in(cfg, kv_heads, kind, bytes))
}

/// What the OpenAI API serves now: the routes of the loaded model (the start-up model, or
/// the model of the run holding the generator), or nothing while none is loaded; and the
/// agent sessions open on it, with the base URL their agents are given.
#[derive(Clone, Default)]
pub struct Serving {
    routes: Arc<std::sync::RwLock<Option<(axum::Router, openai::AppState)>>>,
    sessions: Arc<agent::Sessions>,
    base_url: Arc<std::sync::OnceLock<String>>,
}

impl std::fmt::Debug for Serving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let serving = self.routes.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        f.debug_struct("Serving").field("model", &serving.as_ref().map(|(_, state)| &state.model_name)).finish()
    }
}

impl Serving {
    /// Serves `state` on the OpenAI API from now on (None: nothing).
    pub fn set(&self, state: Option<&openai::AppState>) {
        let routes = state.map(|state| (openai::routes(state.clone()), state.clone()));
        *self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner) = routes;
    }

    fn current(&self) -> Option<axum::Router> {
        self.routes.read().unwrap_or_else(std::sync::PoisonError::into_inner).as_ref().map(|(router, _)| router.clone())
    }

    /// The engine statistics of the model served now.
    pub fn stats(&self) -> Option<Arc<keel_generation::engine::Stats>> {
        let serving = self.routes.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        serving.as_ref().map(|(_, state)| state.engine.stats.clone())
    }

    /// The agent sessions open on this generator.
    pub fn sessions(&self) -> &Arc<agent::Sessions> {
        &self.sessions
    }

    /// The OpenAI API's base URL agents are given (`…/v1`; empty until the service knows
    /// its address).
    pub fn base_url(&self) -> &str {
        self.base_url.get().map_or("", String::as_str)
    }

    /// Advertises the OpenAI API at `url` (`public_url`, or the address bound).
    pub fn set_base_url(&self, url: &str) {
        let _ = self.base_url.set(format!("{}/v1", url.trim_end_matches('/')));
    }

    /// The OpenAI API's routes, answered by whatever model is loaded when a request arrives
    /// (503 while none is).
    fn routes(self) -> axum::Router {
        let mut router = axum::Router::new();
        for path in openai::PATHS {
            router = router.route(path, axum::routing::any(dispatch));
        }
        router.with_state(self)
    }
}

/// A request to the OpenAI API, answered by the model loaded now.
async fn dispatch(
    axum::extract::State(serving): axum::extract::State<Serving>,
    request: axum::extract::Request,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    use tower::ServiceExt;
    match serving.current() {
        Some(router) => router.oneshot(request).await.into_response(),
        None => keel_service::ApiError::new(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "no model is loaded: this generator has no start-up model and no run has loaded one",
        )
        .into_response(),
    }
}

/// The HTTP routes: the OpenAI API (behind `api_key` when set), and `/healthz` and vLLM's
/// `/health` (open, like vLLM's).
pub fn app(state: openai::AppState, api_key: Option<String>) -> axum::Router {
    let serving = Serving::default();
    serving.set(Some(&state));
    serving_app(serving, api_key)
}

/// [`app`] for whatever `serving` serves when each request arrives.
/// A request whose bearer token is an open agent session's key passes whatever `api_key`
/// is, and carries the session ([`agent::SessionKey`]) to the handlers.
pub fn serving_app(serving: Serving, api_key: Option<String>) -> axum::Router {
    let health = axum::Router::new().route("/health", axum::routing::get(|| async { axum::http::StatusCode::OK }));
    let sessions = serving.sessions.clone();
    let session_key = move |request: &mut axum::extract::Request| {
        let Some(key) = keel_service::request_bearer(request).filter(|key| sessions.is_open(key)) else {
            return false;
        };
        let session = agent::SessionKey { key: key.to_string(), sessions: sessions.clone() };
        request.extensions_mut().insert(session);
        true
    };
    keel_service::require_bearer_or(serving.routes(), api_key, session_key)
        .merge(health)
        .merge(keel_service::health_routes(SERVICE))
}

/// Serves until `shutdown` completes: HTTP always (the OpenAI API for the model loaded);
/// with NATS, claims by runs, each run's model loaded and served on its subjects, and the
/// start-up model again once the run lets the generator go.
pub async fn run(config: Config, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
    if let Some(group) = config.group.clone().filter(|g| g.rank > 0) {
        return follow(config, group, shutdown).await;
    }
    let mut parts = keel_service::parts::Parts::default();
    let client = match config.nats_url.as_str() {
        "" => None,
        url => Some(keel_service::nats::connect(url).await?),
    };
    let leading = match (&config.group, &client) {
        (Some(group), Some(client)) => {
            let meeting =
                group::Meeting::new(client.clone(), &config.subject_prefix, SERVICE, group.clone(), &config.nats_url)
                    .map_err(keel_model::Error::from)?;
            let control = meeting.form().await;
            // When the group breaks, the service stops with why: its supervisor starts it
            // again, and it loads once every rank is back.
            let (lost, mut told) = tokio::sync::watch::channel(None);
            let stopped = parts.stopped();
            parts.spawn("group", async move {
                let why = tokio::select! {
                    biased;
                    () = stopped => None,
                    why = told.wait_for(Option::is_some) => why.ok().and_then(|why| why.clone()),
                };
                match why {
                    Some(why) => Err(format!("{why}; this leader stops, to be started again once every rank is back")),
                    None => Ok(()),
                }
            });
            Some(group::Leading { meeting, control, handle: tokio::runtime::Handle::current(), lost })
        }
        _ => None,
    };
    let serving = Serving::default();
    let listener = keel_service::bind_http(config.listen).await.map_err(keel_service::Error::Http)?;
    serving.set_base_url(&match &config.public_url {
        Some(url) => url.clone(),
        None => advertised(listener.local_addr().map_err(keel_service::Error::Http)?),
    });
    let startup = match config.model.clone() {
        Some(dir) => {
            let loaded = load_blocking(config.clone(), dir, leading.clone()).await?;
            tracing::info!(
                model = %loaded.model_name,
                max_num_seqs = config.max_num_seqs,
                kv_blocks = loaded.engine.stats.blocks_total.load(Ordering::Relaxed),
                tensor_parallel_size = config.world_size(),
                "model loaded"
            );
            serving.set(Some(&loaded));
            Some(loaded)
        }
        None => None,
    };
    if let Some(client) = client {
        let subjects = keel_protocol::Subjects::new(&config.subject_prefix).map_err(keel_service::Error::from)?;
        let roots = keel_service::paths::PathRoots::new(&config.path_roots, "KEEL_GENERATOR__PATH_ROOTS")?;
        let generator = claims::Generator::new(client, subjects, &config, roots, serving.clone(), startup, leading);
        parts.spawn("nats", generator.serve(parts.stopped()));
    } else {
        tracing::info!("no nats_url: serving HTTP only (no runs, rollouts or refits over NATS)");
    }
    let app = serving_app(serving, config.api_key.clone());
    let http = keel_service::run_http_on(SERVICE, listener, app, parts.stopped());
    parts.spawn("http", http);
    Ok(parts.run_until(shutdown).await?)
}

/// The URL of the address bound: a loopback one for an unspecified address (`0.0.0.0`),
/// which only agents on this host reach; `public_url` says otherwise.
fn advertised(addr: SocketAddr) -> String {
    let ip = if addr.ip().is_unspecified() { std::net::Ipv4Addr::LOCALHOST.into() } else { addr.ip() };
    format!("http://{}", SocketAddr::new(ip, addr.port()))
}

/// [`load`] on the blocking pool.
pub async fn load_blocking(config: Config, dir: PathBuf, leading: Option<group::Leading>) -> Result<openai::AppState> {
    tokio::task::spawn_blocking(move || load(&config, &dir, leading)).await.map_err(|e| Error::Task("loading", e))?
}

/// A rank of a group other than the leader: `/healthz`, and the leader's commands on a
/// thread of its own until the process stops.
async fn follow(config: Config, group: GroupConfig, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
    let device = keel_model::device::parse_device(&config.device)?;
    let client = keel_service::nats::connect(&config.nats_url).await?;
    let meeting = group::Meeting::new(client, &config.subject_prefix, SERVICE, group, &config.nats_url)
        .map_err(keel_model::Error::from)?;
    let handle = tokio::runtime::Handle::current();
    let threads = tch::get_num_threads();
    std::thread::Builder::new()
        .name("keel-generator-rank".into())
        .spawn(move || {
            tch::set_num_threads(threads);
            group::follow(meeting, handle, device)
        })
        .map_err(|e| Error::Model(keel_model::Error::Device(format!("cannot start the rank's thread: {e}"))))?;
    let app = keel_service::health_routes(SERVICE);
    Ok(keel_service::run_http(SERVICE, config.listen, app, shutdown).await.map_err(keel_service::Error::Http)?)
}

// The settings reference names every field of this service's configuration.
#[cfg(test)]
keel_testkit::settings_reference_test!();
