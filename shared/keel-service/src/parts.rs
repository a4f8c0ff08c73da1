//! The concurrent parts of a service (its HTTP server, its NATS subscriptions) run together:
//! on shutdown every part is told to stop and awaited; a part that ends on its own (a port
//! in use, a lost subscription) stops the others and the service, with its reason, instead
//! of leaving a process that serves nothing.

use std::future::Future;

use tokio::sync::watch;
use tokio::task::JoinSet;

#[derive(Debug)]
pub struct Parts {
    stop: watch::Sender<bool>,
    tasks: JoinSet<(&'static str, Result<(), String>)>,
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

    pub fn spawn(&mut self, name: &'static str, part: impl Future<Output = Result<(), String>> + Send + 'static) {
        self.tasks.spawn(async move { (name, part.await) });
    }

    /// Runs until `shutdown` completes (then stops every part and waits for them) or a part
    /// ends by itself (then stops the rest and answers why that part ended).
    pub async fn run_until(mut self, shutdown: impl Future<Output = ()>) -> Result<(), String> {
        let ended = tokio::select! {
            () = shutdown => None,
            Some(ended) = self.tasks.join_next() => Some(ended),
        };
        let _ = self.stop.send(true);
        let mut first_error = match ended {
            None => None,
            Some(Ok((name, Ok(())))) => Some(format!("{name} stopped")),
            Some(Ok((name, Err(e)))) => Some(format!("{name}: {e}")),
            Some(Err(e)) => Some(e.to_string()),
        };
        while let Some(done) = self.tasks.join_next().await {
            let error = match done {
                Ok((_, Ok(()))) => continue,
                Ok((name, Err(e))) => format!("{name}: {e}"),
                Err(e) => e.to_string(),
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
                Ok(())
            });
        }
        assert_eq!(parts.run_until(async {}).await, Ok(()));
    }

    #[tokio::test]
    async fn a_part_that_fails_stops_the_others_and_the_service() {
        let mut parts = Parts::default();
        let stopped = parts.stopped();
        parts.spawn("http", async move {
            stopped.await;
            Ok(())
        });
        parts.spawn("nats", async { Err("the subscription ended".to_string()) });
        let result = parts.run_until(std::future::pending()).await;
        assert_eq!(result, Err("nats: the subscription ended".to_string()));
        let mut parts = Parts::default();
        parts.spawn("http", async { Ok(()) });
        assert_eq!(parts.run_until(std::future::pending()).await, Err("http stopped".to_string()));
    }
}
