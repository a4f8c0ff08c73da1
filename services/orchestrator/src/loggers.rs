//! Loggers as in NeMo-RL (`logger.*_enabled`): every metric a run records also goes to
//! TensorBoard event files, to an MLflow tracking server and to W&B's offline run files. A
//! logger that fails says so in the log; the run goes on (its metrics are in Keel's own store
//! either way).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use keel_protocol::run::{RunSpec, RunStatus};
use serde_json::Value;

mod mlflow;
mod tensorboard;
mod wandb;

pub use mlflow::{Mlflow, TrackingServers, mlflow_key};
pub use tensorboard::TensorBoard;
pub use wandb::Wandb;

/// One place a run's metrics go. A logger that fails is dropped with a warning; the run
/// goes on.
pub trait MetricsLogger: Send + std::fmt::Debug {
    /// What the warnings call it: its name, and where it writes.
    fn describe(&self) -> String;
    /// Logs `metrics` of `step`.
    fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> std::io::Result<()>;
    /// The run ended with `status`.
    fn finish(&mut self, _status: RunStatus) -> std::io::Result<()> {
        Ok(())
    }
}

/// The run's enabled loggers.
#[derive(Debug, Default)]
pub struct Loggers {
    loggers: Vec<Box<dyn MetricsLogger>>,
}

impl Loggers {
    /// Opens the loggers the run's `logger` section enables for run `run_id`, files under
    /// `<log_dir>/<run_id>/` (the default `log_dir` is `default_dir`). One that cannot start
    /// is left off, with a warning. Needs a Tokio runtime (MLflow's task).
    pub fn open(run: &RunSpec, run_id: &str, default_dir: &Path, mlflow: &TrackingServers) -> Self {
        let spec = &run.logger;
        let name = run.name.as_deref().unwrap_or(run_id);
        let root = spec.log_dir.as_ref().map_or_else(|| default_dir.to_path_buf(), PathBuf::from).join(run_id);
        let mut loggers: Vec<Box<dyn MetricsLogger>> = Vec::new();
        if spec.tensorboard_enabled {
            match TensorBoard::create(&root.join("tensorboard")) {
                Ok(tensorboard) => loggers.push(Box::new(tensorboard)),
                Err(e) => tracing::warn!(run_id, "TensorBoard logging is off: {e}"),
            }
        }
        if spec.mlflow_enabled {
            loggers.push(Box::new(Mlflow::start(&spec.mlflow, mlflow, run_id, name)));
        }
        if spec.wandb_enabled {
            let config = serde_json::to_value(run).unwrap_or(Value::Null);
            match Wandb::create(&root, run_id, &spec.wandb, name, &config) {
                Ok(wandb) => loggers.push(Box::new(wandb)),
                Err(e) => tracing::warn!(run_id, "W&B logging is off: {e}"),
            }
        }
        Self { loggers }
    }

    /// Logs `metrics` of `step` to every logger; one that fails stops.
    pub fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>) {
        self.loggers.retain_mut(|logger| match logger.log(step, metrics) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("{} logging stops: {e}", logger.describe());
                false
            }
        });
    }

    /// The run ended with `status`: MLflow's run is marked so (and its task ends), W&B's
    /// files get their last row and the exit (code 0 for a run that succeeded).
    pub fn finish(&mut self, status: RunStatus) {
        for mut logger in self.loggers.drain(..) {
            if let Err(e) = logger.finish(status) {
                tracing::warn!("{} logging could not finish: {e}", logger.describe());
            }
        }
    }
}
