//! The scheduler: one thread owns the model and a [`SlotCache`] of `slots` sequences of up to
//! `max_model_len` tokens (preallocated, so memory use is fixed at start-up and admission can
//! never run it out). Requests queue in arrival order; a request is admitted when `n` slots
//! are free, prefilled once, and its prefill copied to the other n − 1 slots. Every step
//! decodes one token for every running sample together (rows of different lengths, each
//! masked to its own tokens); samples leave at token boundaries when they stop, and waiting
//! requests join at the next step. Each sample has its own seeded sampler, so its output does
//! not depend on what else is in the batch.
//!
//! Refit: new weights are copied into the model at a token boundary. In `drain` mode no new
//! request is admitted until the running ones finish, so every sample comes from one weight
//! version; in `pause` mode the running samples pause for the copy and continue on the new
//! weights. Every finished sample reports the version it ended on.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use keel_model::sampling::{Sampler, SamplingParams};
use keel_model::{CausalLm, Tokenizer};
use tch::Tensor;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use crate::backend::Backend;
use crate::request::{Event, Finish, GenRequest, TokenOut};
use crate::text::Detokenizer;

/// Counters the metrics endpoint reads.
#[derive(Debug, Default)]
pub struct Stats {
    pub waiting: AtomicUsize,
    pub running: AtomicUsize,
    pub slots_used: AtomicUsize,
    pub generated_tokens: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub requests_finished: AtomicU64,
    /// Sum of time-to-first-token, microseconds, and how many requests it covers.
    pub ttft_micros: AtomicU64,
    pub ttft_count: AtomicU64,
    /// Time spent in decode steps, microseconds.
    pub decode_micros: AtomicU64,
    /// The weight version being served.
    pub weight_version: AtomicU64,
    pub refits: AtomicU64,
    /// How long the last refit took (waiting for the drain included), microseconds.
    pub last_refit_micros: AtomicU64,
}

/// How a refit treats running samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefitMode {
    /// Admit nothing new until the running samples finish, then swap the weights.
    #[default]
    Drain,
    /// Swap at the next token boundary; running samples continue on the new weights.
    Pause,
}

struct Refit {
    dir: PathBuf,
    version: u64,
    requested: Instant,
    done: oneshot::Sender<Result<f64, String>>,
}

enum Command {
    Generate(Submission),
    Refit(Refit),
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
    pub slots: usize,
    pub max_model_len: i64,
}

/// Row-wise log-softmax of `logits` [B, vocab] after dividing row b by `divisors[b]`, as one
/// flat vector on the CPU (one pass for the whole batch).
fn row_logprobs(logits: &Tensor, divisors: &[f32]) -> keel_model::Result<Vec<f32>> {
    let divisors = Tensor::from_slice(divisors).f_unsqueeze(1)?;
    let scaled = logits.f_to_kind(tch::Kind::Float)?.f_to_device(tch::Device::Cpu)?.f_div(&divisors)?;
    Ok(Vec::<f32>::try_from(scaled.f_log_softmax(-1, tch::Kind::Float)?.f_flatten(0, -1)?)?)
}

/// One running sample.
struct Sample {
    request: usize,
    index: usize,
    slot: usize,
    sampler: Sampler,
    generated: Vec<i64>,
    /// The generated text, kept only when the request has stop strings.
    text: Detokenizer,
    /// The last sampled token, fed at the next step.
    pending: i64,
}

struct Running {
    request: GenRequest,
    events: UnboundedSender<Event>,
    live: usize,
}

struct Scheduler {
    /// The model (or tensor-parallel ranks) and the slot cache.
    model: Backend,
    tokenizer: Option<Arc<Tokenizer>>,
    free: Vec<usize>,
    waiting: VecDeque<Submission>,
    requests: Vec<Option<Running>>,
    samples: Vec<Sample>,
    stats: Arc<Stats>,
    refit_mode: RefitMode,
    refit: Option<Refit>,
}

