//! The orchestrator's side of the NATS protocols: a claimed trainer worker, claimed
//! generators and the rollouts of the generators a run holds, and environment steps from the
//! reward queue group. Requests to
//! a queue group that time out or are refused as `unavailable` are retried with backoff, so
//! a dead or overloaded replica's work goes to another; while nobody serves the group at
//! all (every replica restarting, a model still loading) the request is retried with
//! backoff and jitter for the configured patience, without spending a retry.

use std::time::Duration;

use keel_protocol::generator::{GeneratorCall, LoadModel, ModelLoaded, RolloutReply, RolloutRequest};
use keel_protocol::lease::{ClaimReply, ClaimRequest, HeartbeatReply, HeartbeatRequest, ReleaseRequest, Released};
use keel_protocol::subjects::{GeneratorOp, QueueCall, TrainerOp};
use keel_protocol::trainer::TrainerCall;
use keel_protocol::{ErrorBody, Reply, Subjects};
use keel_service::nats::Bulk;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::Instrument;

/// Why a request got no useful answer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CallError {
    /// Nobody answered in time (worth another try: the work may be lost).
    #[error("{subject}: no answer: {message}")]
    NoAnswer { subject: String, message: String },
    /// Nobody serves the subject, or NATS is unreachable: worth waiting for.
    #[error("{subject}: nobody serves it: {message}")]
    Absent { subject: String, message: String },
    /// The service refused with a typed error.
    #[error("{subject}: {body}")]
    Refused { subject: String, body: ErrorBody },
    #[error("{subject}: {message}")]
    Malformed { subject: String, message: String },
}

impl CallError {
    /// The refusal's error type, if the service refused.
    pub fn kind(&self) -> Option<&str> {
        match self {
            Self::Refused { body, .. } => Some(&body.kind),
            _ => None,
        }
    }

    /// A full replica: worth waiting for, however long its queue takes to drain.
    fn busy(&self) -> bool {
        self.kind() == Some("unavailable")
    }
}

/// NATS with the run's subjects, bulk bucket and limits.
#[derive(Debug, Clone)]
pub struct Nats {
    pub client: async_nats::Client,
    pub subjects: Subjects,
    pub bulk: Bulk,
    pub timeout: Duration,
    pub retries: u32,
    /// How long a queue-group request waits for the group to come back when nobody serves it.
    pub patience: keel_client::retry::Patience,
}

