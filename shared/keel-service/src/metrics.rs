//! Every service's `GET /metrics`, through the `metrics` facade and its Prometheus exporter
//! (`metrics-exporter-prometheus`, text format 0.0.4), as TGI does.
//!
//! One recorder per process ([`install`], done by the first use): events are recorded where
//! they happen with the `metrics` macros (`histogram!`, `counter!`, `gauge!`), and what a
//! service keeps as state of its own (queue depths, counts in its actor, rows in PostgreSQL)
//! is set on the recorder when it is scraped, just before [`render`]. Histograms of seconds
//! share one set of buckets ([`BUCKETS`]); a thread drains and compacts them every few seconds,
//! so a process nobody scrapes does not hold its observations.
//!
//! What every service measures the same way — requests handled over HTTP and NATS, with their
//! latencies — goes through [`observe`].

use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// The `Content-Type` of the text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4";

/// Upper bounds (seconds) of every histogram's buckets.
pub const BUCKETS: [f64; 14] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// How often the recorder's histograms are drained into their buckets between scrapes.
const UPKEEP: Duration = Duration::from_secs(5);

/// The process's recorder, installed as the `metrics` facade's global recorder on first use.
/// Call it before describing metrics (`metrics::describe_gauge!`, ...): a description made
/// before any recorder is installed is lost.
/// Where another recorder was installed first (a test harness, an embedding program), every
/// call of the facade goes to that one and `/metrics` stays empty; a warning says so.
pub fn install() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let builder = PrometheusBuilder::new().set_buckets(&BUCKETS).expect("the bucket list is not empty");
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        if let Err(e) = metrics::set_global_recorder(recorder) {
            tracing::warn!(error = %e, "a metrics recorder was installed before Keel's: it gets every metric and /metrics stays empty");
        }
        let upkeep = handle.clone();
        let spawned = std::thread::Builder::new().name("keel-metrics-upkeep".into()).spawn(move || loop {
            std::thread::sleep(UPKEEP);
            upkeep.run_upkeep();
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no metrics upkeep thread: histograms are drained only when scraped");
        }
        describe_shared();
        handle
    })
}

/// The HELP lines of the metrics [`observe`] records in every service.
fn describe_shared() {
    metrics::describe_histogram!(HTTP_REQUESTS, "HTTP requests served, by route and status, and their latency.");
    metrics::describe_histogram!(NATS_REQUESTS, "NATS requests served, by operation and outcome, and their latency.");
}

/// Every HTTP request a service serves (its `_count` is the request counter).
pub const HTTP_REQUESTS: &str = "keel_http_request_duration_seconds";
/// Every NATS request a service serves.
pub const NATS_REQUESTS: &str = "keel_nats_request_duration_seconds";

/// Records one observation of `seconds` in histogram `name` under `labels` (in that order
/// on the exposition line).
pub fn observe(name: &'static str, labels: &[(&'static str, &str)], seconds: f64) {
    install();
    metrics::histogram!(name, owned(labels)).record(seconds);
}

/// Sets gauge `name` (with `labels`) to `value`; for what a service holds as state and sets
/// at scrape time.
pub fn set_gauge(name: &'static str, labels: &[(&'static str, &str)], value: f64) {
    install();
    metrics::gauge!(name, owned(labels)).set(value);
}

/// Sets counter `name` (with `labels`) to the count a service keeps itself (a counter never
/// goes down: a lower value leaves it where it is).
pub fn set_counter(name: &'static str, labels: &[(&'static str, &str)], value: u64) {
    install();
    metrics::counter!(name, owned(labels)).absolute(value);
}

fn owned(labels: &[(&'static str, &str)]) -> Vec<metrics::Label> {
    labels.iter().map(|(k, v)| metrics::Label::new(*k, (*v).to_string())).collect()
}

/// Everything recorded in this process, in the text format.
pub fn render() -> String {
    install().render()
}

/// Everything recorded in this process as a `GET /metrics` response.
pub fn response() -> axum::response::Response {
    use axum::response::IntoResponse;
    ([(axum::http::header::CONTENT_TYPE, CONTENT_TYPE)], render()).into_response()
}

/// `GET /metrics` for a service that sets nothing at scrape time.
pub async fn handler() -> axum::response::Response {
    response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_counters_and_gauges_render_as_prometheus_text() {
        // Descriptions go to the recorder installed when they are made.
        install();
        metrics::describe_histogram!("keel_test_seconds", "Test latencies.");
        observe("keel_test_seconds", &[("op", "a")], 0.003);
        observe("keel_test_seconds", &[("op", "a")], 2.0);
        set_counter("keel_test_total", &[], 3);
        set_counter("keel_test_total", &[], 2);
        set_gauge("keel_test_ratio", &[("env", "ma\"th")], 0.5);
        let out = render();
        for line in [
            "# HELP keel_test_seconds Test latencies.\n",
            "# TYPE keel_test_seconds histogram\n",
            "keel_test_seconds_bucket{op=\"a\",le=\"0.0025\"} 0\n",
            "keel_test_seconds_bucket{op=\"a\",le=\"0.005\"} 1\n",
            "keel_test_seconds_bucket{op=\"a\",le=\"+Inf\"} 2\n",
            "keel_test_seconds_count{op=\"a\"} 2\n",
            "keel_test_seconds_sum{op=\"a\"} 2.003\n",
            "# TYPE keel_test_total counter\nkeel_test_total 3\n",
            "# TYPE keel_test_ratio gauge\nkeel_test_ratio{env=\"ma\\\"th\"} 0.5\n",
        ] {
            assert!(out.contains(line), "{line:?} is not in:\n{out}");
        }
    }
}
