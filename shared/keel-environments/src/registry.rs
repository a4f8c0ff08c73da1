//! The registry: environments built from their typed configuration, and cached by it, so a
//! plugin's concurrency limit and a compiled regex are shared by every request that names
//! them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use keel_protocol::reward::EnvConfig;
use keel_protocol::{FieldError, Subjects};

use crate::envs;
use crate::envs::{Blocking, Environment};
use crate::sandbox::Sandbox;

/// Shared handles environments are built with.
#[derive(Clone)]
pub struct EnvContext {
    pub http: reqwest::Client,
    /// Which loopback and private addresses `http` and `agent` environments may name.
    pub private: keel_service::outbound::PrivateAccess,
    /// For `reward_model` (trainer requests); none when the service runs without NATS.
    pub nats: Option<async_nats::Client>,
    pub subjects: Subjects,
    /// The JetStream object-store bucket for bodies over 1 MiB (the trainers' bucket).
    pub bulk_bucket: String,
    pub sandbox: Arc<Sandbox>,
}

impl std::fmt::Debug for EnvContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvContext").field("nats", &self.nats.is_some()).field("sandbox", &self.sandbox).finish()
    }
}

impl EnvContext {
    /// Handles for environments: an HTTP client that resolves only to public addresses but
    /// those `private` allows; `nats` for reward models on trainer workers (none: they are
    /// refused); the code sandbox from its configuration.
    pub fn new(
        private: keel_service::outbound::PrivateAccess,
        use_proxy: bool,
        nats: Option<async_nats::Client>,
        subjects: Subjects,
        bulk_bucket: String,
        sandbox: crate::sandbox::SandboxConfig,
    ) -> Result<Self, reqwest::Error> {
        // Each call has its own timeout (the environment's); this one only bounds a call
        // that somehow escapes it.
        let http = private.client(use_proxy, std::time::Duration::from_secs(3600))?;
        Ok(Self { http, private, nats, subjects, bulk_bucket, sandbox: Sandbox::new(sandbox) })
    }
}

/// Builds the environment `config` names; the error names the bad field (`env.pattern: ...`).
pub fn build(config: &EnvConfig, ctx: &EnvContext) -> Result<Arc<dyn Environment>, FieldError> {
    build_unprefixed(config, ctx).map_err(|e| FieldError::new(format!("env.{}", e.field), e.message))
}

fn build_unprefixed(config: &EnvConfig, ctx: &EnvContext) -> Result<Arc<dyn Environment>, FieldError> {
    let env: Arc<dyn Environment> = match config {
        EnvConfig::Math(c) => Arc::new(Blocking(Arc::new(envs::math::MathEnv::new(c)?))),
        EnvConfig::Code(c) => Arc::new(envs::code::CodeEnv::new(c, ctx.sandbox.clone())?),
        EnvConfig::SlidingPuzzle(c) => Arc::new(Blocking(Arc::new(envs::puzzle::PuzzleEnv::new(c)?))),
        EnvConfig::ExactMatch(c) => Arc::new(Blocking(Arc::new(envs::matching::ExactMatch::new(c)?))),
        EnvConfig::Regex(c) => Arc::new(Blocking(Arc::new(envs::matching::RegexEnv::new(c)?))),
        EnvConfig::MultipleChoice(c) => Arc::new(Blocking(Arc::new(envs::matching::MultipleChoice::new(c)?))),
        EnvConfig::Http(c) => Arc::new(envs::http::HttpEnv::new(c, ctx.http.clone(), &ctx.private)?),
        EnvConfig::Agent(c) => Arc::new(envs::agent::AgentEnv::new(c, ctx.http.clone(), &ctx.private)?),
        EnvConfig::RewardModel(c) => Arc::new(envs::reward_model::RewardModelEnv::new(
            c,
            ctx.nats.clone(),
            ctx.subjects.clone(),
            &ctx.bulk_bucket,
        )?),
    };
    Ok(env)
}

/// Why [`EnvCache::get`] has no environment to give.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The configuration names a bad value.
    #[error(transparent)]
    Invalid(#[from] FieldError),
    /// A thread panicked while it held the cache.
    #[error("environment cache poisoned")]
    Poisoned,
}

/// Built environments by configuration (at most [`EnvCache::CAPACITY`]; the oldest half is
/// dropped when full).
#[derive(Clone, Default)]
pub struct EnvCache {
    built: Arc<Mutex<Built>>,
}

/// A use counter, and each environment with the count of its last use.
type Built = (u64, HashMap<String, (u64, Arc<dyn Environment>)>);

impl std::fmt::Debug for EnvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EnvCache")
    }
}

impl EnvCache {
    pub const CAPACITY: usize = 64;

    pub fn get(&self, config: &EnvConfig, ctx: &EnvContext) -> Result<Arc<dyn Environment>, BuildError> {
        let key = serde_json::to_string(config).map_err(|e| FieldError::new("env", e.to_string()))?;
        let mut guard = self.built.lock().map_err(|_| BuildError::Poisoned)?;
        let (clock, built) = &mut *guard;
        *clock += 1;
        if let Some((used, env)) = built.get_mut(&key) {
            *used = *clock;
            return Ok(env.clone());
        }
        let env = build(config, ctx)?;
        if built.len() >= Self::CAPACITY {
            let mut ages: Vec<u64> = built.values().map(|(used, _)| *used).collect();
            ages.sort_unstable();
            let cutoff = ages[ages.len() / 2];
            built.retain(|_, (used, _)| *used > cutoff);
        }
        built.insert(key, (*clock, env.clone()));
        Ok(env)
    }
}
