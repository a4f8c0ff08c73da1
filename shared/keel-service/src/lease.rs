//! A claimed worker's side of its claim (trainer workers and generators alike; the protocol
//! is `keel_protocol::lease`): which run holds it and for which holder, its lease, and the
//! requests in flight. Every admitted request and heartbeat renews the lease; a lease that
//! runs out with nothing in flight is taken back by [`Leases::take_expired`].

use std::sync::Mutex;
use std::time::{Duration, Instant};

use keel_protocol::ErrorBody;
use keel_protocol::lease::{ClaimReply, ClaimRequest, HeartbeatReply, error_types};

/// The claim a run holds.
#[derive(Debug, Clone)]
pub struct Claim {
    pub run_id: String,
    /// The run's current holder of the claim, when the run named one: requests naming
    /// another are refused.
    pub holder: Option<String>,
    pub lease: Duration,
    pub deadline: Instant,
    pub in_flight: usize,
    /// Whether the run's models are loaded (heartbeats report it).
    pub loaded: bool,
}

/// One worker's claim, shared by its request tasks.
#[derive(Debug)]
pub struct Leases {
    /// The worker's id.
    worker_id: String,
    /// How refusals name the worker (`worker <id>`, `generator <id>`).
    named: String,
    /// The longest lease a claim may ask for, in seconds.
    max_lease: f64,
    claim: Mutex<Option<Claim>>,
}

fn refuse(kind: &str, message: impl std::fmt::Display) -> ErrorBody {
    ErrorBody { kind: kind.to_string(), message: message.to_string() }
}

impl Leases {
    /// The claim of `kind` (`worker`, `generator`) `worker_id`, whose leases last at most
    /// `max_lease` seconds.
    pub fn new(kind: &str, worker_id: impl Into<String>, max_lease: f64) -> Self {
        let worker_id = worker_id.into();
        Self { named: format!("{kind} {worker_id}"), worker_id, max_lease, claim: Mutex::new(None) }
    }

    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Claim>> {
        self.claim.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn is_claimed(&self) -> bool {
        self.lock().is_some()
    }

    /// The claim held now, if any.
    pub fn current(&self) -> Option<Claim> {
        self.lock().clone()
    }

    /// Claims the worker for `request`'s run, or renews the claim that run holds (a new
    /// holder takes it over). Refused as `busy` while another run holds it.
    pub fn claim(&self, request: ClaimRequest) -> Result<ClaimReply, ErrorBody> {
        let seconds = request.lease_seconds;
        if !(seconds.is_finite() && seconds > 0.0 && seconds <= self.max_lease) {
            return Err(refuse(
                keel_protocol::trainer::error_types::INVALID_REQUEST,
                format!("lease_seconds must be in (0, {}], got {seconds}", self.max_lease),
            ));
        }
        let lease = Duration::from_secs_f64(seconds);
        let mut claim = self.lock();
        match claim.as_mut() {
            Some(held) if held.run_id != request.run_id => {
                return Err(refuse(error_types::BUSY, format!("{} is held by run {}", self.named, held.run_id)));
            }
            Some(held) => {
                if request.holder.is_some() && held.holder != request.holder {
                    tracing::info!(run_id = %request.run_id, holder = ?request.holder, "claimed again by a new holder");
                    held.holder = request.holder;
                }
                held.lease = lease;
                held.deadline = Instant::now() + lease;
            }
            None => {
                tracing::info!(run_id = %request.run_id, "claimed");
                *claim = Some(Claim {
                    run_id: request.run_id,
                    holder: request.holder,
                    lease,
                    deadline: Instant::now() + lease,
                    in_flight: 0,
                    loaded: false,
                });
            }
        }
        Ok(ClaimReply { worker_id: self.worker_id.clone(), lease_seconds: seconds })
    }

    /// Admits a request of `run_id` made for `holder`: they must hold the claim. Counts it
    /// as in flight until [`Leases::finish`].
    pub fn admit(&self, run_id: &str, holder: Option<&str>) -> Result<(), ErrorBody> {
        let mut claim = self.lock();
        match claim.as_mut() {
            Some(held) if held.run_id == run_id => {
                stale_holder(held, holder)?;
                held.in_flight += 1;
                Ok(())
            }
            Some(held) => Err(refuse(
                error_types::WRONG_RUN,
                format!("{} is held by run {}, not {run_id}", self.named, held.run_id),
            )),
            None => Err(refuse(error_types::WRONG_RUN, format!("{} is not claimed by run {run_id}", self.named))),
        }
    }

    /// Ends an admitted request; the lease runs from now.
    pub fn finish(&self, run_id: &str) {
        if let Some(held) = self.lock().as_mut().filter(|c| c.run_id == run_id) {
            held.in_flight = held.in_flight.saturating_sub(1);
            held.deadline = Instant::now() + held.lease;
        }
    }

    /// Records whether `run_id`'s models are loaded (reported by heartbeats).
    pub fn set_loaded(&self, run_id: &str, loaded: bool) {
        if let Some(held) = self.lock().as_mut().filter(|c| c.run_id == run_id) {
            held.loaded = loaded;
        }
    }

    /// The heartbeat's answer: the lease and whether the models are loaded.
    pub fn heartbeat(&self) -> Result<HeartbeatReply, ErrorBody> {
        let claim = self.lock();
        let held = claim.as_ref().ok_or_else(|| refuse(error_types::WRONG_RUN, "the claim was released"))?;
        Ok(HeartbeatReply { lease_seconds: held.lease.as_secs_f64(), loaded: held.loaded })
    }

    /// Takes the claim back when its lease ran out with nothing in flight.
    pub fn take_expired(&self) -> Option<Claim> {
        let mut claim = self.lock();
        match claim.as_ref() {
            Some(held) if held.in_flight == 0 && Instant::now() >= held.deadline => claim.take(),
            _ => None,
        }
    }

    /// Ends `run_id`'s claim, when that run holds it for `holder`.
    pub fn release(&self, run_id: &str, holder: Option<&str>) -> Result<Claim, ErrorBody> {
        let mut claim = self.lock();
        match claim.as_ref() {
            Some(held) if held.run_id == run_id => {
                stale_holder(held, holder)?;
                claim.take().ok_or_else(|| refuse(error_types::WRONG_RUN, "the claim was released"))
            }
            _ => Err(refuse(error_types::WRONG_RUN, format!("run {run_id} does not hold {}", self.named))),
        }
    }
}

/// Refuses a request made for a holder of the run other than the claim's current one.
fn stale_holder(held: &Claim, holder: Option<&str>) -> Result<(), ErrorBody> {
    match held.holder.as_deref() {
        Some(current) if holder != Some(current) => Err(refuse(
            error_types::STALE_HOLDER,
            format!(
                "run {} claimed this worker again as {current}; a request for {} is refused",
                held.run_id,
                holder.unwrap_or("no holder")
            ),
        )),
        _ => Ok(()),
    }
}

/// A worker's place in its kind's claim queue group (`<prefix>.trainer.claim`,
/// `<prefix>.generator.claim`): in it while free, so a claim reaches exactly one free
/// worker; out of it while held (or otherwise unable to take a run).
#[derive(Debug)]
pub struct ClaimGroup {
    client: async_nats::Client,
    subject: String,
    queue: String,
    subscription: Option<async_nats::Subscriber>,
}

impl ClaimGroup {
    /// Out of the group until [`ClaimGroup::set_free`] says the worker is free.
    pub fn new(client: async_nats::Client, subject: String, queue: &str) -> Self {
        Self { client, subject, queue: queue.to_string(), subscription: None }
    }

