//! Waiting out a service that is briefly gone: exponential backoff with jitter, bounded by a
//! patience window. A restart, a deploy or a network blip should cost a run a pause, not one
//! of its attempts. With a [`Watcher`], a wait that outlasts the window is reported to it and
//! goes on for as long as the watcher wants (a run shows `waiting` and carries on by itself
//! when the service is back).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

/// Told about waits that outlast the window. Several calls may wait at once: each one that
/// started waiting (`wait_started`) ends with one `wait_ended`, however it ends.
pub trait Watcher: Send + Sync + std::fmt::Debug {
    /// A call has waited past the window for the reason given (the service and the error).
    fn wait_started(&self, reason: &str);
    /// Asked before every retry past the window: false ends the wait with the last error
    /// (the run was cancelled, or is no longer this caller's).
    fn keep_waiting(&self) -> bool;
    /// The call that started waiting got an answer or gave up.
    fn wait_ended(&self);
}

/// How long to keep retrying, and how fast.
#[derive(Debug, Clone)]
pub struct Patience {
    /// No retry starts after this much time since the first try (unless a watcher wants it).
    pub window: Duration,
    /// The delay before the first retry; each later one doubles, up to `max_delay`.
    pub first_delay: Duration,
    pub max_delay: Duration,
    /// Who hears of a wait past `window`, and decides whether it goes on.
    pub watcher: Option<Arc<dyn Watcher>>,
}

impl Patience {
    /// Retries for up to `window`, from 200 ms between tries up to 10 s.
    pub fn new(window: Duration) -> Self {
        Self { window, first_delay: Duration::from_millis(200), max_delay: Duration::from_secs(10), watcher: None }
    }

    /// The same patience, telling `watcher` of a wait past the window instead of giving up.
    pub fn watched_by(self, watcher: Arc<dyn Watcher>) -> Self {
        Self { watcher: Some(watcher), ..self }
    }

    /// No retries at all.
    pub fn none() -> Self {
        Self::new(Duration::ZERO)
    }

    /// The delays before the retries: from `first_delay` doubling up to `max_delay`, each
    /// between half and all of that (jitter), so that many waiting clients do not come back
    /// at the same instant.
    pub fn delays(&self) -> impl Iterator<Item = Duration> + use<> {
        use backon::BackoffBuilder;
        backon::ExponentialBuilder::new()
            .with_min_delay(self.first_delay / 2)
            .with_max_delay(self.max_delay / 2)
            .with_jitter()
            .without_max_times()
            .build()
    }

    /// Runs `op` until it succeeds, fails in a way `transient` does not forgive, or the
    /// window has passed (and the watcher, if any, stops wanting to wait); then returns its
    /// last outcome. Each retry is logged with `what`.
    pub async fn retry<T, E, F, Fut>(&self, what: &str, transient: impl Fn(&E) -> bool, mut op: F) -> Result<T, E>
    where
        E: std::fmt::Display,
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let started = Instant::now();
        let mut attempt = 0;
        let mut delays = self.delays();
        // Set while this call is one the watcher counts as waiting; ends the wait on drop,
        // so a call that is itself dropped (its caller went away) ends it too.
        let mut waiting: Option<WaitGuard<'_>> = None;
        loop {
            let e = match op().await {
                Err(e) if transient(&e) => e,
                other => return other,
            };
            if started.elapsed() >= self.window {
                let Some(watcher) = &self.watcher else { return Err(e) };
                if waiting.is_none() {
                    tracing::warn!(waited_s = started.elapsed().as_secs_f64(), "{what}: still waiting: {e}");
                    watcher.wait_started(&format!("{what}: {e}"));
                    waiting = Some(WaitGuard(watcher.as_ref()));
                }
                if !watcher.keep_waiting() {
                    return Err(e);
                }
            }
            attempt += 1;
            let delay = delays.next().unwrap_or(self.max_delay);
            if waiting.is_none() {
                tracing::warn!(
                    attempt,
                    waited_s = started.elapsed().as_secs_f64(),
                    "{what}: waiting, then retrying: {e}"
                );
            }
            tokio::time::sleep(delay).await;
        }
    }
}