impl Engine {
    /// Starts the scheduler thread over `model` with `slots` sequences of `max_model_len` tokens.
    pub fn start(
        model: CausalLm,
        tokenizer: Option<Arc<Tokenizer>>,
        slots: usize,
        max_model_len: i64,
        refit_mode: RefitMode,
    ) -> keel_model::Result<Self> {
        Self::start_backend(Backend::whole(model, slots, max_model_len)?, tokenizer, refit_mode)
    }

    /// Starts the scheduler thread over `backend` (a model or tensor-parallel ranks, with
    /// their slot caches).
    pub fn start_backend(
        backend: Backend,
        tokenizer: Option<Arc<Tokenizer>>,
        refit_mode: RefitMode,
    ) -> keel_model::Result<Self> {
        let (slots, max_model_len) = (backend.slots(), backend.capacity());
        let stats = Arc::new(Stats::default());
        let (submit, intake) = mpsc::channel::<Command>();
        let mut scheduler = Scheduler {
            model: backend,
            tokenizer,
            free: (0..slots).rev().collect(),
            waiting: VecDeque::new(),
            requests: Vec::new(),
            samples: Vec::new(),
            stats: stats.clone(),
            refit_mode,
            refit: None,
        };
        std::thread::Builder::new()
            .name("keel-generator-scheduler".into())
            .spawn(move || scheduler.run(intake))
            .map_err(|e| keel_model::Error::InvalidInput(format!("cannot start the scheduler thread: {e}")))?;
        Ok(Self { submit, stats, slots, max_model_len })
    }

    /// Queues `request`; its events arrive on `events`.
    pub fn submit(&self, request: GenRequest, events: UnboundedSender<Event>) -> Result<(), String> {
        self.stats.waiting.fetch_add(1, Ordering::Relaxed);
        self.submit
            .send(Command::Generate(Submission { request, events, arrived: Instant::now() }))
            .map_err(|_| "the scheduler has stopped".to_string())
    }

    /// The weight version being served.
    pub fn weight_version(&self) -> u64 {
        self.stats.weight_version.load(Ordering::Relaxed)
    }

    /// Loads the weights in `dir` as `version`; returns the seconds it took.
    pub async fn refit(&self, dir: PathBuf, version: u64) -> Result<f64, String> {
        let (done, result) = oneshot::channel();
        let refit = Refit { dir, version, requested: Instant::now(), done };
        self.submit.send(Command::Refit(refit)).map_err(|_| "the scheduler has stopped".to_string())?;
        result.await.map_err(|_| "the scheduler dropped the refit".to_string())?
    }
}

impl Scheduler {
    fn run(&mut self, intake: mpsc::Receiver<Command>) {
        loop {
            if self.samples.is_empty() && self.waiting.is_empty() && self.refit.is_none() {
                match intake.recv() {
                    Ok(command) => self.take(command),
                    Err(_) => return,
                }
            }
            while let Ok(command) = intake.try_recv() {
                self.take(command);
            }
            if self.refit.is_some() && (self.refit_mode == RefitMode::Pause || self.samples.is_empty()) {
                self.apply_refit();
            }
            if self.refit.is_none() {
                self.admit();
            }
            if !self.samples.is_empty() {
                self.step();
            }
        }
    }

    fn take(&mut self, command: Command) {
        match command {
            Command::Generate(submission) => self.waiting.push_back(submission),
            Command::Refit(refit) => {
                if let Some(previous) = self.refit.replace(refit) {
                    let _ = previous.done.send(Err(format!(
                        "superseded by a newer refit before version {} was loaded",
                        previous.version
                    )));
                }
            }
        }
    }

