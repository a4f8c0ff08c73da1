//! The orchestrator's run API (`openapi/keel.yaml`).

use keel_protocol::checkpoint::Checkpoint;
use keel_protocol::run::{DatasetUploaded, Metrics, Run, RunList, RunSpec, Samples};
use uuid::Uuid;

use crate::{Result, json, unreachable};

/// An orchestrator at `url` (`http://host:8080`), with its bearer token when it has one.
#[derive(Debug, Clone)]
pub struct RunsClient {
    url: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl RunsClient {
    pub fn new(url: &str, token: Option<String>) -> Self {
        Self { url: url.trim_end_matches('/').to_string(), token, http: crate::http_client() }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let builder = self.http.request(method, format!("{}{path}", self.url)).headers(keel_telemetry::http_headers());
        match &self.token {
            Some(token) => builder.bearer_auth(token),
            None => builder,
        }
    }

    /// Submits a run spec (JSON).
    pub async fn submit(&self, spec: String) -> Result<Run> {
        self.post_spec("/v1/runs", spec, "submit").await
    }

    /// Checks a run spec (JSON) as `submit` would and creates nothing (the API's dry run): the
    /// spec as it would run, every default filled in, or every problem as the error.
    pub async fn validate(&self, spec: String) -> Result<RunSpec> {
        self.post_spec("/v1/runs/validate", spec, "validate").await
    }

    /// Uploads a dataset file of `kind` (`jsonl` or `parquet`, whatever the file's name),
    /// streamed: the path a spec names it by on the orchestrator.
    pub async fn upload_dataset(&self, file: &std::path::Path, kind: &str) -> Result<DatasetUploaded> {
        let what = format!("upload {}", file.display());
        let stem = file.file_stem().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let name = format!("{stem}.{kind}");
        let opened = tokio::fs::File::open(file).await.map_err(crate::io(&what))?;
        let response = self
            .request(reqwest::Method::POST, "/v1/datasets")
            .query(&[("name", name)])
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(reqwest::Body::wrap_stream(crate::chunks(opened)))
            .send()
            .await
            .map_err(unreachable(&what))?;
        json(response, &what).await
    }

    async fn post_spec<T: serde::de::DeserializeOwned>(&self, path: &str, spec: String, what: &str) -> Result<T> {
        let response = self
            .request(reqwest::Method::POST, path)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(spec)
            .send()
            .await
            .map_err(unreachable(what))?;
        json(response, what).await
    }

    pub async fn list(&self, status: Option<&str>, limit: usize, after: Option<&str>) -> Result<RunList> {
        let mut query = vec![("limit", limit.to_string())];
        query.extend(status.map(|s| ("status", s.to_string())));
        query.extend(after.map(|a| ("after", a.to_string())));
        let response =
            self.request(reqwest::Method::GET, "/v1/runs").query(&query).send().await.map_err(unreachable("list"))?;
        json(response, "list runs").await
    }

    pub async fn get(&self, id: Uuid) -> Result<Run> {
        let response =
            self.request(reqwest::Method::GET, &format!("/v1/runs/{id}")).send().await.map_err(unreachable("show"))?;
        json(response, &format!("run {id}")).await
    }

    /// The run's checkpoints (those retention kept), oldest first.
    pub async fn checkpoints(&self, id: Uuid) -> Result<Vec<Checkpoint>> {
        let path = format!("/v1/runs/{id}/checkpoints");
        let response = self.request(reqwest::Method::GET, &path).send().await.map_err(unreachable("checkpoints"))?;
        json(response, &format!("run {id}'s checkpoints")).await
    }

    /// Metrics whose names are in `names` (all when empty), from step `from` on.
    pub async fn metrics(&self, id: Uuid, names: &[&str], from: Option<u64>) -> Result<Metrics> {
        let mut query = Vec::new();
        if !names.is_empty() {
            query.push(("names", names.join(",")));
        }
        query.extend(from.map(|f| ("from_step", f.to_string())));
        let response = self
            .request(reqwest::Method::GET, &format!("/v1/runs/{id}/metrics"))
            .query(&query)
            .send()
            .await
            .map_err(unreachable("metrics"))?;
        json(response, "metrics").await
    }

    pub async fn samples(&self, id: Uuid, step: Option<u64>, limit: usize) -> Result<Samples> {
        let mut query = vec![("limit", limit.to_string())];
        query.extend(step.map(|s| ("step", s.to_string())));
        let response = self
            .request(reqwest::Method::GET, &format!("/v1/runs/{id}/samples"))
            .query(&query)
            .send()
            .await
            .map_err(unreachable("samples"))?;
        json(response, "samples").await
    }

    pub async fn cancel(&self, id: Uuid) -> Result<Run> {
        let response = self
            .request(reqwest::Method::POST, &format!("/v1/runs/{id}/cancel"))
            .send()
            .await
            .map_err(unreachable("cancel"))?;
        json(response, "cancel").await
    }
}
