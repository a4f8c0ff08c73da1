//! The engine thread: tch work never runs on the async workers. One OS thread owns the
//! run's [`Trainer`] and runs jobs one at a time, in the order they were sent; callers await
//! the result.

use std::sync::mpsc;

use tokio::sync::oneshot;

use crate::error::{Error, Result};
use crate::trainer::Trainer;

type Job = Box<dyn FnOnce(&mut Option<Trainer>) + Send>;

/// A handle to the engine thread; the thread stops when every handle is dropped.
#[derive(Debug, Clone)]
pub struct EngineThread {
    jobs: mpsc::Sender<Job>,
}

impl EngineThread {
    pub fn start() -> std::io::Result<Self> {
        let (jobs, queue) = mpsc::channel::<Job>();
        std::thread::Builder::new().name("keel-trainer-engine".into()).spawn(move || {
            let mut engine: Option<Trainer> = None;
            for job in queue {
                job(&mut engine);
            }
        })?;
        Ok(Self { jobs })
    }

    /// Runs `work` on the engine thread, with the caller's span, and returns its result.
    pub async fn call<R, F>(&self, work: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut Option<Trainer>) -> Result<R> + Send + 'static,
    {
        let (reply, result) = oneshot::channel();
        let span = tracing::Span::current();
        let job: Job = Box::new(move |engine| {
            let _entered = span.enter();
            let outcome = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(engine))) {
                Ok(outcome) => outcome,
                Err(_) => {
                    *engine = None;
                    tracing::error!("the engine panicked; the run's models were dropped");
                    Err(Error::Internal("the engine panicked; the run's models were dropped".into()))
                }
            };
            let _ = reply.send(outcome);
        });
        self.jobs.send(job).map_err(|_| Error::Internal("the engine thread has stopped".into()))?;
        result.await.map_err(|_| Error::Internal("the engine thread dropped a job".into()))?
    }
}
