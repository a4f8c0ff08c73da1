//! What the engine measures, recorded through the `metrics` facade where it happens (the
//! generator's `/metrics`): its counters (steps, tokens, preemptions, prefix-cache lookups,
//! refits, sleeps, time in steps), time to first token, time per output token, the latency
//! between tokens, each request's end-to-end latency, and finished requests by reason; each
//! labelled with the served model's name (`model_name`), as vLLM labels them. Counters count
//! for the process's life: a model loaded again goes on from where its last engine stopped.
//!
//! Levels (queue depth, blocks in use, the weight version) are [`crate::engine::Stats`], which
//! the generator sets on the recorder when it is scraped. Nothing is recorded before a
//! recorder is installed (the generator installs one before its engine starts); without one
//! the calls do nothing.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::engine::Stats;
use crate::request::Finish;

pub const TIME_TO_FIRST_TOKEN: &str = "keel_generator_time_to_first_token_seconds";
pub const TIME_PER_OUTPUT_TOKEN: &str = "keel_generator_time_per_output_token_seconds";
pub const INTER_TOKEN_LATENCY: &str = "keel_generator_inter_token_latency_seconds";
pub const E2E_REQUEST_LATENCY: &str = "keel_generator_e2e_request_latency_seconds";
pub const REQUESTS_FINISHED: &str = "keel_generator_requests_finished_total";
pub const PREEMPTIONS: &str = "keel_generator_preemptions_total";
pub const PREFIX_QUERIES: &str = "keel_generator_prefix_cache_queries_total";
pub const PREFIX_HITS: &str = "keel_generator_prefix_cache_hits_total";
pub const STEPS: &str = "keel_generator_steps_total";
pub const STEP_TOKENS: &str = "keel_generator_step_tokens_total";
pub const GENERATED_TOKENS: &str = "keel_generator_generated_tokens_total";
pub const PROMPT_TOKENS: &str = "keel_generator_prompt_tokens_total";
pub const REFITS: &str = "keel_generator_refits_total";
pub const SLEEPS: &str = "keel_generator_sleeps_total";
/// A sum of seconds: a gauge that only grows (the exporter's counters count whole numbers).
pub const STEP_SECONDS: &str = "keel_generator_decode_seconds_total";

/// A count the engine keeps: in its [`Stats`] (which its callers and tests read) and as a
/// Prometheus counter of the same meaning.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Count {
    Preemptions,
    PrefixQueries,
    PrefixHits,
    Steps,
    StepTokens,
    GeneratedTokens,
    PromptTokens,
    Refits,
    Sleeps,
}

impl Count {
    const ALL: [Count; 9] = [
        Self::Preemptions,
        Self::PrefixQueries,
        Self::PrefixHits,
        Self::Steps,
        Self::StepTokens,
        Self::GeneratedTokens,
        Self::PromptTokens,
        Self::Refits,
        Self::Sleeps,
    ];

    /// The counter's name and HELP line.
    fn described(self) -> (&'static str, &'static str) {
        match self {
            Self::Preemptions => (PREEMPTIONS, "Sequences preempted for lack of KV blocks (recomputed later)."),
            Self::PrefixQueries => (PREFIX_QUERIES, "Full prompt blocks looked up in the prefix cache."),
            Self::PrefixHits => (PREFIX_HITS, "Full prompt blocks found in the prefix cache."),
            Self::Steps => (STEPS, "Forward passes (engine steps)."),
            Self::StepTokens => (STEP_TOKENS, "Tokens computed by all steps (decodes and prompt chunks)."),
            Self::GeneratedTokens => (GENERATED_TOKENS, "Tokens generated."),
            Self::PromptTokens => (PROMPT_TOKENS, "Prompt tokens prefilled."),
            Self::Refits => (REFITS, "Weight refits done."),
            Self::Sleeps => (SLEEPS, "Sleeps of a colocated generator."),
        }
    }

    fn of(self, stats: &Stats) -> &AtomicU64 {
        match self {
            Self::Preemptions => &stats.preemptions,
            Self::PrefixQueries => &stats.prefix_queried,
            Self::PrefixHits => &stats.prefix_hits,
            Self::Steps => &stats.steps,
            Self::StepTokens => &stats.step_tokens,
            Self::GeneratedTokens => &stats.generated_tokens,
            Self::PromptTokens => &stats.prompt_tokens,
            Self::Refits => &stats.refits,
            Self::Sleeps => &stats.sleeps,
        }
    }
}