    /// Joins the group when `free` and the worker is out of it, leaves it when not.
    pub async fn set_free(&mut self, free: bool) -> Result<(), crate::Error> {
        match (free, self.subscription.is_some()) {
            (false, true) => {
                if let Some(mut subscription) = self.subscription.take() {
                    let _ = subscription.unsubscribe().await;
                }
            }
            (true, false) => {
                let joined = self.client.queue_subscribe(self.subject.clone(), self.queue.clone()).await;
                let failed = |e: async_nats::SubscribeError| crate::Error::Subscribe {
                    subject: self.subject.clone(),
                    reason: e.to_string(),
                };
                self.subscription = Some(joined.map_err(failed)?);
            }
            _ => {}
        }
        Ok(())
    }

    /// The next claim, while in the group (never, while out of it).
    pub async fn next(&mut self) -> Option<async_nats::Message> {
        use futures::StreamExt;
        match self.subscription.as_mut() {
            Some(subscription) => subscription.next().await,
            None => std::future::pending().await,
        }
    }
}

/// The holder named in a request's [`keel_protocol::lease::HOLDER_HEADER`].
pub fn holder_of(message: &async_nats::Message) -> Option<String> {
    message.headers.as_ref().and_then(|h| h.get(keel_protocol::lease::HOLDER_HEADER)).map(|v| v.as_str().to_string())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn claim(run: &str, holder: &str, seconds: f64) -> ClaimRequest {
        ClaimRequest { run_id: run.into(), lease_seconds: seconds, holder: Some(holder.into()) }
    }

    /// One run at a time; the same run's new holder takes over and the old one is refused;
    /// a lease with a request in flight does not expire.
    #[test]
    fn a_claim_is_one_runs_and_its_newest_holders() {
        let leases = Leases::new("generator", "g1", 60.0);
        leases.claim(claim("a", "h1", 30.0)).unwrap();
        assert_eq!(leases.claim(claim("b", "h9", 30.0)).unwrap_err().kind, "busy");
        leases.claim(claim("a", "h2", 30.0)).unwrap();
        assert_eq!(leases.admit("a", Some("h1")).unwrap_err().kind, "stale_holder");
        assert_eq!(leases.admit("b", Some("h2")).unwrap_err().kind, "wrong_run");
        leases.admit("a", Some("h2")).unwrap();
        assert!(leases.release("a", Some("h1")).is_err());
        assert_eq!(leases.claim(claim("a", "h2", 90.0)).unwrap_err().kind, "invalid_request");

        let short = Leases::new("generator", "g2", 60.0);
        short.claim(claim("a", "h", 0.001)).unwrap();
        short.admit("a", Some("h")).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert!(short.take_expired().is_none(), "a request is in flight");
        short.finish("a");
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(short.take_expired().unwrap().run_id, "a");
        assert!(!short.is_claimed());
    }
}
