//! Prometheus text exposition (format 0.0.4), written by hand: services keep their counters
//! as atomics or in their actor and print them on `GET /metrics`.
//!
//! What every service measures the same way — requests handled over HTTP and NATS, with
//! their latencies — goes to one process-wide set of histograms ([`observe`]), printed by
//! [`render_shared`] at the end of each service's `/metrics`.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

/// The `Content-Type` of the text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4";

/// Appends one metric without labels: its HELP and TYPE lines and the value.
pub fn metric(out: &mut String, name: &str, kind: &str, help: &str, value: f64) {
    header(out, name, kind, help);
    out.push_str(&format!("{name} {value}\n"));
}

/// Appends a metric's HELP and TYPE lines (samples with labels follow with [`sample`]).
pub fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
}

/// Appends one sample with labels, e.g. `name{env="math"} 3`.
pub fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], value: f64) {
    let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
    out.push_str(&format!("{name}{{{}}} {value}\n", labels.join(",")));
}

fn escape(value: &str) -> String {
    value.replace('\\', r"\\").replace('"', "\\\"").replace('\n', r"\n")
}

/// `out` as a `GET /metrics` response.
pub fn response(out: String) -> axum::response::Response {
    use axum::response::IntoResponse;
    ([(axum::http::header::CONTENT_TYPE, CONTENT_TYPE)], out).into_response()
}

/// `GET /metrics` with only what [`render_shared`] prints, for a service with nothing of
/// its own to add.
pub async fn shared_only() -> axum::response::Response {
    let mut out = String::new();
    render_shared(&mut out);
    response(out)
}

/// Upper bounds (seconds) of the latency histograms' buckets.
const BUCKETS: [f64; 14] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

type Labels = Vec<(&'static str, String)>;

#[derive(Debug)]
struct Family {
    help: &'static str,
    series: BTreeMap<Labels, Histogram>,
}

fn families() -> &'static Mutex<BTreeMap<&'static str, Family>> {
    static FAMILIES: OnceLock<Mutex<BTreeMap<&'static str, Family>>> = OnceLock::new();
    FAMILIES.get_or_init(Default::default)
}

/// Records one observation of `seconds` in histogram `name` (e.g.
/// `keel_http_request_duration_seconds`) under `labels`. Its `_count` doubles as the
/// request counter.
pub fn observe(name: &'static str, help: &'static str, labels: &[(&'static str, &str)], seconds: f64) {
    let labels: Labels = labels.iter().map(|(k, v)| (*k, (*v).to_string())).collect();
    let Ok(mut families) = families().lock() else { return };
    let family = families.entry(name).or_insert_with(|| Family { help, series: BTreeMap::new() });
    let histogram = family.series.entry(labels).or_default();
    for (bound, count) in BUCKETS.iter().zip(histogram.counts.iter_mut()) {
        if seconds <= *bound {
            *count += 1;
        }
    }
    histogram.count += 1;
    histogram.sum += seconds;
}

/// Appends every histogram recorded with [`observe`] in this process.
pub fn render_shared(out: &mut String) {
    let Ok(families) = families().lock() else { return };
    for (name, family) in families.iter() {
        header(out, name, "histogram", family.help);
        for (labels, histogram) in &family.series {
            let base: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
            for (bound, count) in BUCKETS.iter().zip(histogram.counts) {
                let le = bound.to_string();
                let mut with_le = base.clone();
                with_le.push(("le", &le));
                sample(out, &format!("{name}_bucket"), &with_le, count as f64);
            }
            let mut inf = base.clone();
            inf.push(("le", "+Inf"));
            sample(out, &format!("{name}_bucket"), &inf, histogram.count as f64);
            sample(out, &format!("{name}_sum"), &base, histogram.sum);
            sample(out, &format!("{name}_count"), &base, histogram.count as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_format() {
        let mut out = String::new();
        metric(&mut out, "keel_x_total", "counter", "Things.", 3.0);
        header(&mut out, "keel_y", "gauge", "Per env.");
        sample(&mut out, "keel_y", &[("env", "ma\"th")], 0.5);
        assert_eq!(
            out,
            "# HELP keel_x_total Things.\n# TYPE keel_x_total counter\nkeel_x_total 3\n\
             # HELP keel_y Per env.\n# TYPE keel_y gauge\nkeel_y{env=\"ma\\\"th\"} 0.5\n"
        );
    }

    #[test]
    fn histograms() {
        observe("keel_test_seconds", "Test latencies.", &[("op", "a")], 0.003);
        observe("keel_test_seconds", "Test latencies.", &[("op", "a")], 2.0);
        let mut out = String::new();
        render_shared(&mut out);
        assert!(out.contains("# TYPE keel_test_seconds histogram\n"), "{out}");
        assert!(out.contains("keel_test_seconds_bucket{op=\"a\",le=\"0.0025\"} 0\n"), "{out}");
        assert!(out.contains("keel_test_seconds_bucket{op=\"a\",le=\"0.005\"} 1\n"), "{out}");
        assert!(out.contains("keel_test_seconds_bucket{op=\"a\",le=\"+Inf\"} 2\n"), "{out}");
        assert!(out.contains("keel_test_seconds_count{op=\"a\"} 2\n"), "{out}");
        assert!(out.contains("keel_test_seconds_sum{op=\"a\"} 2.003\n"), "{out}");
    }
}