impl Nats {
    /// One request and its `{"ok"}`/`{"error"}` reply.
    pub async fn call<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        subject: String,
        body: &Req,
        timeout: Duration,
    ) -> Result<Rep, CallError> {
        self.call_as(subject, body, timeout, None).await
    }

    /// [`Nats::call`] on behalf of `holder` (a run's claim of a worker, sent in
    /// [`keel_protocol::lease::HOLDER_HEADER`]).
    pub async fn call_as<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        subject: String,
        body: &Req,
        timeout: Duration,
        holder: Option<uuid::Uuid>,
    ) -> Result<Rep, CallError> {
        let bytes = serde_json::to_vec(body)
            .map_err(|e| CallError::Malformed { subject: subject.clone(), message: format!("cannot encode: {e}") })?;
        // Summarised work (validation) makes no span per request (see keel_telemetry).
        let span = if keel_telemetry::quiet() {
            tracing::Span::none()
        } else {
            tracing::info_span!(
                "nats.client",
                otel.name = %subject,
                otel.kind = "client",
                messaging.system = "nats",
                messaging.destination.name = %subject,
                messaging.message.body.size = bytes.len(),
            )
        };
        let mut headers = span.in_scope(keel_telemetry::nats_headers);
        if let Some(holder) = holder {
            headers.insert(keel_protocol::lease::HOLDER_HEADER, holder.to_string().as_str());
        }
        let started = std::time::Instant::now();
        let request = keel_service::nats::request(&self.client, subject.clone(), headers, bytes, timeout);
        let result = match request.instrument(span).await {
            Err(e) if e.kind() == async_nats::RequestErrorKind::TimedOut => {
                let message = match std::error::Error::source(&e) {
                    // It went silent mid-request (see `keel_service::nats::SILENCE_LIMIT`).
                    Some(why) => why.to_string(),
                    None => format!("no reply within {:.0} s", timeout.as_secs_f64()),
                };
                Err(CallError::NoAnswer { subject, message })
            }
            Err(e) => Err(CallError::Absent { subject, message: e.to_string() }),
            Ok(message) => match serde_json::from_slice::<Reply<Rep>>(&message.payload) {
                Ok(Reply::Ok(reply)) => Ok(reply),
                Ok(Reply::Error(body)) => Err(CallError::Refused { subject, body }),
                Err(e) => Err(CallError::Malformed { subject, message: format!("unexpected reply: {e}") }),
            },
        };
        keel_telemetry::count_request(started.elapsed().as_secs_f64(), result.is_err());
        result
    }

    /// [`Nats::call`] to a queue group: a request nobody answered is retried (another
    /// replica takes it) up to `retries` times with exponential backoff; one refused because
    /// every replica is full is retried until the request timeout has passed.
    pub async fn call_group<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        subject: String,
        body: &Req,
    ) -> Result<Rep, CallError> {
        let absent = |e: &CallError| matches!(e, CallError::Absent { .. });
        self.patience.retry("NATS request", absent, || self.call_group_once(subject.clone(), body)).await
    }

    async fn call_group_once<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        subject: String,
        body: &Req,
    ) -> Result<Rep, CallError> {
        use backon::BackoffBuilder;
        let started = std::time::Instant::now();
        let (mut lost, mut busy) = (0u32, 0u32);
        // A lost request waits 0.4 s, doubling to 6.4 s; a full group 0.1 s, doubling to 2 s.
        let wait = |first: u64, last: u64| {
            let (first, last) = (Duration::from_millis(first), Duration::from_millis(last));
            backon::ExponentialBuilder::new().with_min_delay(first).with_max_delay(last).without_max_times().build()
        };
        let (mut lost_waits, mut busy_waits) = (wait(400, 6400), wait(100, 2000));
        loop {
            match self.call(subject.clone(), body, self.timeout).await {
                Err(e @ CallError::NoAnswer { .. }) if lost < self.retries => {
                    lost += 1;
                    tracing::warn!(attempt = lost, "retrying: {e}");
                    tokio::time::sleep(lost_waits.next().unwrap_or(Duration::from_millis(6400))).await;
                }
                Err(e) if e.busy() && started.elapsed() < self.timeout => {
                    busy += 1;
                    tracing::debug!(attempt = busy, "waiting for a free replica: {e}");
                    tokio::time::sleep(busy_waits.next().unwrap_or(Duration::from_secs(2))).await;
                }
                other => return other,
            }
        }
    }

    /// A queue group's operation, named by its request's type and answered with its reply
    /// (a rollout, an environment step).
    pub async fn ask<R: QueueCall>(&self, request: &R) -> Result<R::Reply, CallError> {
        self.call_group(R::subject(&self.subjects), request).await
    }

    /// Claims a free worker on `subject` (a kind's claim queue group, or one worker's own
    /// claim subject) for `run_id` as `holder` (the claim of the run whose requests it will
    /// take): its id, or None when none is free.
    async fn claim(
        &self,
        subject: String,
        run_id: &str,
        lease_seconds: f64,
        holder: uuid::Uuid,
    ) -> Result<Option<String>, CallError> {
        let request = ClaimRequest { run_id: run_id.to_string(), lease_seconds, holder: Some(holder.to_string()) };
        match self.call::<_, ClaimReply>(subject, &request, Duration::from_secs(10)).await {
            Ok(reply) => Ok(Some(reply.worker_id)),
            Err(CallError::NoAnswer { .. } | CallError::Absent { .. }) => Ok(None),
            Err(e) if e.kind() == Some("busy") => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Claims `previous` again when it is given and still holds the run (a worker the run held
    /// before), else any free worker of its kind.
    async fn claim_again_or_any(
        &self,
        own: Option<String>,
        any: String,
        run_id: &str,
        lease_seconds: f64,
        holder: uuid::Uuid,
    ) -> Result<Option<String>, CallError> {
        if let Some(subject) = own
            && let Ok(Some(id)) = self.claim(subject, run_id, lease_seconds, holder).await
        {
            return Ok(Some(id));
        }
        self.claim(any, run_id, lease_seconds, holder).await
    }

    /// Claims a trainer worker for `run_id` as `holder`: `previous` (the worker it held
    /// before) when that one renews the claim, else any free one (None when none is free).
    pub async fn claim_trainer(
        &self,
        run_id: &str,
        previous: Option<&str>,
        lease_seconds: f64,
        holder: uuid::Uuid,
    ) -> Result<Option<Trainer>, CallError> {
        let own = previous.map(|w| self.subjects.trainer(w, TrainerOp::Claim));
        let claimed =
            self.claim_again_or_any(own, self.subjects.trainer_claim(), run_id, lease_seconds, holder).await?;
        Ok(claimed.map(|worker| {
            let (heartbeat, release) = (
                self.subjects.trainer(&worker, TrainerOp::Heartbeat),
                self.subjects.trainer(&worker, TrainerOp::Release),
            );
            Trainer(Held::new(self.clone(), worker, run_id, holder, heartbeat, release))
        }))
    }

    /// Claims a generator for `run_id` as `holder`, as [`Nats::claim_trainer`] does a trainer.
    pub async fn claim_generator(
        &self,
        run_id: &str,
        previous: Option<&str>,
        lease_seconds: f64,
        holder: uuid::Uuid,
    ) -> Result<Option<Generator>, CallError> {
        let own = previous.map(|g| self.subjects.generator(g, GeneratorOp::Claim));
        let claimed =
            self.claim_again_or_any(own, self.subjects.generator_claim(), run_id, lease_seconds, holder).await?;
        Ok(claimed.map(|id| {
            let (heartbeat, release) = (
                self.subjects.generator(&id, GeneratorOp::Heartbeat),
                self.subjects.generator(&id, GeneratorOp::Release),
            );
            Generator(Held::new(self.clone(), id, run_id, holder, heartbeat, release))
        }))
    }

    /// A rollout from the generators run `request.run_id` holds.
    pub async fn rollout(&self, request: &RolloutRequest) -> Result<RolloutReply, CallError> {
        self.call_group(self.subjects.generate(&request.run_id), request).await
    }
}

/// A worker a run holds (a trainer worker or a generator): every request names the run's
/// holder, and the claim is renewed by heartbeats and given back by a release.
#[derive(Debug, Clone)]
pub struct Held {
    nats: Nats,
    pub worker: String,
    pub run_id: String,
    /// The claim of the run this is (every request carries it; the worker refuses a claim
    /// that a newer one replaced).
    pub holder: uuid::Uuid,
    /// The worker's heartbeat and release subjects.
    heartbeat: String,
    release: String,
}

impl Held {
    fn new(nats: Nats, worker: String, run_id: &str, holder: uuid::Uuid, heartbeat: String, release: String) -> Self {
        Self { nats, worker, run_id: run_id.to_string(), holder, heartbeat, release }
    }

    async fn heartbeat(&self) -> Result<HeartbeatReply, CallError> {
        let request = HeartbeatRequest { run_id: self.run_id.clone() };
        self.call(self.heartbeat.clone(), &request, Duration::from_secs(10)).await
    }

    async fn release(&self) {
        let request = ReleaseRequest { run_id: self.run_id.clone() };
        if let Err(e) = self.call::<_, Released>(self.release.clone(), &request, Duration::from_secs(10)).await {
            tracing::warn!(worker = %self.worker, "release failed (the lease will expire): {e}");
        }
    }

    fn call<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        subject: String,
        request: &Req,
        timeout: Duration,
    ) -> impl std::future::Future<Output = Result<Rep, CallError>> {
        self.nats.call_as(subject, request, timeout, Some(self.holder))
    }
}

/// A trainer worker this run holds.
#[derive(Debug, Clone)]
pub struct Trainer(Held);

impl Trainer {
    pub fn worker(&self) -> &str {
        &self.0.worker
    }

    /// The same worker, reached through `nats` (the run's own, which reports its waits).
    pub fn with_nats(self, nats: Nats) -> Self {
        Self(Held { nats, ..self.0 })
    }

    fn call<R: TrainerCall>(
        &self,
        request: &R,
        timeout: Duration,
    ) -> impl std::future::Future<Output = Result<R::Reply, CallError>> {
        self.0.call(self.0.nats.subjects.trainer(&self.0.worker, R::OP), request, timeout)
    }

    /// One operation on the worker, named by its request's type, answered with that
    /// operation's reply; loads and training steps may take long, so the timeout is the
    /// configured one (not the claim's).
    pub async fn op<R: TrainerCall>(&self, request: &R) -> Result<R::Reply, CallError> {
        self.call(request, self.0.nats.timeout).await
    }

    pub async fn heartbeat(&self) -> Result<HeartbeatReply, CallError> {
        self.0.heartbeat().await
    }

    pub async fn release(&self) {
        self.0.release().await
    }

    pub fn bulk(&self) -> &Bulk {
        &self.0.nats.bulk
    }
}

/// A generator this run holds.
#[derive(Debug, Clone)]
pub struct Generator(Held);

impl Generator {
    pub fn id(&self) -> &str {
        &self.0.worker
    }

    /// The same generator, reached through `nats` (the run's own, which reports its waits).
    pub fn with_nats(self, nats: Nats) -> Self {
        Self(Held { nats, ..self.0 })
    }

    fn call<R: GeneratorCall>(
        &self,
        request: &R,
        timeout: Duration,
    ) -> impl std::future::Future<Output = Result<R::Reply, CallError>> {
        self.0.call(self.0.nats.subjects.generator(&self.0.worker, R::OP), request, timeout)
    }

    /// Has the generator load the run's model (as long as the configured request timeout).
    pub async fn load(&self, request: &LoadModel) -> Result<ModelLoaded, CallError> {
        self.op(request).await
    }

    /// One operation on the generator, named by its request's type (the configured request
    /// timeout).
    pub async fn op<R: GeneratorCall>(&self, request: &R) -> Result<R::Reply, CallError> {
        self.call(request, self.0.nats.timeout).await
    }

    pub async fn heartbeat(&self) -> Result<HeartbeatReply, CallError> {
        self.0.heartbeat().await
    }

    pub async fn release(&self) {
        self.0.release().await
    }
}