    /// Copies the new weights in (the model keeps its old weights if they do not fit).
    fn apply_refit(&mut self) {
        let Some(refit) = self.refit.take() else { return };
        let outcome = self.model.reload_weights(&refit.dir).map_err(|e| e.to_string());
        let seconds = refit.requested.elapsed().as_secs_f64();
        match &outcome {
            Ok(()) => {
                self.stats.weight_version.store(refit.version, Ordering::Relaxed);
                self.stats.refits.fetch_add(1, Ordering::Relaxed);
                self.stats.last_refit_micros.store((seconds * 1e6) as u64, Ordering::Relaxed);
                tracing::info!(version = refit.version, seconds, "refit done");
            }
            Err(e) => tracing::error!(version = refit.version, "refit failed, serving the previous weights: {e}"),
        }
        let _ = refit.done.send(outcome.map(|()| seconds));
    }

    /// Admits waiting requests in arrival order while their samples fit in free slots.
    fn admit(&mut self) {
        while let Some(front) = self.waiting.front() {
            if front.events.is_closed() {
                self.waiting.pop_front();
                self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
                continue;
            }
            if front.request.n > self.free.len() {
                break;
            }
            let Some(submission) = self.waiting.pop_front() else { break };
            self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            if let Err(e) = self.prefill(submission) {
                tracing::warn!("prefill failed: {e}");
            }
        }
    }

    fn prefill(&mut self, submission: Submission) -> keel_model::Result<()> {
        let Submission { request, events, arrived } = submission;
        let slots: Vec<usize> = (0..request.n).filter_map(|_| self.free.pop()).collect();
        let prompt = Tensor::from_slice(&request.prompt).f_unsqueeze(0)?;
        let logits = match self.model.forward(&prompt, &slots[..1]) {
            Ok(logits) => logits,
            Err(e) => {
                for &slot in &slots {
                    let _ = self.model.reset(slot);
                    self.free.push(slot);
                }
                let _ = events.send(Event::Failed(e.to_string()));
                return Err(e);
            }
        };
        let divisor = Sampler::new(request.sampling.clone())?.logit_divisor() as f32;
        let last = row_logprobs(&logits.f_select(1, -1)?, &[divisor])?;
        self.stats.prompt_tokens.fetch_add(request.prompt.len() as u64, Ordering::Relaxed);
        self.stats.ttft_micros.fetch_add(arrived.elapsed().as_micros() as u64, Ordering::Relaxed);
        self.stats.ttft_count.fetch_add(1, Ordering::Relaxed);
        let id = self.requests.iter().position(Option::is_none).unwrap_or(self.requests.len());
        let running = Running { request: request.clone(), events, live: request.n };
        if id == self.requests.len() {
            self.requests.push(Some(running));
        } else {
            self.requests[id] = Some(running);
        }
        for (index, &slot) in slots.iter().enumerate() {
            if index > 0 {
                self.model.copy_slot(slots[0], slot)?;
            }
            let params =
                SamplingParams { seed: request.sampling.seed.wrapping_add(index as u64), ..request.sampling.clone() };
            let sampler = Sampler::new(params)?;
            let mut sample = Sample {
                request: id,
                index,
                slot,
                sampler,
                generated: Vec::new(),
                text: Detokenizer::default(),
                pending: 0,
            };
            let outcome = self.take_token(&mut sample, &last)?;
            self.place(sample, outcome);
        }
        self.stats.running.store(self.samples.len(), Ordering::Relaxed);
        self.stats.slots_used.store(self.model.slots() - self.free.len(), Ordering::Relaxed);
        Ok(())
    }

    /// Samples the next token of `sample` from its row's `logprobs`, reports it, and says
    /// whether (and why) the sample ends.
    fn take_token(
        &self,
        sample: &mut Sample,
        logprobs: &[f32],
    ) -> keel_model::Result<Option<(Finish, Option<String>)>> {
        let Some(running) = self.requests[sample.request].as_ref() else { return Ok(Some((Finish::Abort, None))) };
        let request = &running.request;
        let (token, logprob, top) = sample.sampler.sample_logprobs(logprobs, request.top_logprobs)?;
        sample.generated.push(token);
        sample.pending = token;
        self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
        let sent = running.events.send(Event::Token(TokenOut { index: sample.index, token, logprob, top }));
        if sent.is_err() {
            return Ok(Some((Finish::Abort, None)));
        }
        if request.stop_token_ids.contains(&token) {
            return Ok(Some((Finish::Stop, None)));
        }
        if let Some(stop) = self.stop_string(request, sample) {
            return Ok(Some((Finish::Stop, Some(stop))));
        }
        if sample.generated.len() >= request.max_tokens || self.model.len(sample.slot) + 1 > self.model.capacity() {
            return Ok(Some((Finish::Length, None)));
        }
        Ok(None)
    }

