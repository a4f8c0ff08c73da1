//! The scheduler: one thread owns the model, its paged KV pool and the [`BlockManager`].
//!
//! Every step runs one forward pass over a budget of `max_num_batched_tokens` tokens: first
//! one token of every running sequence (oldest first; a sequence still in its prompt takes
//! as many prompt tokens as the budget leaves — chunked prefill), then prompt tokens of
//! waiting requests in arrival order, several per pass, while the budget, `max_num_seqs`
//! and free blocks allow. A sequence starts from the longest run of its prompt's full
//! blocks in the prefix cache. When a request's prompt is done its n samples fork from it,
//! sharing its blocks (a shared block is copied when a sample first writes into it).
//!
//! When a running sequence needs a block and none is free, the newest running sequence is
//! preempted: its blocks are let go, its tokens kept, and it waits at the front of the
//! queue to be recomputed (mostly from the prefix cache) when blocks free up. Every
//! admitted request finishes; none fails for lack of cache.
//!
//! Sampling runs on the model's device for the whole step ([`keel_model::sampling::sample`]):
//! sample i of a request draws with seed + i and its token index, so its output does not
//! depend on what else is in the batch, nor on whether it was preempted.
//!
//! Refit: new weights are copied into the model at a step boundary. In `drain` mode no new
//! request is admitted until the running ones finish, so every sample comes from one weight
//! version; in `pause` mode the running samples pause for the copy and continue on the new
//! weights. Either way the prefix cache is cleared. Every finished sample reports the
//! version it ended on.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use keel_model::sampling::{Draw, Sampled, sample};
use keel_model::{BLOCK_SIZE, CausalLm, SeqChunk, Tokenizer};
use tch::{Device, Tensor};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use crate::backend::Backend;
use crate::blocks::{BlockId, BlockManager, extend_keys};
use crate::request::{Event, Finish, GenRequest, TokenOut};
use crate::served::{self, Count};
use crate::text::{Detokenizer, first_stop};

/// Counters the metrics endpoint reads.
#[derive(Debug, Default)]
pub struct Stats {
    /// Requests and preempted sequences waiting.
    pub waiting: AtomicUsize,
    /// Sequences running.
    pub running: AtomicUsize,
    pub blocks_total: AtomicUsize,
    pub blocks_used: AtomicUsize,
    pub preemptions: AtomicU64,
    /// Prompt blocks looked up in the prefix cache, and found.
    pub prefix_queried: AtomicU64,
    pub prefix_hits: AtomicU64,
    /// Forward passes, and the tokens they computed.
    pub steps: AtomicU64,
    pub step_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub requests_finished: AtomicU64,
    /// Time spent in steps, microseconds.
    pub decode_micros: AtomicU64,
    /// Where the steps' time went, microseconds: [`StepPhase`] order.
    pub phase_micros: [AtomicU64; 4],
    /// The weight version being served.
    pub weight_version: AtomicU64,
    pub refits: AtomicU64,
    /// How long the last refit took (waiting for the drain included), microseconds.
    pub last_refit_micros: AtomicU64,
    /// Keel's CUDA kernels running, and switched off at start-up (their tch path runs).
    pub kernels_on: AtomicUsize,
    pub kernels_off: AtomicUsize,
    /// Batch sizes whose decode step replays a CUDA graph (0: eager).
    pub graph_buckets: AtomicUsize,
    /// 1 while asleep (colocated: the trainer's turn), and how many sleeps so far.
    pub asleep: AtomicUsize,
    pub sleeps: AtomicU64,
}

pub use keel_protocol::generator::RefitMode;

/// The parts of a step, as [`Stats::phase_micros`] counts them: scheduling and building the
/// chunks; the forward pass as the host sees it (launching the work, or, with
/// `KEEL_SYNC_STEP_PHASES=1`, waiting for the device to finish it); drawing the next tokens
/// (sampling, and copying them to the host, which waits for whatever the device still runs);
/// moving the sequences on (tokens, cached blocks, events to the requests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepPhase {
    Schedule = 0,
    Forward = 1,
    Draw = 2,
    Advance = 3,
}

impl StepPhase {
    pub const ALL: [StepPhase; 4] = [StepPhase::Schedule, StepPhase::Forward, StepPhase::Draw, StepPhase::Advance];

    pub fn name(self) -> &'static str {
        match self {
            StepPhase::Schedule => "schedule",
            StepPhase::Forward => "forward",
            StepPhase::Draw => "draw",
            StepPhase::Advance => "advance",
        }
    }
}

