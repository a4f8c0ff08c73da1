//! The concurrent parts of a service (its HTTP server, its NATS subscriptions) run together:
//! on shutdown every part is told to stop and awaited; a part that ends on its own (a port
//! in use, a lost subscription) stops the others and the service, with its reason, instead
//! of leaving a process that serves nothing.

use std::future::Future;

use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::error::Error;

#[derive(Debug)]
pub struct Parts {
    stop: watch::Sender<bool>,
    tasks: JoinSet<(&'static str, Result<(), Error>)>,
}

impl Default for Parts {
    fn default() -> Self {
        Self { stop: watch::channel(false).0, tasks: JoinSet::new() }
    }
}

impl Parts {
    /// Completes when the parts are told to stop (give it to each part as its shutdown).
    pub fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.stop.subscribe();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    }

    /// Runs `part` as the part called `name`; its error, if it ends with one, is what
    /// [`Parts::run_until`] reports.
    pub fn spawn<E: std::fmt::Display>(
        &mut self,
        name: &'static str,
        part: impl Future<Output = Result<(), E>> + Send + 'static,
    ) {
        self.tasks
            .spawn(async move { (name, part.await.map_err(|e| Error::Part { part: name, reason: e.to_string() })) });
    }

    /// Runs until `shutdown` completes (then stops every part and waits for them) or a part
    /// ends by itself (then stops the rest and answers why that part ended).
    pub async fn run_until(mut self, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        let ended = tokio::select! {
            () = shutdown => None,
            Some(ended) = self.tasks.join_next() => Some(ended),
        };
        let _ = self.stop.send(true);
        let mut first_error = match ended {
            None => None,
            Some(Ok((name, Ok(())))) => Some(Error::PartStopped(name)),
            Some(Ok((_, Err(e)))) => Some(e),
            Some(Err(e)) => Some(Error::Part { part: "task", reason: e.to_string() }),
        };
        while let Some(done) = self.tasks.join_next().await {
            let error = match done {
                Ok((_, Ok(()))) => continue,
                Ok((_, Err(e))) => e,
                Err(e) => Error::Part { part: "task", reason: e.to_string() },
            };
            first_error.get_or_insert(error);
        }
        first_error.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn shutdown_stops_every_part() {
        let mut parts = Parts::default();
        for name in ["http", "nats"] {
            let stopped = parts.stopped();
            parts.spawn(name, async move {
                stopped.await;
                Ok::<_, String>(())
            });
        }
        assert!(parts.run_until(async {}).await.is_ok());
    }

    #[tokio::test]
    async fn a_part_that_fails_stops_the_others_and_the_service() {
        let mut parts = Parts::default();
        let stopped = parts.stopped();
        parts.spawn("http", async move {
            stopped.await;
            Ok::<_, String>(())
        });
        parts.spawn("nats", async { Err("the subscription ended".to_string()) });
        let result = parts.run_until(std::future::pending()).await;
        assert_eq!(result.unwrap_err().to_string(), "nats: the subscription ended");
        let mut parts = Parts::default();
        parts.spawn("http", async { Ok::<_, String>(()) });
        assert_eq!(parts.run_until(std::future::pending()).await.unwrap_err().to_string(), "http stopped");
    }
}
