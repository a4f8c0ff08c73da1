//! An OTLP/HTTP receiver for tests: the services export their spans to it (decoded from
//! protobuf) and the test reads them back.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::{AnyValue as Any, KeyValue};
use prost::Message;

/// One received span.
#[derive(Debug, Clone)]
pub struct Span {
    pub trace: String,
    pub id: String,
    pub parent: String,
    pub name: String,
    pub service: String,
    pub attributes: BTreeMap<String, String>,
    /// OTLP's status code (2: error) and message.
    pub status: (i32, String),
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(value: &Option<Any>) -> String {
    match value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

fn attributes(list: &[KeyValue]) -> BTreeMap<String, String> {
    list.iter().map(|kv| (kv.key.clone(), text(&kv.value))).collect()
}

/// The spans of one OTLP/HTTP protobuf `ExportTraceServiceRequest` body.
pub fn decode(body: &[u8]) -> Vec<Span> {
    let request = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf request");
    let mut received = Vec::new();
    for resource in request.resource_spans {
        let service = resource
            .resource
            .as_ref()
            .map(|r| attributes(&r.attributes))
            .and_then(|a| a.get("service.name").cloned())
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for span in scope.spans {
                received.push(Span {
                    trace: hex(&span.trace_id),
                    id: hex(&span.span_id),
                    parent: hex(&span.parent_span_id),
                    name: span.name.clone(),
                    service: service.clone(),
                    attributes: attributes(&span.attributes),
                    status: span.status.as_ref().map(|s| (s.code, s.message.clone())).unwrap_or_default(),
                });
            }
        }
    }
    received
}

/// An OTLP/HTTP receiver on a free port: `POST /v1/traces` with a protobuf
/// `ExportTraceServiceRequest`. Returns its base URL and what it received.
pub async fn otlp_receiver() -> (String, Arc<Mutex<Vec<Span>>>) {
    let spans = Arc::new(Mutex::new(Vec::new()));
    let sink = spans.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        post(move |body: Bytes| {
            let sink = sink.clone();
            async move {
                sink.lock().unwrap().extend(decode(&body));
                ""
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, spans)
}
