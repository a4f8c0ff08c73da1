//! Waiting out a service that is briefly gone: exponential backoff with jitter, bounded by a
//! patience window. A restart, a deploy or a network blip should cost a run a pause, not one
//! of its attempts.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// How long to keep retrying, and how fast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Patience {
    /// No retry starts after this much time since the first try.
    pub window: Duration,
    /// The delay before the first retry; each later one doubles, up to `max_delay`.
    pub first_delay: Duration,
    pub max_delay: Duration,
}

impl Patience {
    /// Retries for up to `window`, from 200 ms between tries up to 10 s.
    pub fn new(window: Duration) -> Self {
        Self { window, first_delay: Duration::from_millis(200), max_delay: Duration::from_secs(10) }
    }

    /// No retries at all.
    pub fn none() -> Self {
        Self::new(Duration::ZERO)
    }

    /// The delay before retry `attempt` (1 for the first): the capped exponential delay
    /// scaled by `jitter` in [0, 1) to between half and all of it, so that many waiting
    /// clients do not come back at the same instant.
    pub fn delay(&self, attempt: u32, jitter: f64) -> Duration {
        let exponential = self.first_delay.saturating_mul(1u32 << attempt.saturating_sub(1).min(20));
        exponential.min(self.max_delay).mul_f64(0.5 + 0.5 * jitter.clamp(0.0, 1.0))
    }

    /// Runs `op` until it succeeds, fails in a way `transient` does not forgive, or the
    /// window has passed; then returns its last outcome. Each retry is logged with `what`.
    pub async fn retry<T, E, F, Fut>(&self, what: &str, transient: impl Fn(&E) -> bool, mut op: F) -> Result<T, E>
    where
        E: std::fmt::Display,
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let started = Instant::now();
        let mut attempt = 0;
        loop {
            match op().await {
                Err(e) if transient(&e) && started.elapsed() < self.window => {
                    attempt += 1;
                    let delay = self.delay(attempt, jitter());
                    tracing::warn!(
                        attempt,
                        waited_s = started.elapsed().as_secs_f64(),
                        "{what}: waiting, then retrying: {e}"
                    );
                    tokio::time::sleep(delay).await;
                }
                other => return other,
            }
        }
    }
}

/// A number in [0, 1) that differs between calls and processes (no RNG state to share).
fn jitter() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher
        .write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[test]
    fn delays_double_up_to_the_cap_with_jitter_between_half_and_all() {
        let p = Patience::new(Duration::from_secs(60));
        assert!((199..=200).contains(&p.delay(1, 1.0 - f64::EPSILON).as_millis()));
        assert_eq!(p.delay(1, 0.0), Duration::from_millis(100));
        assert_eq!(p.delay(3, 0.0), Duration::from_millis(400));
        assert_eq!(p.delay(12, 0.0), Duration::from_secs(5), "capped at 10 s, halved by the jitter");
        assert_eq!(p.delay(40, 0.5), Duration::from_millis(7500), "no overflow far out");
        let spread: Vec<f64> = (0..200).map(|_| jitter()).collect();
        assert!(spread.iter().all(|j| (0.0..1.0).contains(j)));
        assert!(spread.iter().any(|&j| j < 0.3) && spread.iter().any(|&j| j > 0.7), "jitter spreads");
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
}