/// The HELP lines of the metrics above (the generator describes them at start-up).
pub fn describe() {
    metrics::describe_histogram!(TIME_TO_FIRST_TOKEN, "Time from a request's arrival to its first token.");
    metrics::describe_histogram!(
        TIME_PER_OUTPUT_TOKEN,
        "A sample's time per token after its first: (end - first token) / (tokens - 1)."
    );
    metrics::describe_histogram!(INTER_TOKEN_LATENCY, "Time between two consecutive tokens of a sample.");
    metrics::describe_histogram!(E2E_REQUEST_LATENCY, "Time from a request's arrival to its last sample's end.");
    metrics::describe_counter!(
        REQUESTS_FINISHED,
        "Requests finished, by the reason their last sample ended (stop, length or abort)."
    );
    for count in Count::ALL {
        let (name, help) = count.described();
        metrics::describe_counter!(name, help);
    }
    metrics::describe_gauge!(STEP_SECONDS, "Time spent in engine steps (only grows).");
}

/// The engine's recorder, for one served model: its [`Stats`] and the handles of its metrics,
/// made once (labelled with the model's name), so that recording a token is an atomic add,
/// not a registry lookup.
#[derive(Debug)]
pub(crate) struct Served {
    stats: Arc<Stats>,
    counters: [metrics::Counter; Count::ALL.len()],
    finished: [metrics::Counter; 3],
    step_seconds: metrics::Gauge,
    first_token: metrics::Histogram,
    per_token: metrics::Histogram,
    between_tokens: metrics::Histogram,
    end_to_end: metrics::Histogram,
}

impl Served {
    /// Every counter of the model appears from the start, at 0 where nothing happened yet.
    pub(crate) fn new(model_name: &str, stats: Arc<Stats>) -> Self {
        let model: metrics::SharedString = model_name.to_string().into();
        let label = || model.clone();
        let finished = [Finish::Stop, Finish::Length, Finish::Abort]
            .map(|reason| metrics::counter!(REQUESTS_FINISHED, "model_name" => label(), "finished_reason" => reason.as_str()));
        let served = Self {
            stats,
            counters: Count::ALL.map(|count| metrics::counter!(count.described().0, "model_name" => label())),
            finished,
            step_seconds: metrics::gauge!(STEP_SECONDS, "model_name" => label()),
            first_token: metrics::histogram!(TIME_TO_FIRST_TOKEN, "model_name" => label()),
            per_token: metrics::histogram!(TIME_PER_OUTPUT_TOKEN, "model_name" => label()),
            between_tokens: metrics::histogram!(INTER_TOKEN_LATENCY, "model_name" => label()),
            end_to_end: metrics::histogram!(E2E_REQUEST_LATENCY, "model_name" => label()),
        };
        for counter in served.counters.iter().chain(&served.finished) {
            counter.increment(0);
        }
        served
    }

    /// Adds `n` to `count`.
    pub(crate) fn count(&self, count: Count, n: u64) {
        count.of(&self.stats).fetch_add(n, Ordering::Relaxed);
        self.counters[count as usize].increment(n);
    }

    /// Sets `count` to the engine's running `total` (the block manager's prefix-cache counts).
    pub(crate) fn count_to(&self, count: Count, total: u64) {
        let before = count.of(&self.stats).swap(total, Ordering::Relaxed);
        self.counters[count as usize].increment(total.saturating_sub(before));
    }

    /// A step took `seconds`.
    pub(crate) fn step_time(&self, seconds: f64) {
        self.step_seconds.increment(seconds);
    }

    /// A request's first token came out.
    pub(crate) fn first_token(&self, arrived: Instant) {
        self.first_token.record(arrived.elapsed().as_secs_f64());
    }

    /// A sample's token came out; `previous` was when its last one did.
    pub(crate) fn next_token(&self, previous: Instant) {
        self.between_tokens.record(previous.elapsed().as_secs_f64());
    }

    /// A sample ended with `generated` tokens, its first at `first`.
    pub(crate) fn sample_done(&self, first: Instant, generated: usize) {
        if generated > 1 {
            self.per_token.record(first.elapsed().as_secs_f64() / (generated - 1) as f64);
        }
    }

    /// A request's last sample ended, for `reason`.
    pub(crate) fn request_done(&self, arrived: Instant, reason: Finish) {
        self.end_to_end.record(arrived.elapsed().as_secs_f64());
        self.finished[reason as usize].increment(1);
    }
}
