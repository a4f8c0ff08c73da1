//! The NATS side: `<prefix>.reward.score` and `<prefix>.reward.env.step` in the queue group
//! `reward`, so any replica may answer. Bodies are the REST bodies; replies use the
//! `{"ok": ...}` / `{"error": {"type", "message"}}` envelope. A bad message gets an error
//! reply and never stops the subscription. On shutdown the subscriptions stop taking
//! messages and the requests being scored are finished and answered.

use futures::StreamExt;
use keel_protocol::reward::{EnvStepRequest, REWARD_QUEUE_GROUP, ScoreRequest, error_types};
use keel_protocol::subjects::QueueCall;
use keel_protocol::{Reply, Subjects};
use serde::Serialize;
use tracing::{info, warn};

use keel_environments::scoring::{Scorer, parse};

fn envelope<T: Serialize>(result: keel_environments::scoring::Result<T>) -> Vec<u8> {
    let reply = match result {
        Ok(value) => Reply::Ok(value),
        Err(e) => Reply::error(e.kind(), e.to_string()),
    };
    serde_json::to_vec(&reply).unwrap_or_default()
}

/// Serves both subjects until they end or `shutdown` completes.
pub async fn serve(
    client: async_nats::Client,
    subjects: Subjects,
    scorer: Scorer,
    shutdown: impl std::future::Future<Output = ()>,
) -> keel_service::Result<()> {
    use keel_service::Error;
    let subscribe = |subject: String| {
        let client = client.clone();
        async move {
            client
                .queue_subscribe(subject.clone(), REWARD_QUEUE_GROUP.to_string())
                .await
                .map_err(|e| Error::Subscribe { subject, reason: e.to_string() })
        }
    };
    let setup = async {
        let scores = subscribe(ScoreRequest::subject(&subjects)).await?;
        let steps = subscribe(EnvStepRequest::subject(&subjects)).await?;
        client.flush().await.map_err(|e| Error::start("flush NATS", e))?;
        Ok::<_, Error>((scores, steps))
    };
    tokio::pin!(shutdown);
    // A stop that comes while subscribing (the HTTP part may already be serving) ends it: a
    // NATS that went away meanwhile would hold the flush for ever.
    let (mut scores, mut steps) = tokio::select! {
        subscribed = setup => subscribed?,
        () = &mut shutdown => return Ok(()),
    };
    info!(score = %subjects.reward_score(), step = %subjects.reward_env_step(), "serving rewards");
    let mut in_flight = tokio::task::JoinSet::new();
    loop {
        while in_flight.try_join_next().is_some() {}
        let (message, is_step) = tokio::select! {
            () = &mut shutdown => break,
            message = scores.next() => (message, false),
            message = steps.next() => (message, true),
        };
        let Some(message) = message else { return Err(Error::PartStopped("a reward subscription")) };
        let (scorer, client) = (scorer.clone(), client.clone());
        in_flight.spawn(async move {
            let operation = if is_step { "reward.env_step" } else { "reward.score" };
            let body = keel_service::nats::served(&client, operation, &message, async {
                if is_step {
                    let request = parse::<EnvStepRequest>(&message.payload);
                    envelope::<<EnvStepRequest as QueueCall>::Reply>(async { scorer.step(request?).await }.await)
                } else {
                    let request = parse::<ScoreRequest>(&message.payload);
                    envelope::<<ScoreRequest as QueueCall>::Reply>(async { scorer.score(request?).await }.await)
                }
            })
            .await;
            let limit = client.server_info().max_payload;
            let body = if body.len() > limit {
                let message =
                    format!("the reply is {} bytes, over NATS's {limit}: send fewer samples per request", body.len());
                serde_json::to_vec(&Reply::<()>::error(error_types::TOO_LARGE, message)).unwrap_or_default()
            } else {
                body
            };
            if let Some(to) = message.reply
                && let Err(e) = client.publish(to, body.into()).await
            {
                warn!("cannot send a reward reply: {e}");
            }
        });
    }
    // Finish what is in flight and send its replies — but a NATS that is gone would hold
    // the unsubscribe and the flush forever, and a stopping service must stop.
    let connected = || client.connection_state() == async_nats::connection::State::Connected;
    let drain = async {
        if connected() {
            for subscription in [&mut scores, &mut steps] {
                if let Err(e) = subscription.unsubscribe().await {
                    warn!("cannot unsubscribe: {e}");
                }
            }
        }
        while in_flight.join_next().await.is_some() {}
        if connected() { client.flush().await.map_err(|e| Error::start("flush NATS", e)) } else { Ok(()) }
    };
    match tokio::time::timeout(DRAIN_LIMIT, drain).await {
        Ok(drained) => drained,
        Err(_) => {
            warn!("stopping without sending every reply: NATS did not take them within {DRAIN_LIMIT:?}");
            Ok(())
        }
    }
}

/// How long a stopping service waits for in-flight requests and their replies.
const DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);
