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

use std::time::Instant;

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

/// The engine's counters with their HELP lines.
const COUNTERS: [(&str, &str); 9] = [
    (PREEMPTIONS, "Sequences preempted for lack of KV blocks (recomputed later)."),
    (PREFIX_QUERIES, "Full prompt blocks looked up in the prefix cache."),
    (PREFIX_HITS, "Full prompt blocks found in the prefix cache."),
    (STEPS, "Forward passes (engine steps)."),
    (STEP_TOKENS, "Tokens computed by all steps (decodes and prompt chunks)."),
    (GENERATED_TOKENS, "Tokens generated."),
    (PROMPT_TOKENS, "Prompt tokens prefilled."),
    (REFITS, "Weight refits done."),
    (SLEEPS, "Sleeps of a colocated generator."),
];

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
    for (name, help) in COUNTERS {
        metrics::describe_counter!(name, help);
    }
    metrics::describe_gauge!(STEP_SECONDS, "Time spent in engine steps (only grows).");
}

/// The engine's recorder, for one served model.
#[derive(Debug, Clone)]
pub(crate) struct Served {
    model_name: metrics::SharedString,
}

impl Served {
    /// Every counter of the model appears from the start, at 0 where nothing happened yet.
    pub(crate) fn new(model_name: &str) -> Self {
        let served = Self { model_name: model_name.to_string().into() };
        for (name, _) in COUNTERS {
            served.count(name, 0);
        }
        for reason in [Finish::Stop, Finish::Length, Finish::Abort] {
            served.finished(reason).increment(0);
        }
        served
    }

    /// Adds `n` to counter `name`.
    pub(crate) fn count(&self, name: &'static str, n: u64) {
        metrics::counter!(name, "model_name" => self.model_name.clone()).increment(n);
    }

    /// A step took `seconds`.
    pub(crate) fn step_time(&self, seconds: f64) {
        metrics::gauge!(STEP_SECONDS, "model_name" => self.model_name.clone()).increment(seconds);
    }

    /// A request's first token came out.
    pub(crate) fn first_token(&self, arrived: Instant) {
        metrics::histogram!(TIME_TO_FIRST_TOKEN, "model_name" => self.model_name.clone())
            .record(arrived.elapsed().as_secs_f64());
    }

    /// A sample's token came out; `previous` was when its last one did.
    pub(crate) fn next_token(&self, previous: Instant) {
        metrics::histogram!(INTER_TOKEN_LATENCY, "model_name" => self.model_name.clone())
            .record(previous.elapsed().as_secs_f64());
    }

    /// A sample ended with `generated` tokens, its first at `first`.
    pub(crate) fn sample_done(&self, first: Instant, generated: usize) {
        if generated > 1 {
            let per_token = first.elapsed().as_secs_f64() / (generated - 1) as f64;
            metrics::histogram!(TIME_PER_OUTPUT_TOKEN, "model_name" => self.model_name.clone()).record(per_token);
        }
    }

    /// A request's last sample ended, for `reason`.
    pub(crate) fn request_done(&self, arrived: Instant, reason: Finish) {
        metrics::histogram!(E2E_REQUEST_LATENCY, "model_name" => self.model_name.clone())
            .record(arrived.elapsed().as_secs_f64());
        self.finished(reason).increment(1);
    }

    fn finished(&self, reason: Finish) -> metrics::Counter {
        metrics::counter!(REQUESTS_FINISHED, "model_name" => self.model_name.clone(), "finished_reason" => reason.as_str())
    }
}