/// The scheduler's limits, and the name its metrics carry.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Sequences running at once.
    pub max_num_seqs: usize,
    /// Tokens one step computes (running decodes plus prompt chunks).
    pub max_num_batched_tokens: usize,
    /// Tokens of one sequence, prompt included.
    pub max_model_len: usize,
    pub refit_mode: RefitMode,
    /// The served model's name: the `model_name` label of the engine's metrics.
    pub model_name: String,
}

struct Refit {
    weights: crate::backend::Weights,
    version: u64,
    /// This refit's mode where it overrides [`EngineConfig::refit_mode`].
    mode: Option<RefitMode>,
    requested: Instant,
    done: oneshot::Sender<crate::Result<f64>>,
}

/// What a colocated generator does with its memory around the trainer's turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// Free the KV pool (and, with `offload_weights`, move the weights to host memory) once
    /// the running samples finish; admit nothing until woken.
    Sleep { offload_weights: bool },
    /// Take the pool (and the weights) back and serve again.
    Wake,
}

struct MemoryChange {
    change: Memory,
    requested: Instant,
    done: oneshot::Sender<crate::Result<(f64, u64)>>,
}

enum Command {
    Generate(Submission),
    Refit(Refit),
    Memory(MemoryChange),
    Score(Score),
}

/// A prompt to score (`echo`, `prompt_logprobs`), between two steps.
struct Score {
    prompt: Vec<i64>,
    top: usize,
    done: oneshot::Sender<crate::Result<keel_model::PromptLogprobs>>,
}

struct Submission {
    request: GenRequest,
    events: UnboundedSender<Event>,
    arrived: Instant,
}

/// A handle to the scheduler thread.
#[derive(Debug, Clone)]
pub struct Engine {
    submit: mpsc::Sender<Command>,
    pub stats: Arc<Stats>,
    pub max_num_seqs: usize,
    pub max_model_len: i64,
}

/// One sequence: a request's prompt before its samples fork, or one sample.
#[derive(Debug, Clone)]
struct Sequence {
    request: usize,
    /// Sample index (the first sample's while the prompt runs).
    index: usize,
    /// Samples this sequence becomes when its prompt is done (1 once forked).
    forks: usize,
    /// Prompt then generated tokens.
    tokens: Vec<i64>,
    prompt_len: usize,
    /// Tokens whose keys and values are in `blocks`.
    computed: usize,
    blocks: Vec<BlockId>,
    /// Prefix-cache keys of the full blocks of `tokens`, and how many are registered.
    keys: Vec<u64>,
    registered: usize,
    /// Whether its blocks may enter the prefix cache (not after a pause-mode refit).
    cacheable: bool,
    /// The generated text, kept only when the request has stop strings.
    text: Detokenizer,
    /// When its last token came out.
    last_token: Option<Instant>,
    /// What it may write (structured output): its request's, forked for each sample.
    guide: Option<crate::guide::Guide>,
}

impl Sequence {
    fn generated(&self) -> &[i64] {
        &self.tokens[self.prompt_len..]
    }
}

enum Waiting {
    New(Submission),
    Preempted(Sequence),
}

struct Running {
    request: GenRequest,
    events: UnboundedSender<Event>,
    arrived: Instant,
    /// Samples not finished.
    live: usize,
    /// When the request's first token came out.
    first_token: Option<Instant>,
}

/// Why blocks could not be reserved.
enum Shortage {
    NoBlocks,
    Failed(keel_model::Error),
}

struct Scheduler {
    model: Backend,
    blocks: BlockManager,
    tokenizer: Option<Arc<Tokenizer>>,
    config: EngineConfig,
    waiting: VecDeque<Waiting>,
    /// Oldest first: the last is preempted first.
    running: Vec<Sequence>,
    requests: Vec<Option<Running>>,
    stats: Arc<Stats>,
    refit: Option<Refit>,
    memory: Option<MemoryChange>,
    /// Sleeping (colocated, the trainer's turn): nothing runs until woken.
    asleep: bool,
    /// Request latencies and outcomes, into the process's metrics.
    served: served::Served,
    /// Wait for the device after each forward pass, so [`Stats::phase_micros`] splits the
    /// device's time between the forward pass and the draw (`KEEL_SYNC_STEP_PHASES=1`; a
    /// profiling switch: it costs the overlap of the host's work with the device's).
    sync_phases: bool,
}

/// Blocks needed to hold `tokens` tokens.
fn blocks_for(tokens: usize) -> usize {
    tokens.div_ceil(BLOCK_SIZE)
}

