//! Logging and tracing for every Keel process.
//!
//! [`init`] installs one `tracing` subscriber with two layers:
//! - log lines on stderr, filtered by `KEEL_LOG` (default `info`), each ending with the
//!   `trace_id=` of the span it was written in;
//! - OpenTelemetry spans, filtered by `KEEL_TRACE` (default `info`), exported over OTLP
//!   (HTTP/protobuf) to `OTEL_EXPORTER_OTLP_ENDPOINT` (spans go to its `/v1/traces`) when
//!   that is set. Without an endpoint spans are still made, so trace context still flows
//!   through this process to the next.
//!
//! The two filters are separate on purpose: a span the log filter drops must still exist
//! for OpenTelemetry, or the `traceparent` it should pass on is never made.
//!
//! Trace context crosses process boundaries as W3C `traceparent`/`tracestate` headers:
//! [`http_headers`] and [`inject_http`] for outgoing HTTP requests, [`set_http_parent`] for
//! incoming ones, [`nats_headers`] for outgoing NATS messages and [`set_nats_parent`] for
//! incoming ones.
//!
//! Work that makes hundreds of alike requests (validation's rollouts) runs [`summarised`]:
//! its requests get no client spans and pass on their trace context marked not sampled, so
//! the services they reach make no spans for them either; the caller records the
//! [`Summary`] (requests, failures, seconds) on its own span instead. `KEEL_TRACE` with
//! `keel::detail=debug` (e.g. `KEEL_TRACE=info,keel::detail=debug`) keeps every span.

use std::fmt;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::{Event, Span, Subscriber};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, format};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The environment variable naming the OTLP collector (e.g. `http://127.0.0.1:4318`).
pub const ENDPOINT_VAR: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// Keeps the span exporter alive; [`Telemetry::shutdown`] (or drop) sends what is buffered.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
    endpoint: Option<String>,
}

impl Telemetry {
    /// Where spans are exported, if anywhere.
    pub fn endpoint(&self) -> Option<&str> {
        self.endpoint.as_deref()
    }

    /// Exports the spans still buffered and stops the exporter.
    pub fn shutdown(self) {
        drop(self);
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown()
            && self.endpoint.is_some()
        {
            eprintln!("telemetry: cannot export the last spans: {e}");
        }
    }
}

/// Installs logging and tracing for process `service` (its `service.name`, e.g.
/// `keel-generator`). Call it once, before the Tokio runtime starts (the exporter runs on a
/// thread of its own with a blocking HTTP client), and keep the returned value until the
/// runtime has stopped.
pub fn init(service: &str) -> Telemetry {
    let endpoint =
        std::env::var(ENDPOINT_VAR).ok().map(|e| e.trim_end_matches('/').to_string()).filter(|e| !e.is_empty());
    let resource = Resource::builder()
        .with_service_name(service.to_string())
        .with_attributes([
            KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
            KeyValue::new("service.instance.id", format!("{}-{}", hostname(), std::process::id())),
        ])
        .build();
    let mut builder = SdkTracerProvider::builder().with_resource(resource);
    let mut problem = None;
    if let Some(endpoint) = &endpoint {
        let exporter = SpanExporter::builder().with_http().with_endpoint(format!("{endpoint}/v1/traces")).build();
        match exporter {
            Ok(exporter) => builder = builder.with_batch_exporter(exporter),
            Err(e) => problem = Some(format!("cannot export spans to {endpoint}: {e}")),
        }
    }
    let provider = builder.build();
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());

    let log_filter = EnvFilter::try_from_env("KEEL_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let trace_filter = EnvFilter::try_from_env("KEEL_TRACE").unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .event_format(WithTraceId(format::Format::default()))
        .with_filter(log_filter);
    let spans =
        tracing_opentelemetry::layer().with_tracer(provider.tracer(service.to_string())).with_filter(trace_filter);
    if tracing_subscriber::registry().with(logs).with(spans).try_init().is_err() {
        eprintln!("telemetry: a tracing subscriber was already installed; keeping it");
    }
    match (&problem, &endpoint) {
        (Some(problem), _) => tracing::warn!("{problem}"),
        (None, Some(endpoint)) => tracing::info!(%endpoint, "exporting spans over OTLP"),
        (None, None) => tracing::debug!("no {ENDPOINT_VAR}: spans are not exported"),
    }
    Telemetry { provider, endpoint: if problem.is_some() { None } else { endpoint } }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "host".into())
}

/// The trace id of the current span, as 32 hex digits (None outside any traced span).
pub fn trace_id() -> Option<String> {
    let context = Span::current().context();
    let span = context.span();
    let span_context = span.span_context();
    span_context.is_valid().then(|| span_context.trace_id().to_string())
}