    /// A stop string that the sample's newest text completes. Only the new text and the
    /// stop strings' length before it are searched: earlier text was searched already.
    fn stop_string(&self, request: &GenRequest, sample: &mut Sample) -> Option<String> {
        if request.stop.is_empty() {
            return None;
        }
        let added = sample.text.update(self.tokenizer.as_ref()?, &sample.generated);
        let text = sample.text.text();
        let longest = request.stop.iter().map(String::len).max().unwrap_or(0);
        let mut from = text.len().saturating_sub(added + longest);
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        request.stop.iter().find(|s| text[from..].contains(s.as_str())).cloned()
    }

    /// Keeps a sample running, or ends it and frees its slot.
    fn place(&mut self, sample: Sample, outcome: Option<(Finish, Option<String>)>) {
        match outcome {
            None => self.samples.push(sample),
            Some((reason, stop)) => self.finish(sample, reason, stop),
        }
    }

    fn finish(&mut self, sample: Sample, reason: Finish, stop: Option<String>) {
        if let Err(e) = self.model.reset(sample.slot) {
            tracing::error!(slot = sample.slot, "cannot empty the slot: {e}");
        }
        self.free.push(sample.slot);
        if let Some(running) = self.requests[sample.request].as_mut() {
            let version = self.stats.weight_version.load(Ordering::Relaxed);
            let _ = running.events.send(Event::Finished { index: sample.index, reason, stop, version });
            running.live -= 1;
            if running.live == 0 {
                self.requests[sample.request] = None;
                self.stats.requests_finished.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// One decode step for every running sample.
    fn step(&mut self) {
        let started = Instant::now();
        let mut samples = std::mem::take(&mut self.samples);
        // Ascending slots: a run of consecutive slots is read from the cache without a copy.
        samples.sort_by_key(|s| s.slot);
        let slots: Vec<usize> = samples.iter().map(|s| s.slot).collect();
        let tokens: Vec<i64> = samples.iter().map(|s| s.pending).collect();
        let divisors: Vec<f32> = samples.iter().map(|s| s.sampler.logit_divisor() as f32).collect();
        let logprobs = Tensor::from_slice(&tokens)
            .f_unsqueeze(1)
            .map_err(keel_model::Error::from)
            .and_then(|input| self.model.forward(&input, &slots))
            .and_then(|logits| row_logprobs(&logits.f_select(1, 0)?, &divisors));
        match logprobs {
            Ok(logprobs) => {
                let vocab = logprobs.len() / samples.len().max(1);
                for (row, mut sample) in samples.into_iter().enumerate() {
                    match self.take_token(&mut sample, &logprobs[row * vocab..(row + 1) * vocab]) {
                        Ok(outcome) => self.place(sample, outcome),
                        Err(e) => {
                            if let Some(running) = self.requests[sample.request].as_ref() {
                                let _ = running.events.send(Event::Failed(e.to_string()));
                            }
                            self.finish(sample, Finish::Abort, None);
                        }
                    }
                }
            }
            Err(e) => {
                tracing::error!("decode step failed: {e}");
                for sample in samples {
                    if let Some(running) = self.requests[sample.request].as_ref() {
                        let _ = running.events.send(Event::Failed(e.to_string()));
                    }
                    self.finish(sample, Finish::Abort, None);
                }
            }
        }
        self.stats.decode_micros.fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        self.stats.running.store(self.samples.len(), Ordering::Relaxed);
        self.stats.slots_used.store(self.model.slots() - self.free.len(), Ordering::Relaxed);
    }
}