impl Engine {
    /// Starts the scheduler thread over `model` with a pool of `blocks` KV blocks.
    pub fn start(
        model: CausalLm,
        tokenizer: Option<Arc<Tokenizer>>,
        blocks: usize,
        config: EngineConfig,
    ) -> keel_model::Result<Self> {
        Self::start_with(move || Backend::whole(model, blocks), tokenizer, config)
    }

    /// Starts the scheduler thread, which makes its backend (a model or tensor-parallel
    /// ranks, with their pools) with `load` and then owns it; returns once it is ready. The
    /// pool must hold at least one sequence of `max_model_len` tokens.
    ///
    /// Every tensor operation of the engine runs on that one thread, loading included:
    /// libtorch's OpenMP pool belongs to the thread that first uses it, and a second
    /// thread with a pool of its own oversubscribes the cores, so that every parallel
    /// region wakes sleeping workers (about half the decode speed on two cores).
    pub fn start_with(
        load: impl FnOnce() -> keel_model::Result<Backend> + Send + 'static,
        tokenizer: Option<Arc<Tokenizer>>,
        config: EngineConfig,
    ) -> keel_model::Result<Self> {
        if config.max_num_seqs == 0 || config.max_num_batched_tokens == 0 {
            return Err(keel_model::Error::InvalidInput(
                "max_num_seqs and max_num_batched_tokens must be at least 1".into(),
            ));
        }
        let threads = tch::get_num_threads();
        let (max_num_seqs, max_model_len) = (config.max_num_seqs, config.max_model_len as i64);
        let stats = Arc::new(Stats::default());
        let (submit, intake) = mpsc::channel::<Command>();
        let (ready, started) = mpsc::sync_channel::<keel_model::Result<()>>(1);
        let shared = stats.clone();
        std::thread::Builder::new()
            .name("keel-generator-scheduler".into())
            .spawn(move || {
                tch::set_num_threads(threads);
                let backend = load().and_then(|backend| {
                    let blocks = backend.blocks();
                    let needed = blocks_for(config.max_model_len);
                    if blocks < needed {
                        return Err(keel_model::Error::InvalidInput(format!(
                            "the KV cache holds {blocks} blocks of {BLOCK_SIZE} tokens ({} tokens), fewer than one \
                             sequence of max_model_len {} needs ({needed} blocks): give it more memory or lower \
                             max_model_len",
                            blocks * BLOCK_SIZE,
                            config.max_model_len
                        )));
                    }
                    Ok(backend)
                });
                let backend = match backend {
                    Ok(backend) => backend,
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                };
                shared.blocks_total.store(backend.blocks(), Ordering::Relaxed);
                let mut scheduler = Scheduler {
                    served: served::Served::new(&config.model_name, shared.clone()),
                    blocks: BlockManager::new(backend.blocks()),
                    model: backend,
                    tokenizer,
                    config,
                    waiting: VecDeque::new(),
                    running: Vec::new(),
                    requests: Vec::new(),
                    stats: shared,
                    refit: None,
                    memory: None,
                    asleep: false,
                    sync_phases: std::env::var("KEEL_SYNC_STEP_PHASES").is_ok_and(|v| v == "1"),
                };
                let _ = ready.send(Ok(()));
                scheduler.run(intake);
            })
            .map_err(|e| keel_model::Error::InvalidInput(format!("cannot start the scheduler thread: {e}")))?;
        started
            .recv()
            .map_err(|_| keel_model::Error::InvalidInput("the scheduler thread stopped while loading".into()))??;
        Ok(Self { submit, stats, max_num_seqs, max_model_len })
    }

    /// Queues `request`; its events arrive on `events`.
    pub fn submit(&self, request: GenRequest, events: UnboundedSender<Event>) -> crate::Result<()> {
        self.stats.waiting.fetch_add(1, Ordering::Relaxed);
        self.submit
            .send(Command::Generate(Submission { request, events, arrived: Instant::now() }))
            .map_err(|_| crate::Error::Stopped)
    }

    /// The weight version being served.
    pub fn weight_version(&self) -> u64 {
        self.stats.weight_version.load(Ordering::Relaxed)
    }

    /// Loads `weights` as `version`, in `mode` (None: the engine's `refit_mode`); returns
    /// the seconds it took.
    pub async fn refit(
        &self,
        weights: crate::backend::Weights,
        version: u64,
        mode: Option<RefitMode>,
    ) -> crate::Result<f64> {
        let (done, result) = oneshot::channel();
        let refit = Refit { weights, version, mode, requested: Instant::now(), done };
        self.submit.send(Command::Refit(refit)).map_err(|_| crate::Error::Stopped)?;
        result.await.map_err(|_| crate::Error::Dropped("refit"))?
    }

