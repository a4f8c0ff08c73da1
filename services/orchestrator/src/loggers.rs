//! Loggers as in NeMo-RL (`logger.*_enabled`): every metric a run records also goes to
//! TensorBoard event files and to an MLflow tracking server. A logger that fails says so in
//! the log; the run goes on (its metrics are in Keel's own store either way).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use keel_protocol::run::{LoggerSpec, MlflowSpec, RunStatus};
use prost::Message as _;
use serde_json::{Value, json};

/// The run's enabled loggers.
#[derive(Debug, Default)]
pub struct Loggers {
    tensorboard: Option<TensorBoard>,
    mlflow: Option<Mlflow>,
}

impl Loggers {
    /// Opens the loggers `spec` enables for run `run_id` (named `name`), files under
    /// `<log_dir>/<run_id>/` (the default `log_dir` is `default_dir`). One that cannot start
    /// is left off, with a warning. Needs a Tokio runtime (MLflow's task).
    pub fn open(spec: &LoggerSpec, run_id: &str, name: Option<&str>, default_dir: &Path) -> Self {
        let root = spec.log_dir.as_ref().map_or_else(|| default_dir.to_path_buf(), PathBuf::from).join(run_id);
        let tensorboard = spec.tensorboard_enabled.then(|| TensorBoard::create(&root.join("tensorboard")));
        let tensorboard = tensorboard
            .and_then(|opened| opened.map_err(|e| tracing::warn!(run_id, "TensorBoard logging is off: {e}")).ok());
        let mlflow = spec.mlflow_enabled.then(|| Mlflow::start(&spec.mlflow, run_id, name.unwrap_or(run_id)));
        Self { tensorboard, mlflow }
    }

    /// Logs `metrics` of `step`.
    pub fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>) {
        if let Some(tensorboard) = &mut self.tensorboard
            && let Err(e) = tensorboard.write(step, metrics)
        {
            tracing::warn!("TensorBoard logging stops: {}: {e}", tensorboard.path.display());
            self.tensorboard = None;
        }
        if let Some(mlflow) = &self.mlflow {
            mlflow.send(Entry::Metrics { step, metrics: metrics.clone(), at: millis() });
        }
    }

    /// The run ended with `status`: MLflow's run is marked so (and its task ends).
    pub fn finish(&mut self, status: RunStatus) {
        if let Some(mlflow) = self.mlflow.take() {
            let status = match status {
                RunStatus::Succeeded => "FINISHED",
                RunStatus::Cancelled => "KILLED",
                _ => "FAILED",
            };
            mlflow.send(Entry::Finish(status));
        }
    }
}

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

impl Mlflow {
    fn start(spec: &MlflowSpec, run_id: &str, name: &str) -> Self {
        let (queue, entries) = tokio::sync::mpsc::unbounded_channel();
        let client = MlflowClient {
            http: reqwest::Client::builder().timeout(std::time::Duration::from_secs(30)).build().unwrap_or_default(),
            base: spec.tracking_uri.clone().unwrap_or_default().trim_end_matches('/').to_string(),
            token: std::env::var("MLFLOW_TRACKING_TOKEN").ok().filter(|t| !t.is_empty()),
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

/// A TensorBoard event file: TFRecord framing (length, masked CRC-32C of the length, the
/// record, masked CRC-32C of the record) around `tensorflow.Event` protobufs, the first
/// saying the file version, then one per step with a scalar per metric.
#[derive(Debug)]
pub struct TensorBoard {
    path: PathBuf,
    file: std::fs::File,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    /// Always written (a scalar of 0 included): it says which of the value kinds this is.
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

fn wall_time() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// TFRecord's masked CRC-32C.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

impl TensorBoard {
    /// A new event file in `dir` (created), named as TensorBoard's writers name theirs.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string());
        let name = format!(
            "events.out.tfevents.{}.{}.{}.keel",
            wall_time() as u64,
            host.unwrap_or_else(|_| "host".into()),
            std::process::id()
        );
        let path = dir.join(name);
        let file = std::fs::OpenOptions::new().create_new(true).append(true).open(&path)?;
        let mut writer = Self { path, file };
        let version = Event { wall_time: wall_time(), file_version: Some("brain.Event:2".into()), ..Event::default() };
        writer.append(&version)?;
        Ok(writer)
    }

    /// One event at `step` with a scalar per metric; flushed to the file.
    pub fn write(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> std::io::Result<()> {
        let value = metrics
            .iter()
            .map(|(tag, value)| SummaryValue { tag: tag.clone(), simple_value: Some(*value as f32) })
            .collect();
        let event =
            Event { wall_time: wall_time(), step: step as i64, file_version: None, summary: Some(Summary { value }) };
        self.append(&event)
    }

    fn append(&mut self, event: &Event) -> std::io::Result<()> {
        let data = event.encode_to_vec();
        let length = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&length);
        record.extend_from_slice(&masked_crc(&length).to_le_bytes());
        record.extend_from_slice(&data);
        record.extend_from_slice(&masked_crc(&data).to_le_bytes());
        self.file.write_all(&record)?;
        self.file.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The records of an event file, checked against their CRCs, decoded.
    fn read(path: &Path) -> Vec<Event> {
        let bytes = std::fs::read(path).expect("the event file");
        let mut events = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let length = &bytes[at..at + 8];
            assert_eq!(masked_crc(length), u32::from_le_bytes(bytes[at + 8..at + 12].try_into().expect("4 bytes")));
            let n = u64::from_le_bytes(length.try_into().expect("8 bytes")) as usize;
            let data = &bytes[at + 12..at + 12 + n];
            let crc = u32::from_le_bytes(bytes[at + 12 + n..at + 16 + n].try_into().expect("4 bytes"));
            assert_eq!(masked_crc(data), crc);
            events.push(Event::decode(data).expect("an event"));
            at += 16 + n;
        }
        events
    }

    #[test]
    fn metric_names_become_keys_mlflow_accepts() {
        assert_eq!(mlflow_key("validation/pass@1"), "validation/pass_at_1");
        assert_eq!(mlflow_key("timing/train/total_step_time"), "timing/train/total_step_time");
        assert_eq!(mlflow_key("rewards/x(y)"), "rewards/x_y_");
    }

    #[test]
    fn an_event_file_holds_the_version_then_a_scalar_per_metric_and_step() {
        // CRC-32C's check value, and TFRecord's masking of it.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        let dir = tempfile::tempdir().expect("a directory");
        let mut writer = TensorBoard::create(dir.path()).expect("a writer");
        writer.write(0, &BTreeMap::from([("validation/accuracy".to_string(), 0.25)])).expect("written");
        writer
            .write(1, &BTreeMap::from([("train/loss".to_string(), 0.0), ("train/reward".to_string(), 1.5)]))
            .expect("written");
        let events = read(&writer.path);
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        let scalars: Vec<(i64, String, Option<f32>)> = events[1..]
            .iter()
            .flat_map(|e| {
                e.summary.iter().flat_map(move |s| s.value.iter().map(move |v| (e.step, v.tag.clone(), v.simple_value)))
            })
            .collect();
        assert_eq!(
            scalars,
            [
                (0, "validation/accuracy".into(), Some(0.25)),
                (1, "train/loss".into(), Some(0.0)),
                (1, "train/reward".into(), Some(1.5)),
            ]
        );
    }
}