/// The log format with ` trace_id=...` at the end of every line written inside a span.
struct WithTraceId<F>(F);

impl<S, N, F> FormatEvent<S, N> for WithTraceId<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        // The OpenTelemetry context the entered span activated (a thread-local; asking the
        // subscriber from inside its own callback would not work).
        let context = Context::current();
        let span = context.span();
        let span_context = span.span_context();
        if !span_context.is_valid() {
            return self.0.format_event(ctx, writer, event);
        }
        let trace_id = span_context.trace_id();
        let mut line = String::new();
        self.0.format_event(ctx, Writer::new(&mut line), event)?;
        let body = line.strip_suffix('\n').unwrap_or(&line);
        writeln!(writer, "{body} trace_id={trace_id}")
    }
}

// --- HTTP ------------------------------------------------------------------------------

/// Adds the current span's `traceparent` (and `tracestate`) to `headers`.
pub fn inject_http(headers: &mut http::HeaderMap) {
    let context = Span::current().context();
    TraceContextPropagator::new().inject_context(&context, &mut opentelemetry_http::HeaderInjector(headers));
}

/// Headers carrying the current span's trace context, for an outgoing HTTP request.
pub fn http_headers() -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    inject_http(&mut headers);
    headers
}

/// Makes `span` a child of the trace context an incoming HTTP request carries (no change
/// when it carries none).
pub fn set_http_parent(span: &Span, headers: &http::HeaderMap) {
    set_parent(span, TraceContextPropagator::new().extract(&opentelemetry_http::HeaderExtractor(headers)));
}

// --- NATS ------------------------------------------------------------------------------

struct NatsInjector<'a>(&'a mut async_nats::HeaderMap);

impl Injector for NatsInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key, value.as_str());
    }
}

struct NatsExtractor<'a>(&'a async_nats::HeaderMap);

impl Extractor for NatsExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(|v| v.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(name, _)| name.as_ref()).collect()
    }
}

/// Headers carrying the current span's trace context, for an outgoing NATS message
/// (marked not sampled in [`quiet`] work).
pub fn nats_headers() -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    let mut context = Span::current().context();
    if quiet() {
        let current = context.span().span_context().clone();
        let unsampled = opentelemetry::trace::SpanContext::new(
            current.trace_id(),
            current.span_id(),
            opentelemetry::trace::TraceFlags::default(),
            current.is_remote(),
            current.trace_state().clone(),
        );
        context = Context::new().with_remote_span_context(unsampled);
    }
    TraceContextPropagator::new().inject_context(&context, &mut NatsInjector(&mut headers));
    headers
}

// --- Summarised work -------------------------------------------------------------------

/// The `tracing` target whose `debug` level keeps the spans of [`summarised`] work.
pub const DETAIL_TARGET: &str = "keel::detail";

/// What the requests of [`summarised`] work came to.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Summary {
    pub requests: u64,
    pub failed: u64,
    /// The requests' seconds, added up.
    pub seconds: f64,
}

tokio::task_local! {
    static SUMMARY: std::sync::Arc<std::sync::Mutex<Summary>>;
}

/// Runs `work` with its requests summarised (see the crate's documentation): returns its
/// output and what its requests came to. Requests made from tasks `work` spawns are not
/// summarised.
pub async fn summarised<F: std::future::Future>(work: F) -> (F::Output, Summary) {
    let summary = std::sync::Arc::new(std::sync::Mutex::new(Summary::default()));
    let output = SUMMARY.scope(summary.clone(), work).await;
    let summary = *summary.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    (output, summary)
}

/// Whether this task is in [`summarised`] work whose spans are off (`keel::detail` is not
/// at `debug` in `KEEL_TRACE`): its requests make no client spans and pass on unsampled
/// trace context.
pub fn quiet() -> bool {
    SUMMARY.try_with(|_| ()).is_ok() && !tracing::enabled!(target: DETAIL_TARGET, tracing::Level::DEBUG)
}

/// Counts one request of [`summarised`] work (nothing outside it).
pub fn count_request(seconds: f64, failed: bool) {
    let _ = SUMMARY.try_with(|summary| {
        let mut summary = summary.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        summary.requests += 1;
        summary.failed += u64::from(failed);
        summary.seconds += seconds;
    });
}

/// Makes `span` a child of the trace context an incoming NATS message carries (no change
/// when it has no headers or no `traceparent`).
pub fn set_nats_parent(span: &Span, headers: Option<&async_nats::HeaderMap>) {
    if let Some(headers) = headers {
        set_parent(span, TraceContextPropagator::new().extract(&NatsExtractor(headers)));
    }
}