    /// The logprob, rank and `top` most likely alternatives of each of `prompt`'s tokens after
    /// the first, under the weights served now (temperature 1), computed between two steps by
    /// a pass of its own (the KV pool and the prefix cache are not used).
    pub async fn prompt_logprobs(&self, prompt: Vec<i64>, top: usize) -> crate::Result<keel_model::PromptLogprobs> {
        let (done, result) = oneshot::channel();
        self.submit.send(Command::Score(Score { prompt, top, done })).map_err(|_| crate::Error::Stopped)?;
        result.await.map_err(|_| crate::Error::Dropped("prompt scoring"))?
    }

    /// Sleeps or wakes (see [`Memory`]); returns the seconds it took (a sleep waits for the
    /// running samples) and the bytes freed or taken back.
    pub async fn change_memory(&self, change: Memory) -> crate::Result<(f64, u64)> {
        let (done, result) = oneshot::channel();
        let command = MemoryChange { change, requested: Instant::now(), done };
        self.submit.send(Command::Memory(command)).map_err(|_| crate::Error::Stopped)?;
        result.await.map_err(|_| crate::Error::Dropped("memory change"))?
    }
}

impl Scheduler {
    fn run(&mut self, intake: mpsc::Receiver<Command>) {
        loop {
            let idle = self.asleep || (self.running.is_empty() && self.waiting.is_empty());
            if idle && self.refit.is_none() && self.memory.is_none() {
                match intake.recv_timeout(keel_collective::process::PING) {
                    Ok(command) => self.take(command),
                    Err(mpsc::RecvTimeoutError::Timeout) => self.model.keep_alive(),
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(command) = intake.try_recv() {
                self.take(command);
            }
            let drained = self.running.is_empty() && !self.waiting.iter().any(|w| matches!(w, Waiting::Preempted(_)));
            if self.refit_mode() == Some(RefitMode::Pause) || (self.refit.is_some() && drained) {
                self.apply_refit();
            }
            if self.memory.is_some() && drained {
                self.apply_memory();
            }
            if !self.asleep {
                self.step();
            }
            self.publish();
        }
    }

    fn take(&mut self, command: Command) {
        match command {
            Command::Generate(submission) => self.waiting.push_back(Waiting::New(submission)),
            Command::Memory(change) => {
                if let Some(previous) = self.memory.replace(change) {
                    let _ = previous.done.send(Err(crate::Error::MemorySuperseded));
                }
            }
            Command::Refit(refit) => {
                if let Some(previous) = self.refit.replace(refit) {
                    let _ = previous.done.send(Err(crate::Error::RefitSuperseded(previous.version)));
                }
            }
            Command::Score(score) => {
                let outcome = if self.asleep {
                    Err(crate::Error::Request("the generator is asleep (a colocated trainer's turn)".into()))
                } else {
                    self.model.prompt_logprobs(&score.prompt, score.top).map_err(crate::Error::from)
                };
                let _ = score.done.send(outcome);
            }
        }
    }

    /// The mode of the refit waiting to be applied, if one is.
    fn refit_mode(&self) -> Option<RefitMode> {
        self.refit.as_ref().map(|r| r.mode.unwrap_or(self.config.refit_mode))
    }

    /// Copies the new weights in (the model keeps its old weights if they do not fit) and
    /// forgets the prefix cache.
    fn apply_refit(&mut self) {
        let Some(refit) = self.refit.take() else { return };
        let outcome = self.model.reload_weights(&refit.weights);
        let seconds = refit.requested.elapsed().as_secs_f64();
        match &outcome {
            Ok(()) => {
                self.blocks.clear_cache();
                for seq in &mut self.running {
                    seq.cacheable = false;
                }
                self.stats.weight_version.store(refit.version, Ordering::Relaxed);
                self.served.count(Count::Refits, 1);
                self.stats.last_refit_micros.store((seconds * 1e6) as u64, Ordering::Relaxed);
                tracing::info!(version = refit.version, seconds, "refit done");
            }
            Err(e) => tracing::error!(version = refit.version, "refit failed, serving the previous weights: {e}"),
        }
        let _ = refit.done.send(outcome.map(|()| seconds).map_err(crate::Error::from));
    }

    /// Sleeps or wakes (the running samples have finished). While asleep the prefix cache
    /// holds nothing: the pool it pointed into is gone.
    fn apply_memory(&mut self) {
        let Some(change) = self.memory.take() else { return };
        let outcome = match change.change {
            Memory::Sleep { offload_weights } => self.model.sleep(offload_weights).inspect(|_| {
                self.blocks.clear_cache();
                self.asleep = true;
                self.served.count(Count::Sleeps, 1);
            }),
            Memory::Wake => self.model.wake().inspect(|_| self.asleep = false),
        };
        self.stats.asleep.store(usize::from(self.asleep), Ordering::Relaxed);
        let seconds = change.requested.elapsed().as_secs_f64();
        match &outcome {
            Ok(bytes) => tracing::info!(change = ?change.change, seconds, bytes, "memory changed"),
            Err(e) => tracing::error!(change = ?change.change, "memory change failed: {e}"),
        }
        let _ = change.done.send(outcome.map(|bytes| (seconds, bytes)).map_err(crate::Error::from));
    }

    fn publish(&self) {
        let waiting = self.waiting.len();
        self.stats.waiting.store(waiting, Ordering::Relaxed);
        self.stats.running.store(self.running.len(), Ordering::Relaxed);
        self.stats.blocks_used.store(self.blocks.used(), Ordering::Relaxed);
        self.served.count_to(Count::PrefixQueries, self.blocks.stats.queried);
        self.served.count_to(Count::PrefixHits, self.blocks.stats.hits);
    }

    /// Makes room in `seq`'s blocks for its next `take` tokens: a shared block about to be
    /// written is copied first, new blocks are appended.
    fn reserve(&mut self, seq: usize, take: usize) -> Result<(), Shortage> {
        let s = &self.running[seq];
        let grow = blocks_for(s.computed + take).saturating_sub(s.blocks.len());
        let written = s.computed / BLOCK_SIZE;
        let copy = !s.computed.is_multiple_of(BLOCK_SIZE) && self.blocks.is_shared(s.blocks[written]);
        if self.blocks.available() < grow + usize::from(copy) {
            return Err(Shortage::NoBlocks);
        }
        if copy {
            let fresh = self.blocks.allocate().ok_or(Shortage::NoBlocks)?;
            let old = self.running[seq].blocks[written];
            if let Err(e) = self.model.copy_block(old as usize, fresh as usize) {
                self.blocks.release(fresh);
                return Err(Shortage::Failed(e));
            }
            self.blocks.release(old);
            self.running[seq].blocks[written] = fresh;
        }
        for _ in 0..grow {
            let block = self.blocks.allocate().ok_or(Shortage::NoBlocks)?;
            self.running[seq].blocks.push(block);
        }
        Ok(())
    }

    /// Lets the running sequence at `at` go: blocks freed, tokens kept, first in the queue.
    fn preempt(&mut self, at: usize) {
        let mut seq = self.running.remove(at);
        self.blocks.release_all(&mut seq.blocks);
        seq.computed = 0;
        seq.registered = 0;
        self.served.count(Count::Preemptions, 1);
        tracing::debug!(request = seq.request, sample = seq.index, tokens = seq.tokens.len(), "preempted");
        self.waiting.push_front(Waiting::Preempted(seq));
    }

    /// Sequences counted against `max_num_seqs`: every running sample, and the samples a
    /// running prompt will fork into.
    fn seats(&self) -> usize {
        self.running.iter().map(|s| s.forks).sum()
    }

    /// One scheduling decision and forward pass.
    fn step(&mut self) {
        let began = Instant::now();
        let mut budget = self.config.max_num_batched_tokens;
        let mut plan: Vec<usize> = Vec::new();
        let mut at = 0;
        while at < self.running.len() && budget > 0 {
            let s = &self.running[at];
            let take = (s.tokens.len() - s.computed).min(budget);
            match self.reserve(at, take) {
                Ok(()) => {
                    plan.push(take);
                    budget -= take;
                    at += 1;
                }
                Err(Shortage::NoBlocks) => self.preempt(self.running.len() - 1),
                Err(Shortage::Failed(e)) => {
                    tracing::error!("cannot copy a shared KV block: {e}");
                    let seq = self.running.remove(at);
                    self.fail(seq, &e.to_string());
                }
            }
        }
        self.admit(&mut budget, &mut plan);
        if plan.is_empty() {
            return;
        }
        let started = Instant::now();
        let chunks: Vec<SeqChunk> = self
            .running
            .iter()
            .zip(&plan)
            .map(|(s, &take)| SeqChunk {
                tokens: s.tokens[s.computed..s.computed + take].to_vec(),
                context: s.computed,
                blocks: s.blocks.clone(),
                logits: s.computed + take == s.tokens.len(),
            })
            .collect();
        let tokens: usize = plan.iter().sum();
        let scheduled = plan.len();
        let forward_at = Instant::now();
        let logits = self.model.forward(&chunks);
        if self.sync_phases
            && let Ok(Device::Cuda(index)) = logits.as_ref().map(Tensor::device)
        {
            tch::Cuda::synchronize(index as i64);
        }
        let draw_at = Instant::now();
        let outcome = logits.and_then(|logits| self.draw(&logits, &chunks));
        let advance_at = Instant::now();
        self.served.count(Count::Steps, 1);
        self.served.count(Count::StepTokens, tokens as u64);
        match outcome {
            Ok(drawn) => self.advance(&plan, drawn),
            Err(e) => {
                tracing::error!("step failed: {e}");
                let message = e.to_string();
                for seq in self.running.drain(..scheduled).collect::<Vec<_>>() {
                    self.fail(seq, &message);
                }
            }
        }
        self.stats.decode_micros.fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        let marks = [began, forward_at, draw_at, advance_at, Instant::now()];
        for (phase, pair) in StepPhase::ALL.iter().zip(marks.windows(2)) {
            self.stats.phase_micros[*phase as usize]
                .fetch_add((pair[1] - pair[0]).as_micros() as u64, Ordering::Relaxed);
        }
        self.served.step_time(started.elapsed().as_secs_f64());
    }

    /// Admits waiting work in order while the budget, the sequence limit and free blocks
    /// allow; each admitted sequence joins `running` (and `plan`) with its first chunk.
    fn admit(&mut self, budget: &mut usize, plan: &mut Vec<usize>) {
        while *budget > 0 {
            let Some(front) = self.waiting.front() else { break };
            let seq = match front {
                Waiting::New(submission) => {
                    if submission.events.is_closed() {
                        self.waiting.pop_front();
                        continue;
                    }
                    let draining = self.refit_mode() == Some(RefitMode::Drain);
                    if draining || self.memory.is_some() {
                        break;
                    }
                    if self.seats() + submission.request.n > self.config.max_num_seqs {
                        break;
                    }
                    let request = &submission.request;
                    let mut keys = Vec::new();
                    extend_keys(&mut keys, &request.prompt);
                    Sequence {
                        request: usize::MAX,
                        index: 0,
                        forks: request.n,
                        tokens: request.prompt.clone(),
                        prompt_len: request.prompt.len(),
                        computed: 0,
                        blocks: Vec::new(),
                        keys,
                        registered: 0,
                        cacheable: true,
                        text: Detokenizer::default(),
                        last_token: None,
                        guide: request.guide.clone(),
                    }
                }
                Waiting::Preempted(seq) => {
                    if self.requests[seq.request].as_ref().is_none_or(|r| r.events.is_closed()) {
                        let Some(Waiting::Preempted(seq)) = self.waiting.pop_front() else { break };
                        self.finish(seq, Finish::Abort, None);
                        continue;
                    }
                    if self.seats() + seq.forks > self.config.max_num_seqs {
                        break;
                    }
                    seq.clone()
                }
            };
            let Some(seq) = self.start_sequence(seq, *budget) else { break };
            let take = (seq.tokens.len() - seq.computed).min(*budget);
            *budget -= take;
            plan.push(take);
            match self.waiting.pop_front() {
                Some(Waiting::New(submission)) => {
                    let id = self.open_request(submission);
                    self.running.push(Sequence { request: id, ..seq });
                }
                _ => self.running.push(seq),
            }
        }
    }

    /// `seq` with its cached prefix and the blocks of its first chunk, or `None` (nothing
    /// taken) when the pool cannot hold that chunk now.
    fn start_sequence(&mut self, mut seq: Sequence, budget: usize) -> Option<Sequence> {
        extend_keys(&mut seq.keys, &seq.tokens);
        // At least one token is computed, for the logits of the next.
        let limit = (seq.tokens.len() - 1) / BLOCK_SIZE;
        seq.blocks = self.blocks.lookup(&seq.keys, &seq.tokens, limit);
        seq.computed = seq.blocks.len() * BLOCK_SIZE;
        seq.registered = seq.blocks.len();
        let take = (seq.tokens.len() - seq.computed).min(budget);
        let grow = blocks_for(seq.computed + take) - seq.blocks.len();
        if self.blocks.available() < grow {
            self.blocks.release_all(&mut seq.blocks);
            return None;
        }
        for _ in 0..grow {
            seq.blocks.push(self.blocks.allocate()?);
        }
        Some(seq)
    }

    fn open_request(&mut self, submission: Submission) -> usize {
        let Submission { request, events, arrived } = submission;
        let running = Running { live: request.n, request, events, arrived, first_token: None };
        match self.requests.iter().position(Option::is_none) {
            Some(id) => {
                self.requests[id] = Some(running);
                id
            }
            None => {
                self.requests.push(Some(running));
                self.requests.len() - 1
            }
        }
    }

    /// The draws of this step: one per sample of each chunk that ends at its sequence's
    /// last token (a finished prompt draws once for every sample it forks into).
    fn draw(&self, logits: &Tensor, chunks: &[SeqChunk]) -> keel_model::Result<Vec<Sampled>> {
        let mut rows = Vec::new();
        let mut draws = Vec::new();
        let mut row = 0i64;
        // Rows of `draws` under a constraint, and what each allows; biased logits.
        let mut guided = Vec::new();
        let mut biased: Vec<(i64, i64, f32)> = Vec::new();
        let mut allowed = Vec::new();
        for (seq, chunk) in self.running.iter().zip(chunks) {
            if !chunk.logits {
                continue;
            }
            let Some(running) = self.requests[seq.request].as_ref() else {
                return Err(keel_model::Error::InvalidInput("a running sequence lost its request".into()));
            };
            let request = &running.request;
            let generated = seq.tokens.len() - seq.prompt_len;
            let banned: &[i64] = if generated < request.min_tokens { &request.stop_token_ids } else { &[] };
            if let Some(guide) = &seq.guide {
                // A prompt's forks start in the same state: one mask serves them all.
                let bits =
                    guide.allowed().map_err(|e| keel_model::Error::InvalidInput(format!("structured output: {e}")))?;
                for fork in 0..seq.forks {
                    guided.push((draws.len() + fork) as i64);
                    allowed.push(bits.clone());
                }
            }
            for fork in 0..seq.forks {
                for &(token, bias) in &request.logit_bias {
                    biased.push(((draws.len() + fork) as i64, token, bias));
                }
            }
            for fork in 0..seq.forks {
                let index = seq.index + fork;
                rows.push(row);
                draws.push(Draw {
                    params: &request.sampling,
                    seed: request.sampling.seed.wrapping_add(index as u64),
                    step: generated as u64,
                    top_logprobs: request.top_logprobs,
                    banned,
                });
            }
            row += 1;
        }
        if draws.is_empty() {
            return Ok(Vec::new());
        }
        let mut logits = if rows.len() as i64 == row {
            logits.shallow_clone()
        } else {
            logits.f_index_select(0, &Tensor::from_slice(&rows).f_to_device(logits.device())?)?
        };
        if !biased.is_empty() {
            let device = logits.device();
            let rows = Tensor::from_slice(&biased.iter().map(|b| b.0).collect::<Vec<_>>()).f_to_device(device)?;
            let tokens = Tensor::from_slice(&biased.iter().map(|b| b.1).collect::<Vec<_>>()).f_to_device(device)?;
            let values = Tensor::from_slice(&biased.iter().map(|b| b.2).collect::<Vec<_>>())
                .f_to_kind(logits.kind())?
                .f_to_device(device)?;
            logits = logits.f_index_put(&[Some(rows), Some(tokens)], &values, true)?;
        }
        if !guided.is_empty() {
            // The constrained rows' disallowed tokens to -inf, in one operation on the device.
            let vocab = logits.size()[1];
            let mask = crate::guide::mask(&allowed, vocab as usize);
            let mask = Tensor::from_slice(&mask).f_view([guided.len() as i64, vocab])?.f_to_device(logits.device())?;
            let at = Tensor::from_slice(&guided).f_to_device(logits.device())?;
            let masked = logits.f_index_select(0, &at)?.f_masked_fill(&mask.f_logical_not()?, f64::NEG_INFINITY)?;
            logits = logits.f_index_copy(0, &at, &masked)?;
        }
        sample(&logits, &draws)
    }

    /// Moves the scheduled sequences past this step: computed tokens, cached blocks, forks,
    /// new tokens and finished samples.
    fn advance(&mut self, plan: &[usize], drawn: Vec<Sampled>) {
        let scheduled: Vec<Sequence> = self.running.drain(..plan.len()).collect();
        let mut kept = Vec::with_capacity(self.running.len() + scheduled.len());
        let mut drawn = drawn.into_iter();
        for (mut seq, &take) in scheduled.into_iter().zip(plan) {
            seq.computed += take;
            self.register(&mut seq);
            if seq.computed < seq.tokens.len() {
                kept.push(seq);
                continue;
            }
            let forks = std::mem::replace(&mut seq.forks, 1);
            let mut samples = Vec::with_capacity(forks);
            for fork in 1..forks {
                let mut twin = seq.clone();
                twin.index = seq.index + fork;
                for &block in &twin.blocks {
                    self.blocks.share(block);
                }
                samples.push(twin);
            }
            samples.insert(0, seq);
            for mut sample in samples {
                let Some(token) = drawn.next() else {
                    self.fail(sample, "the step drew fewer tokens than it has samples");
                    continue;
                };
                match self.take_token(&mut sample, token) {
                    None => kept.push(sample),
                    Some((reason, stop)) => self.finish(sample, reason, stop),
                }
            }
        }
        kept.append(&mut self.running);
        self.running = kept;
    }

    /// Enters `seq`'s newly full blocks in the prefix cache.
    fn register(&mut self, seq: &mut Sequence) {
        if !seq.cacheable {
            return;
        }
        extend_keys(&mut seq.keys, &seq.tokens[..seq.computed]);
        let full = seq.computed / BLOCK_SIZE;
        for block in seq.registered..full {
            let tokens = &seq.tokens[block * BLOCK_SIZE..(block + 1) * BLOCK_SIZE];
            self.blocks.register(seq.blocks[block], seq.keys[block], tokens);
        }
        seq.registered = seq.registered.max(full);
    }

    /// Appends `token` to `sample`, reports it, and says whether (and why) the sample ends.
    fn take_token(&mut self, sample: &mut Sequence, token: Sampled) -> Option<(Finish, Option<String>)> {
        let Some(running) = self.requests[sample.request].as_mut() else { return Some((Finish::Abort, None)) };
        if running.first_token.is_none() {
            running.first_token = Some(Instant::now());
            self.served.count(Count::PromptTokens, sample.prompt_len as u64);
            self.served.first_token(running.arrived);
        }
        if let Some(previous) = sample.last_token.replace(Instant::now()) {
            self.served.next_token(previous);
        }
        let request = &running.request;
        if let Some(guide) = &sample.guide
            && let Err(e) = guide.consume(token.token)
        {
            tracing::warn!(request = sample.request, "structured output ended the sample: {e}");
            return Some((Finish::Stop, None));
        }
        sample.tokens.push(token.token);
        self.served.count(Count::GeneratedTokens, 1);
        let out = TokenOut { index: sample.index, token: token.token, logprob: token.logprob, top: token.top };
        if running.events.send(Event::Token(out)).is_err() {
            return Some((Finish::Abort, None));
        }
        let generated = sample.generated().len();
        if generated >= request.min_tokens {
            if request.stop_token_ids.contains(&token.token) {
                return Some((Finish::Stop, None));
            }
            if !request.stop.is_empty()
                && let Some(tokenizer) = &self.tokenizer
            {
                let added = sample.text.update(tokenizer, &sample.tokens[sample.prompt_len..]);
                let text = sample.text.text();
                let longest = request.stop.iter().map(String::len).max().unwrap_or(0);
                let mut from = text.len().saturating_sub(added + longest);
                while !text.is_char_boundary(from) {
                    from -= 1;
                }
                if let Some((_, stop)) = first_stop(&text[from..], &request.stop) {
                    return Some((Finish::Stop, Some(stop.to_string())));
                }
            }
        }
        if generated >= request.max_tokens || sample.tokens.len() >= self.config.max_model_len {
            return Some((Finish::Length, None));
        }
        None
    }

    /// Ends `sample`: its blocks are let go and its request hears why.
    fn finish(&mut self, mut sample: Sequence, reason: Finish, stop: Option<String>) {
        self.blocks.release_all(&mut sample.blocks);
        // The gauges change before the request hears, so a caller that saw it finish sees them.
        self.stats.blocks_used.store(self.blocks.used(), Ordering::Relaxed);
        let Some(running) = self.requests.get_mut(sample.request).and_then(Option::as_mut) else { return };
        let version = self.stats.weight_version.load(Ordering::Relaxed);
        running.live = running.live.saturating_sub(sample.forks);
        let done = running.live == 0;
        if let Some(first) = running.first_token {
            self.served.sample_done(first, sample.generated().len());
        }
        if done {
            self.stats.requests_finished.fetch_add(1, Ordering::Relaxed);
            self.served.request_done(running.arrived, reason);
        }
        for index in sample.index..sample.index + sample.forks {
            let _ = running.events.send(Event::Finished { index, reason, stop: stop.clone(), version });
        }
        if done {
            self.requests[sample.request] = None;
        }
    }

    /// Ends `sample` and fails its request with `message`.
    fn fail(&mut self, sample: Sequence, message: &str) {
        if let Some(running) = self.requests.get(sample.request).and_then(Option::as_ref) {
            let _ = running.events.send(Event::Failed(message.to_string()));
        }
        self.finish(sample, Finish::Abort, None);
    }
}