/// Ends a watched wait when dropped.
struct WaitGuard<'a>(&'a dyn Watcher);

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        self.0.wait_ended();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[test]
    fn delays_double_up_to_the_cap_with_jitter_between_half_and_all() {
        let p = Patience::new(Duration::from_secs(60));
        let nominal = |attempt: u32| Duration::from_millis(200 << attempt.min(6)).min(Duration::from_secs(10));
        for _ in 0..50 {
            for (attempt, delay) in p.delays().take(40).enumerate() {
                let full = nominal(attempt as u32);
                assert!(
                    delay >= full / 2 && delay <= full,
                    "retry {attempt}: {delay:?} outside [{:?}, {full:?}]",
                    full / 2
                );
            }
        }
        let firsts: Vec<Duration> = (0..200).map(|_| p.delays().next().unwrap()).collect();
        let (low, high) = (Duration::from_millis(130), Duration::from_millis(170));
        assert!(firsts.iter().any(|&d| d < low) && firsts.iter().any(|&d| d > high), "jitter spreads");
    }

    #[tokio::test(start_paused = true)]
    async fn transient_failures_are_retried_within_the_window_and_others_are_not() {
        let p = Patience::new(Duration::from_secs(30));
        let tries = AtomicU32::new(0);
        let outcome: Result<u32, String> = p
            .retry(
                "flaky",
                |e: &String| e == "down",
                || async {
                    let n = tries.fetch_add(1, Ordering::Relaxed) + 1;
                    if n < 5 { Err("down".to_string()) } else { Ok(n) }
                },
            )
            .await;
        assert_eq!(outcome, Ok(5));
        tries.store(0, Ordering::Relaxed);
        let outcome: Result<u32, String> =
            p.retry("broken", |e: &String| e == "down", || async { Err::<u32, _>("bad request".to_string()) }).await;
        assert_eq!(outcome, Err("bad request".into()));
        let started = tokio::time::Instant::now();
        let outcome: Result<u32, String> = p
            .retry(
                "gone",
                |_| true,
                || async {
                    tries.fetch_add(1, Ordering::Relaxed);
                    Err::<u32, _>("down".to_string())
                },
            )
            .await;
        assert!(outcome.is_err());
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(30) && waited < Duration::from_secs(41),
            "gave up after the window: {waited:?}"
        );
        assert!(tries.load(Ordering::Relaxed) > 3);
        let none: Result<u32, String> = Patience::none().retry("once", |_| true, || async { Err("down".into()) }).await;
        assert!(none.is_err());
    }

    #[derive(Debug, Default)]
    struct Counting {
        started: AtomicU32,
        ended: AtomicU32,
        give_up: std::sync::atomic::AtomicBool,
    }

    impl Watcher for Counting {
        fn wait_started(&self, reason: &str) {
            assert!(reason.starts_with("store: down"), "{reason}");
            self.started.fetch_add(1, Ordering::Relaxed);
        }
        fn keep_waiting(&self) -> bool {
            !self.give_up.load(Ordering::Relaxed)
        }
        fn wait_ended(&self) {
            self.ended.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// With a watcher, a wait past the window is reported once, goes on (here for ten
    /// minutes of outage) and is reported ended when the service answers; a watcher that
    /// stops wanting to wait ends it with the last error.
    #[tokio::test(start_paused = true)]
    async fn a_watched_wait_outlasts_the_window_until_the_service_is_back_or_the_watcher_stops_it() {
        let watcher = Arc::new(Counting::default());
        let p = Patience::new(Duration::from_secs(5)).watched_by(watcher.clone());
        let started = tokio::time::Instant::now();
        let back_at = Duration::from_secs(600);
        let outcome: Result<&str, String> = p
            .retry(
                "store",
                |_| true,
                || async move { if started.elapsed() < back_at { Err("down".to_string()) } else { Ok("up") } },
            )
            .await;
        assert_eq!(outcome, Ok("up"));
        assert!(started.elapsed() < back_at + Duration::from_secs(11), "retries at most 10 s apart while waiting");
        assert_eq!(watcher.started.load(Ordering::Relaxed), 1);
        assert_eq!(watcher.ended.load(Ordering::Relaxed), 1);

        watcher.give_up.store(true, Ordering::Relaxed);
        let outcome: Result<&str, String> = p.retry("store", |_| true, || async { Err("down".to_string()) }).await;
        assert_eq!(outcome, Err("down".into()));
        assert_eq!(watcher.started.load(Ordering::Relaxed), 2);
        assert_eq!(watcher.ended.load(Ordering::Relaxed), 2, "every started wait ends");
    }
}