fn set_parent(span: &Span, context: Context) {
    if context.span().span_context().is_valid() {
        let _ = span.set_parent(context);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_tracing<T>(f: impl FnOnce() -> T) -> T {
        let provider = SdkTracerProvider::builder().build();
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        let subscriber =
            tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, f)
    }

    #[test]
    fn log_lines_in_a_span_end_with_its_trace_id() {
        use std::sync::{Arc, Mutex};
        let lines = Arc::new(Mutex::new(Vec::<u8>::new()));
        let sink = lines.clone();
        let writer = move || SharedBuffer(sink.clone());
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(false)
                    .with_writer(writer)
                    .event_format(WithTraceId(format::Format::default())),
            )
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        let trace = tracing::subscriber::with_default(subscriber, || {
            tracing::info!("outside");
            let span = tracing::info_span!("step", step = 3);
            span.in_scope(|| {
                tracing::info!("inside");
                trace_id()
            })
        });
        let trace = trace.expect("a trace id inside the span");
        let text = String::from_utf8(lines.lock().unwrap_or_else(|e| e.into_inner()).clone()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(lines[0].ends_with("outside"), "{text}");
        assert!(lines[1].contains("step{step=3}") && lines[1].ends_with(&format!("inside trace_id={trace}")), "{text}");
    }

    struct SharedBuffer(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for SharedBuffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn nats_headers_carry_the_trace_to_a_child_span() {
        with_tracing(|| {
            let root = tracing::info_span!("root");
            let (trace, headers) = root.in_scope(|| (trace_id(), nats_headers()));
            let trace = trace.expect("a root span has a trace id");
            let traceparent = headers.get("traceparent").expect("traceparent header").as_str().to_string();
            assert!(traceparent.starts_with(&format!("00-{trace}-")), "{traceparent}");

            let child = tracing::info_span!(parent: None, "handler");
            set_nats_parent(&child, Some(&headers));
            assert_eq!(child.in_scope(trace_id), Some(trace));
        });
    }

    /// Under a `KEEL_TRACE`-like span filter `filter`: whether summarised work was quiet,
    /// the traceparent outside and inside it, and its summary.
    fn summarised_under(filter: &str) -> (bool, String, String, Summary) {
        let provider = SdkTracerProvider::builder().build();
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        let layer =
            tracing_opentelemetry::layer().with_tracer(provider.tracer("test")).with_filter(EnvFilter::new(filter));
        tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), || {
            let runtime = tokio::runtime::Builder::new_current_thread().build().expect("a runtime");
            let root = tracing::info_span!("root");
            let _entered = root.enter();
            let traceparent = || nats_headers().get("traceparent").expect("traceparent").as_str().to_string();
            let outside = traceparent();
            assert!(!quiet(), "outside summarised work nothing is quiet");
            let ((was_quiet, inside), summary) = runtime.block_on(summarised(async {
                count_request(0.5, false);
                count_request(0.25, true);
                (quiet(), traceparent())
            }));
            count_request(1.0, false);
            (was_quiet, outside, inside, summary)
        })
    }

    #[test]
    fn summarised_work_passes_on_unsampled_context_and_counts_its_requests() {
        let (quiet, outside, inside, summary) = summarised_under("info");
        assert!(quiet && outside.ends_with("-01") && inside.ends_with("-00"), "{outside} {inside}");
        assert_eq!(inside[..52], outside[..52], "the same trace and parent: {outside} {inside}");
        assert_eq!(summary, Summary { requests: 2, failed: 1, seconds: 0.75 });
        // keel::detail at debug keeps every span.
        let (quiet, _, inside, summary) = summarised_under("info,keel::detail=debug");
        assert!(!quiet && inside.ends_with("-01"), "{inside}");
        assert_eq!(summary.requests, 2, "still counted");
    }

    #[test]
    fn http_headers_carry_the_trace_and_garbage_is_ignored() {
        with_tracing(|| {
            let root = tracing::info_span!("root");
            let (trace, headers) = root.in_scope(|| (trace_id(), http_headers()));
            let child = tracing::info_span!(parent: None, "handler");
            set_http_parent(&child, &headers);
            assert_eq!(child.in_scope(trace_id), trace);

            let mut bad = http::HeaderMap::new();
            bad.insert("traceparent", http::HeaderValue::from_static("00-nonsense"));
            let orphan = tracing::info_span!(parent: None, "orphan");
            set_http_parent(&orphan, &bad);
            let own = orphan.in_scope(trace_id).expect("a span of its own trace");
            assert_ne!(Some(own), trace);
        });
    }
}
