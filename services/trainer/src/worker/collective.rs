//! The collective transfer's sending side: a generator asks for an export the worker keeps
//! ([`accept`]), and the worker broadcasts its ranges over a communicator the two form, or
//! one kept from their last transfer ([`send_weights`]).

use super::export::KEPT_DEVICE_EXPORTS;
use super::*;

/// How long the two sides of a collective transfer wait for each other to join, and for
/// each range to arrive.
const SEND_TIMEOUT: Duration = Duration::from_secs(120);

/// Communicators kept with generators for their next collective transfers (each holds a
/// connection, or NCCL's buffers on the GPU): the newest few.
const KEPT_LINKS: usize = 8;

/// A collective transfer the worker accepted: what to send, and over which communicator.
pub(super) struct Transfer {
    pub(super) export: String,
    buffer: tch::Tensor,
    ranges: Vec<(u64, u64)>,
    session: String,
    /// The communicator kept from an earlier transfer to the same generator (None: a new
    /// one is formed on the session's subject).
    pub(super) link: Option<keel_collective::SharedComm>,
}

/// Decides a generator's [`SendWeights`]: an export this worker keeps, on the generator's
/// kind of device, ranges inside it, and the kept communicator it names when it asks to
/// reuse one (taken while the transfer runs). The export's id admits the request, not the
/// run's claim: a generator knows it from the weights it was told to load.
pub(super) fn accept(shared: &Shared, payload: &[u8]) -> Answer<(SendAccepted, Transfer)> {
    let request: SendWeights = parse(payload)?;
    let invalid = |message: String| refuse(error_types::INVALID_REQUEST, message);
    if !keel_protocol::subjects::is_subject_token(&request.session) {
        return Err(invalid(format!("session `{}` must be letters, digits, `-` and `_`", request.session)));
    }
    let buffer = {
        let kept = shared.device_exports.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        kept.iter().find(|(id, _)| *id == request.export).map(|(_, buffer)| buffer.shallow_clone())
    };
    let buffer = buffer.ok_or_else(|| {
        invalid(format!(
            "export {} is not kept by worker {} (it keeps the {KEPT_DEVICE_EXPORTS} newest of the run holding it)",
            request.export, shared.worker_id
        ))
    })?;
    let device = buffer.device();
    let place = keel_model::device::memory_name(device);
    if request.device != place {
        return Err(invalid(format!(
            "the export is in {place} memory and the generator receives on `{}`: the collective transfer joins \
             GPU to GPU (NCCL) or CPU to CPU (TCP)",
            request.device
        )));
    }
    let size = buffer.numel() as u64;
    for &(offset, bytes) in &request.ranges {
        if bytes == 0 || offset.checked_add(bytes).is_none_or(|end| end > size) {
            return Err(invalid(format!("range ({offset}, {bytes}) is not inside the export's {size} bytes")));
        }
    }
    let link = if request.reuse {
        let mut links = shared.links.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let at = links.iter().position(|(session, on, _)| *session == request.session && *on == device);
        let at = at.ok_or_else(|| {
            refuse(
                error_types::UNKNOWN_SESSION,
                format!("worker {} keeps no communicator of session {} on {place}", shared.worker_id, request.session),
            )
        })?;
        links.remove(at).map(|(_, _, comm)| comm)
    } else {
        if let Err(e) = &shared.send_ip {
            return Err(refuse(error_types::INTERNAL, e.to_string()));
        }
        None
    };
    let bytes = request.ranges.iter().map(|(_, bytes)| bytes).sum();
    let transfer = Transfer { export: request.export, buffer, ranges: request.ranges, session: request.session, link };
    Ok((SendAccepted { bytes }, transfer))
}

/// Why a collective transfer the worker accepted failed (it is logged; the generator's own
/// side fails too and reports the refit).
#[derive(Debug, thiserror::Error)]
pub(super) enum SendFailed {
    #[error("joining the generator: {0}")]
    Join(keel_collective::Error),
    #[error("sending the weights: {0}")]
    Send(keel_collective::Error),
    #[error("cutting a range out of the export: {0}")]
    Range(#[from] tch::TchError),
    #[error("the sending task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// Runs an accepted transfer: joins the generator on a new communicator (unless one was
/// kept), broadcasts every range on the blocking pool, and keeps the communicator for the
/// generator's next transfer. A communicator whose transfer failed is dropped.
pub(super) async fn send_weights(shared: Arc<Shared>, transfer: Transfer) -> std::result::Result<(), SendFailed> {
    let Transfer { buffer, ranges, session, link, .. } = transfer;
    let device = buffer.device();
    let comm = match link {
        Some(comm) => comm,
        None => {
            let ip = shared.send_ip.clone().map_err(SendFailed::Join)?;
            let subject = format!("{}.{session}", shared.send_subjects.1);
            keel_collective::join_process_group(&shared.client, &subject, 0, 2, device, ip, SEND_TIMEOUT)
                .await
                .map_err(SendFailed::Join)?
        }
    };
    let comm = tokio::task::spawn_blocking(move || {
        for (offset, bytes) in ranges {
            let mut range = buffer.f_narrow(0, offset as i64, bytes as i64)?;
            comm.broadcast(&mut range, 0).map_err(SendFailed::Send)?;
        }
        // NCCL's broadcasts are queued on the GPU: the communicator is kept once they are done.
        if let tch::Device::Cuda(ordinal) = device {
            tch::Cuda::synchronize(ordinal as i64);
        }
        Ok::<_, SendFailed>(comm)
    })
    .await??;
    let mut links = shared.links.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    links.push_back((session, device, comm));
    while links.len() > KEPT_LINKS {
        links.pop_front();
    }
    Ok(())
}
