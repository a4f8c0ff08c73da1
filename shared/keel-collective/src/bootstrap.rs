//! Bringing up a group whose ranks live in several processes (or machines): rank 0 makes
//! the group's id (for NCCL, its [`crate::nccl::UniqueId`]) and answers requests for it on
//! a NATS subject until every other rank has it; the others ask until rank 0 answers.

use std::time::{Duration, Instant};

use futures::StreamExt;

use crate::{Error, Result};

/// The longest a rank waits between asking for the id while rank 0 is not yet listening
/// (the waits grow to it from 1 ms).
const RETRY: Duration = Duration::from_millis(100);

/// Shares rank 0's `make()` bytes with every rank of a `world_size`-rank group over
/// `subject` (unique to the group); every rank returns them. Gives up after `timeout`.
pub async fn share_id(
    client: &async_nats::Client,
    subject: &str,
    rank: usize,
    world_size: usize,
    make: impl FnOnce() -> Result<Vec<u8>>,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let expired = || Error::Timeout { rank, operation: "bootstrap", seconds: timeout.as_secs_f64() };
    let nats = |e: &dyn std::fmt::Display| Error::Invalid(format!("rank {rank}: bootstrap over NATS: {e}"));
    if rank >= world_size {
        return Err(Error::Invalid(format!("rank {rank} of a group of {world_size}")));
    }
    if rank == 0 {
        let mut requests = client.subscribe(subject.to_string()).await.map_err(|e| nats(&e))?;
        client.flush().await.map_err(|e| nats(&e))?;
        let id = make()?;
        let mut answered = std::collections::BTreeSet::new();
        while answered.len() + 1 < world_size {
            let left = deadline.saturating_duration_since(Instant::now());
            let message = tokio::time::timeout(left, requests.next()).await.map_err(|_| expired())?;
            let message = message.ok_or_else(|| nats(&"the subscription ended"))?;
            let asker = std::str::from_utf8(&message.payload).ok().and_then(|s| s.parse::<usize>().ok());
            if let (Some(reply), Some(asker)) = (message.reply, asker.filter(|r| (1..world_size).contains(r))) {
                client.publish(reply, id.clone().into()).await.map_err(|e| nats(&e))?;
                answered.insert(asker);
            }
        }
        client.flush().await.map_err(|e| nats(&e))?;
        return Ok(id);
    }
    let mut backoff = crate::backoff(RETRY);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(expired());
        }
        let asked = client.request(subject.to_string(), rank.to_string().into());
        match tokio::time::timeout(left, asked).await {
            Ok(Ok(answer)) => return Ok(answer.payload.to_vec()),
            // Rank 0 is not listening yet (no responders) or did not answer in time: ask again.
            Ok(Err(_)) => tokio::time::sleep(backoff.next().unwrap_or(RETRY).min(left)).await,
            Err(_) => return Err(expired()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nats_url() -> String {
        std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
    }

    fn subject() -> String {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        format!("keel.test.bootstrap.{}.{nanos}", std::process::id())
    }

    #[tokio::test]
    async fn every_rank_gets_rank_0s_id_whoever_starts_first() {
        let client = async_nats::connect(nats_url()).await.expect("NATS at 127.0.0.1:4222 (or NATS_URL)");
        let subject = subject();
        let id: Vec<u8> = (0..128).map(|i| (i * 7) as u8).collect();
        // Ranks 1..3 start before rank 0 listens; they retry until it does.
        let mut tasks = Vec::new();
        for rank in [2usize, 1, 3, 0] {
            let (client, subject, id) = (client.clone(), subject.clone(), id.clone());
            tasks.push(tokio::spawn(async move {
                if rank == 0 {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                share_id(&client, &subject, rank, 4, move || Ok(id), Duration::from_secs(20)).await
            }));
        }
        for task in tasks {
            assert_eq!(task.await.expect("a rank").expect("the id"), id);
        }
    }

    #[tokio::test]
    async fn a_missing_rank_0_times_out() {
        let client = async_nats::connect(nats_url()).await.expect("NATS");
        let error = share_id(&client, &subject(), 1, 2, || Ok(vec![]), Duration::from_millis(500))
            .await
            .expect_err("nobody answers");
        assert!(matches!(error, Error::Timeout { rank: 1, .. }), "{error}");
    }
}
