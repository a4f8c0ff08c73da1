//! MLflow: a run on a tracking server, fed through its REST API.

use std::collections::BTreeMap;

use keel_protocol::run::RunStatus;

use super::MetricsLogger;
use keel_protocol::run::MlflowSpec;
use serde_json::{Value, json};

fn millis() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// An MLflow run fed through the tracking server's REST API by a task of its own, so that
/// recording a step never waits for MLflow. The experiment is made when missing; the run is
/// found again by its `keel_run_id` tag (a resumed or retried Keel run goes on logging into
/// the same MLflow run). A failed call is logged and its metrics dropped; the next entry tries
/// again.
#[derive(Debug)]
pub struct Mlflow {
    queue: tokio::sync::mpsc::UnboundedSender<Entry>,
}

#[derive(Debug)]
enum Entry {
    Metrics { step: u64, metrics: BTreeMap<String, f64>, at: i64 },
    Finish(&'static str),
}

/// The most metrics one `log-batch` call takes.
const MLFLOW_BATCH: usize = 1000;

/// A metric name MLflow accepts: letters, digits, `_ - . / :` and spaces; `@` reads `_at_`
/// (`validation/pass@1` is `validation/pass_at_1`), anything else `_`.
pub fn mlflow_key(name: &str) -> String {
    let mut key = String::with_capacity(name.len());
    for c in name.chars() {
        match c {
            '@' => key.push_str("_at_"),
            c if c.is_ascii_alphanumeric() || "_-./: ".contains(c) => key.push(c),
            _ => key.push('_'),
        }
    }
    key
}

/// The MLflow tracking servers the operator trusts (`mlflow_tracking_uris`): a run logging to
/// one of them gets the operator's `MLFLOW_TRACKING_TOKEN`, and it may be on a private
/// address. A run spec naming any other server reaches it as an outside caller would: public
/// addresses only, no token.
#[derive(Debug, Clone, Default)]
pub struct TrackingServers {
    approved: Vec<reqwest::Url>,
    token: Option<String>,
}

impl TrackingServers {
    /// `approved` URL prefixes (malformed ones are refused naming the setting) and the token.
    pub fn new(approved: &[String], token: Option<String>) -> Result<Self, keel_protocol::FieldError> {
        let approved = approved
            .iter()
            .map(|uri| {
                reqwest::Url::parse(uri).map_err(|e| {
                    keel_protocol::FieldError::new("mlflow_tracking_uris", format!("`{uri}` is not a URL: {e}"))
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { approved, token })
    }

    /// Whether `uri` is on one of the approved servers: the same scheme, host and port, and a
    /// path at or under the approved one's (`/mlflow` approves `/mlflow/x`, not `/mlflow-x`).
    fn approves(&self, uri: &reqwest::Url) -> bool {
        self.approved.iter().any(|server| {
            let prefix = server.path().trim_end_matches('/');
            let path = uri.path();
            server.scheme() == uri.scheme()
                && server.host_str() == uri.host_str()
                && server.port_or_known_default() == uri.port_or_known_default()
                && path.strip_prefix(prefix).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        })
    }

    /// The addresses a call to `uri` may reach.
    fn access(&self, uri: &reqwest::Url) -> keel_service::outbound::PrivateAccess {
        if self.approves(uri) {
            keel_service::outbound::PrivateAccess::everything()
        } else {
            keel_service::outbound::PrivateAccess { allowed_by: "mlflow_tracking_uris", ..Default::default() }
        }
    }

    /// Refuses a tracking URI that names a loopback or private address literally (or
    /// `localhost`) and is not approved: checked at submit.
    pub fn check(&self, uri: &str) -> Result<(), keel_protocol::FieldError> {
        let field = "logger.mlflow.tracking_uri";
        let url = reqwest::Url::parse(uri).map_err(|e| keel_protocol::FieldError::new(field, e.to_string()))?;
        self.access(&url).check(&url).map_err(|e| keel_protocol::FieldError::new(field, e.message))
    }

    /// The client for `uri` and the token it may carry.
    fn client(&self, uri: &str) -> (reqwest::Client, Option<String>) {
        let Ok(url) = reqwest::Url::parse(uri) else { return (reqwest::Client::default(), None) };
        let approved = self.approves(&url);
        let client = self.access(&url).client(false, std::time::Duration::from_secs(30)).unwrap_or_default();
        (client, if approved { self.token.clone() } else { None })
    }
}

impl Mlflow {
    pub(super) fn start(spec: &MlflowSpec, servers: &TrackingServers, run_id: &str, name: &str) -> Self {
        let (queue, entries) = tokio::sync::mpsc::unbounded_channel();
        let base = spec.tracking_uri.clone().unwrap_or_default().trim_end_matches('/').to_string();
        let (http, token) = servers.client(&base);
        if token.is_none() && servers.token.is_some() {
            tracing::info!(run_id, "MLflow at {base} is not one of mlflow_tracking_uris: it gets no token");
        }
        let client = MlflowClient {
            http,
            base,
            token,
            experiment: spec.experiment_name.clone().unwrap_or_else(|| "keel".into()),
            name: spec.run_name.clone().unwrap_or_else(|| name.to_string()),
            keel_run: run_id.to_string(),
        };
        tokio::spawn(client.serve(entries));
        Self { queue }
    }

    fn send(&self, entry: Entry) {
        // The task ends only after a Finish, which is sent last.
        let _ = self.queue.send(entry);
    }
}

impl MetricsLogger for Mlflow {
    fn describe(&self) -> String {
        "MLflow".into()
    }

    /// Queued for the MLflow task (which says itself when the server fails).
    fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> std::io::Result<()> {
        self.send(Entry::Metrics { step, metrics: metrics.clone(), at: millis() });
        Ok(())
    }

    /// MLflow's run is marked finished, killed or failed, and the task ends.
    fn finish(&mut self, status: RunStatus) -> std::io::Result<()> {
        let status = match status {
            RunStatus::Succeeded => "FINISHED",
            RunStatus::Cancelled => "KILLED",
            _ => "FAILED",
        };
        self.send(Entry::Finish(status));
        Ok(())
    }
}

struct MlflowClient {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
    experiment: String,
    name: String,
    keel_run: String,
}

impl MlflowClient {
    async fn serve(self, mut entries: tokio::sync::mpsc::UnboundedReceiver<Entry>) {
        let mut run: Option<String> = None;
        while let Some(entry) = entries.recv().await {
            if run.is_none() {
                match self.run().await {
                    Ok(id) => run = Some(id),
                    Err(e) => {
                        let base = &self.base;
                        tracing::warn!(run_id = %self.keel_run, "MLflow at {base}: {e}; these metrics are not logged there");
                        continue;
                    }
                }
            }
            let id = run.as_deref().unwrap_or_default();
            let (done, sent) = match entry {
                Entry::Metrics { step, metrics, at } => (false, self.log_batch(id, step, &metrics, at).await),
                Entry::Finish(status) => {
                    let body = json!({"run_id": id, "status": status, "end_time": millis()});
                    (true, self.call("runs/update", body).await.map(drop))
                }
            };
            if let Err(e) = sent {
                tracing::warn!(run_id = %self.keel_run, "MLflow at {}: {e}", self.base);
            }
            if done {
                break;
            }
        }
    }

    /// `POST api/2.0/mlflow/<path>` with the JSON `body`.
    async fn call(&self, path: &str, body: Value) -> Result<Value, MlflowError> {
        self.send(self.http.post(format!("{}/api/2.0/mlflow/{path}", self.base)).json(&body)).await
    }

    /// `GET api/2.0/mlflow/<path>` with `query`.
    async fn get(&self, path: &str, query: &[(&str, &str)]) -> Result<Value, MlflowError> {
        self.send(self.http.get(format!("{}/api/2.0/mlflow/{path}", self.base)).query(query)).await
    }

    /// The reply's JSON, or MLflow's error code and message.
    async fn send(&self, request: reqwest::RequestBuilder) -> Result<Value, MlflowError> {
        let request = match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        };
        let unreachable = |e: reqwest::Error| MlflowError { code: "UNREACHABLE".into(), message: e.to_string() };
        let response = request.send().await.map_err(unreachable)?;
        let (status, url) = (response.status(), response.url().clone());
        let reply: Value = response.json().await.unwrap_or(Value::Null);
        if status.is_success() {
            return Ok(reply);
        }
        let code = reply["error_code"].as_str().unwrap_or("HTTP_ERROR").to_string();
        let message = reply["message"].as_str().map_or_else(|| format!("{url}: {status}"), String::from);
        Err(MlflowError { code, message })
    }

    async fn experiment(&self) -> Result<String, MlflowError> {
        let query = [("experiment_name", self.experiment.as_str())];
        match self.get("experiments/get-by-name", &query).await {
            Ok(found) => return id_at(&found, "/experiment/experiment_id"),
            Err(e) if e.code == "RESOURCE_DOES_NOT_EXIST" => {}
            Err(e) => return Err(e),
        }
        match self.call("experiments/create", json!({"name": self.experiment})).await {
            Ok(made) => id_at(&made, "/experiment_id"),
            // Another run made it meanwhile.
            Err(e) if e.code == "RESOURCE_ALREADY_EXISTS" => {
                id_at(&self.get("experiments/get-by-name", &query).await?, "/experiment/experiment_id")
            }
            Err(e) => Err(e),
        }
    }

    /// The MLflow run of this Keel run: found by its tag, else made.
    async fn run(&self) -> Result<String, MlflowError> {
        let experiment = self.experiment().await?;
        let filter = format!("tags.keel_run_id = '{}'", self.keel_run);
        let search = json!({"experiment_ids": [experiment], "filter": filter, "max_results": 1});
        if let Ok(id) = id_at(&self.call("runs/search", search).await?, "/runs/0/info/run_id") {
            return Ok(id);
        }
        let tags = json!([{"key": "keel_run_id", "value": self.keel_run}]);
        let body = json!({"experiment_id": experiment, "run_name": self.name, "start_time": millis(), "tags": tags});
        id_at(&self.call("runs/create", body).await?, "/run/info/run_id")
    }

    async fn log_batch(
        &self,
        run: &str,
        step: u64,
        metrics: &BTreeMap<String, f64>,
        at: i64,
    ) -> Result<(), MlflowError> {
        let all: Vec<Value> = metrics
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(name, value)| json!({"key": mlflow_key(name), "value": value, "timestamp": at, "step": step}))
            .collect();
        for batch in all.chunks(MLFLOW_BATCH) {
            self.call("runs/log-batch", json!({"run_id": run, "metrics": batch})).await?;
        }
        Ok(())
    }
}

#[derive(Debug)]
struct MlflowError {
    code: String,
    message: String,
}

impl std::fmt::Display for MlflowError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

fn id_at(reply: &Value, pointer: &str) -> Result<String, MlflowError> {
    reply
        .pointer(pointer)
        .and_then(Value::as_str)
        .map(String::from)
        .ok_or_else(|| MlflowError { code: "UNEXPECTED_REPLY".into(), message: format!("no {pointer} in {reply}") })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The operator's token goes only to the servers it names; a spec naming another server
    /// on a private address is refused, a public one is reached without the token.
    #[test]
    fn the_token_goes_only_to_the_approved_servers() {
        let servers = TrackingServers::new(&["http://mlflow:5000/".into()], Some("op-token".into())).unwrap();
        assert_eq!(servers.client("http://mlflow:5000").1.as_deref(), Some("op-token"));
        assert_eq!(servers.client("http://mlflow:5000/sub").1.as_deref(), Some("op-token"));
        for elsewhere in
            ["http://mlflow:5001", "https://mlflow:5000", "http://mlflow.evil.example:5000", "http://evil/"]
        {
            assert_eq!(servers.client(elsewhere).1, None, "{elsewhere} gets the token");
        }
        let under = TrackingServers::new(&["http://mlflow:5000/team".into()], Some("op-token".into())).unwrap();
        assert_eq!(under.client("http://mlflow:5000/team/api").1.as_deref(), Some("op-token"));
        assert_eq!(under.client("http://mlflow:5000/team-b").1, None, "a path that only starts like it");
        assert!(servers.check("http://mlflow:5000").is_ok());
        assert!(servers.check("https://mlflow.example.com").is_ok());
        for inside in ["http://127.0.0.1:5000", "http://169.254.169.254/", "http://localhost:5000", "http://[::1]:80"] {
            let refused = servers.check(inside).unwrap_err();
            assert_eq!(refused.field, "logger.mlflow.tracking_uri");
            assert!(refused.message.contains("mlflow_tracking_uris"), "{}", refused.message);
        }
        assert_eq!(TrackingServers::new(&["not a url".into()], None).unwrap_err().field, "mlflow_tracking_uris");
    }

    #[test]
    fn metric_names_become_keys_mlflow_accepts() {
        assert_eq!(mlflow_key("validation/pass@1"), "validation/pass_at_1");
        assert_eq!(mlflow_key("timing/train/total_step_time"), "timing/train/total_step_time");
        assert_eq!(mlflow_key("rewards/x(y)"), "rewards/x_y_");
    }
}
