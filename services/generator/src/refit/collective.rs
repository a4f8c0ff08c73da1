//! The collective transfer's receiving side: this generator asks the trainer for the ranges
//! of an export it keeps, and receives them over a communicator the two form, or one kept
//! from their last transfer.

use std::collections::HashMap;

use keel_protocol::Reply;
use keel_protocol::trainer::{SendAccepted, SendWeights};

use tracing::info;

use crate::error::Error;

/// How long a collective transfer may take, from the request to the last bucket (the
/// trainer waits as long for this generator to join).
const RECEIVE_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// The communicators this generator keeps with trainers for the collective transfer: per
/// trainer (the subject it takes requests on), the session and the communicator. Transfers
/// take the lock for their whole length, so one runs at a time. `formed` counts the ones
/// formed (`/metrics`: a kept one saves the set-up, NCCL's on GPUs).
#[derive(Debug, Default)]
pub struct WeightLinks {
    kept: tokio::sync::Mutex<HashMap<String, (String, keel_collective::SharedComm)>>,
    pub formed: std::sync::atomic::AtomicU64,
}

/// The buckets of `buckets` the trainer keeps for the collective transfer, in their order,
/// received on `device` (none when no bucket is one), over the communicator kept with that
/// trainer from an earlier transfer — or, when there is none or it fails (the trainer
/// restarted, or let it go), a new one formed for this transfer and kept for the next.
pub(super) async fn receive(
    client: &async_nats::Client,
    links: &WeightLinks,
    buckets: &[keel_protocol::generator::WeightBucket],
    device: tch::Device,
) -> crate::Result<Vec<tch::Tensor>> {
    let sent: Vec<_> = buckets.iter().filter_map(|b| b.at.collective().map(|c| (c, b.bytes))).collect();
    let Some(&(first, _)) = sent.first() else { return Ok(Vec::new()) };
    if sent.iter().any(|(c, _)| (&c.export, &c.subject, &c.meeting) != (&first.export, &first.subject, &first.meeting))
    {
        return Err(Error::Receive("the buckets name more than one export".into()));
    }
    if let (tch::Device::Cuda(ordinal), Some(trainer)) = (device, &first.gpu_uuid)
        && keel_model::cuda::ipc::device_uuid(ordinal).is_ok_and(|mine| mine == *trainer)
    {
        return Err(Error::Receive(format!(
            "the export is on this generator's own GPU (cuda:{ordinal}), and NCCL joins processes on different \
             GPUs only: use the cuda_ipc transfer"
        )));
    }
    let ranges: Vec<(u64, u64)> = sent.iter().map(|(c, bytes)| (c.offset, *bytes)).collect();
    let mut kept = links.kept.lock().await;
    let reused = match kept.remove(&first.subject) {
        Some(link) => fetch(client, first, &ranges, device, Some(link))
            .await
            .inspect_err(|e| info!("the communicator kept with the trainer failed ({e}); forming a new one"))
            .ok(),
        None => None,
    };
    let (tensors, session, comm) = match reused {
        Some(received) => received,
        None => {
            let received = fetch(client, first, &ranges, device, None).await?;
            links.formed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            received
        }
    };
    kept.insert(first.subject.clone(), (session, comm));
    Ok(tensors)
}

/// One collective transfer of `ranges` of `first`'s export: the request (refused at once
/// by the trainer, or accepted), then the communicator — `kept`, or a new one on a session
/// of its own — and every range received on `device`. Returns the buckets, and the session
/// and communicator to keep.
async fn fetch(
    client: &async_nats::Client,
    first: &keel_protocol::generator::CollectiveBuffer,
    ranges: &[(u64, u64)],
    device: tch::Device,
    kept: Option<(String, keel_collective::SharedComm)>,
) -> crate::Result<(Vec<tch::Tensor>, String, keel_collective::SharedComm)> {
    let failed = |e: &dyn std::fmt::Display| Error::Receive(e.to_string());
    let session = match &kept {
        Some((session, _)) => session.clone(),
        None => format!("{:032x}", rand::random::<u128>()),
    };
    let request = SendWeights {
        export: first.export.clone(),
        session: session.clone(),
        device: keel_model::device::memory_name(device).into(),
        ranges: ranges.to_vec(),
        reuse: kept.is_some(),
    };
    let body = serde_json::to_vec(&request).map_err(|e| failed(&e))?;
    let ask = async_nats::Request::new().payload(body.into()).timeout(Some(RECEIVE_WAIT));
    let answer = client.send_request(first.subject.clone(), ask).await.map_err(|e| failed(&e))?;
    match serde_json::from_slice::<Reply<SendAccepted>>(&answer.payload) {
        Ok(Reply::Ok(_)) => {}
        Ok(Reply::Error(e)) => return Err(Error::Receive(format!("the trainer refused: {e}"))),
        Err(e) => return Err(Error::Receive(format!("a malformed answer from the trainer: {e}"))),
    }
    let comm = match kept {
        Some((_, comm)) => comm,
        None => {
            let meeting = format!("{}.{session}", first.meeting);
            let unused = std::net::IpAddr::from([0, 0, 0, 0]);
            keel_collective::join_process_group(client, &meeting, 1, 2, device, unused, RECEIVE_WAIT)
                .await
                .map_err(|e| failed(&e))?
        }
    };
    let sizes: Vec<u64> = ranges.iter().map(|(_, bytes)| *bytes).collect();
    let received = tokio::task::spawn_blocking(move || {
        let mut received = Vec::with_capacity(sizes.len());
        for bytes in sizes {
            let mut bucket =
                tch::Tensor::f_empty([bytes as i64], (tch::Kind::Uint8, device)).map_err(|e| e.to_string())?;
            comm.broadcast(&mut bucket, 0).map_err(|e| e.to_string())?;
            received.push(bucket);
        }
        if let tch::Device::Cuda(ordinal) = device {
            tch::Cuda::synchronize(ordinal as i64);
        }
        Ok::<_, String>((received, comm))
    });
    let (received, comm) =
        received.await.map_err(|e| Error::Task("receiving the weights", e))?.map_err(Error::Receive)?;
    Ok((received, session, comm))
}
