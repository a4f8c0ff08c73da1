//! Generator groups: one generator's tensor-parallel ranks as generator processes of their
//! own (one per GPU, on one machine or several), each configured with the same
//! `group.name` and `group.size` and its own `group.rank` (see `keel_generation::group` for
//! how the leader drives them).
//!
//! - Rank 0, the leader, is the generator clients and runs see: it serves the OpenAI API and
//!   the NATS rollouts and refits, and its scheduler drives every rank.
//! - The other ranks serve `/healthz` only. They take the model directory, dtype and pool
//!   size from the leader at load, so they need no `model` of their own (the directory must
//!   be there on their host at the same path).
//! - The ranks find each other over NATS: the control channel on
//!   `<prefix>.generator.group.<name>.control`, each load's tensor-parallel communicator
//!   under a subject of its own (NCCL between GPUs, TCP on the CPU).
//! - When a rank dies the group is over: the leader exits with an error naming why (its
//!   supervisor starts it again, and it loads once every rank is back); the other ranks
//!   drop their share and wait for the group to form again.

use std::path::Path;
use std::sync::Arc;

use keel_collective::SharedComm;
pub use keel_collective::process::Meeting;
use keel_collective::tcp::TcpCollective;
use keel_generation::backend::Backend;
use keel_generation::group::Grouped;
use tch::{Device, Kind};
use tokio::runtime::Handle;
use tracing::{info, warn};

/// This rank's tensor-parallel communicator for the load of session `session`.
async fn join(meeting: &Meeting, session: &str, device: Device) -> keel_model::Result<SharedComm> {
    let (rank, size) = (meeting.config.rank, meeting.config.size);
    Ok(meeting.join(&format!("{session}.tp"), rank, size, device).await?)
}

/// The leader's side: the formed group and what loading it needs.
#[derive(Debug, Clone)]
pub struct Leading {
    pub meeting: Meeting,
    pub control: Arc<TcpCollective>,
    pub handle: Handle,
    /// Told why when the group breaks.
    pub lost: tokio::sync::watch::Sender<Option<String>>,
}

impl Leading {
    /// The leader's backend (on the scheduler thread): every rank loads its slices of
    /// `dir` with a pool of `blocks`. A later load (a run's model, after the start-up one)
    /// goes over the same control channel: each rank drops its share first.
    pub fn backend(&self, dir: &Path, device: Device, kind: Kind, blocks: usize) -> keel_model::Result<Backend> {
        let Self { meeting, control, handle, lost } = self;
        info!(group = %meeting.config.name, ranks = meeting.config.size, "loading the model on every rank");
        let joined = |session: &str| handle.block_on(join(meeting, session, device));
        Ok(Backend::Group(Grouped::load(control.clone(), dir, (device, kind, blocks), lost.clone(), joined)?))
    }
}

/// A rank other than the leader: forms the group, runs the leader's commands until it has
/// to leave, drops its share and forms the group again. Runs (on a thread of its own, where
/// every tensor operation of this rank runs) until the process stops.
pub fn follow(meeting: Meeting, handle: Handle, device: Device) {
    loop {
        let control = handle.block_on(meeting.form());
        let mut rank = None;
        let joined = |session: &str| handle.block_on(join(&meeting, session, device));
        let why = keel_generation::group::follow(&control, device, joined, &mut rank);
        warn!(group = %meeting.config.name, rank = meeting.config.rank, "left the generator group: {why}");
    }
}
