//! Trainer groups: a run's DP × TP ranks as processes of their own (one per GPU, on one
//! machine or several), one trainer service per rank, configured with the same
//! `group.name`, `group.size` ranks and each its own `group.rank`.
//!
//! - Rank 0, the leader, is the worker runs see: it joins the claim queue group (only while
//!   the group is whole), keeps the lease and answers every request.
//! - The other ranks, the followers, take no request of their own. Every request that works
//!   on the models is a [`Command`] the leader hands them over the group's control channel
//!   (a [`TcpCollective`] whose hub is the leader) before running it itself; every rank then
//!   runs the same engine call, meeting the others in the run's tensor- and data-parallel
//!   collectives, and tells the leader how it went ([`TcpCollective::all_gather_bytes`]).
//!   The leader answers with its own result, or with the error that started a failure.
//! - On `load` the ranks join the run's collectives over NATS, under a subject of the load's
//!   own: rank r is tensor-parallel rank r mod TP of replica r div TP; NCCL between GPUs,
//!   TCP through each group's first rank on the CPU.
//! - A rank that dies closes its connections: the leader's next command, or its next ping
//!   (every [`process::PING`] while idle), fails. The leader answers the run's request with an error
//!   naming the rank, drops the models, leaves the claim queue group and waits for the
//!   group to form again; the run fails that attempt, waits in the queue, and resumes from
//!   its latest checkpoint once the leader takes claims again. Followers whose leader is
//!   gone drop their models and wait for the group likewise.

use std::sync::{Arc, Mutex};

pub use keel_collective::process::Meeting;
use keel_collective::process::{self, GroupConfig};
use keel_collective::tcp::TcpCollective;
use keel_protocol::trainer::{LoadRequest, Scorer, TrainBatch};
use keel_training::actor::EngineThread;
use keel_training::{Error, Result, Trainer};
use serde::{Deserialize, Serialize};
use tokio::runtime::Handle;
use tracing::warn;

/// What the leader has every rank do, in the order it sends them.
#[derive(Debug, Serialize, Deserialize)]
pub enum Command {
    /// Load the run's models; the run's collectives are joined under `session`.
    Load {
        request: Box<LoadRequest>,
        session: String,
    },
    /// Drop the run's models.
    Drop,
    Logprobs {
        scorer: Scorer,
        sequences: Vec<Vec<i64>>,
        temperature: f64,
    },
    Scores {
        sequences: Vec<Vec<i64>>,
    },
    Train {
        batch: TrainBatch,
        temperature: f64,
    },
    Evaluate {
        batch: TrainBatch,
        temperature: f64,
    },
    /// Take part in a save (the leader writes the files; the others send their shares).
    Save {
        path: String,
        info: serde_json::Value,
    },
    /// Take part in an export (the leader packs the buckets).
    Export {
        dtype: Option<String>,
        bucket_bytes: u64,
    },
    Offload {
        weights: bool,
    },
    Onload,
}

/// Runs `work` on this rank's engine; when a collective failed in it, drops the models, so
/// that their communicators close and the ranks still waiting in them learn it at once
/// instead of after the timeout.
pub fn run_rank<T>(slot: &mut Option<Trainer>, work: impl FnOnce(&mut Option<Trainer>) -> Result<T>) -> Result<T> {
    let outcome = work(slot);
    if let Err(Error::Collective(_) | Error::Model(keel_model::Error::Collective(_))) = &outcome {
        *slot = None;
    }
    outcome
}

/// A control channel that failed: the group has to form again.
fn lost(e: &keel_collective::Error) -> Error {
    Error::Group(format!("{e}; the group forms again once every rank is back"))
}

/// The leader's side of a group.
#[derive(Debug)]
pub struct Leader {
    pub config: GroupConfig,
    /// The control channel while the group is whole.
    control: Mutex<Option<Arc<TcpCollective>>>,
    /// Held for the whole of a command (and a ping), so that they reach the ranks one at a
    /// time and whole.
    pub turn: tokio::sync::Mutex<()>,
    lost: tokio::sync::Notify,
}

impl Leader {
    pub fn new(config: GroupConfig) -> Self {
        Self { config, control: Mutex::new(None), turn: tokio::sync::Mutex::new(()), lost: tokio::sync::Notify::new() }
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Arc<TcpCollective>>> {
        self.control.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether every rank is there (the leader takes claims only then).
    pub fn is_whole(&self) -> bool {
        self.slot().is_some()
    }

    /// The control channel, or why there is none.
    pub fn control(&self) -> Result<Arc<TcpCollective>> {
        self.slot().clone().ok_or_else(|| {
            Error::Group(format!(
                "not every rank of group `{}` ({} ranks) is there; waiting for them",
                self.config.name, self.config.size
            ))
        })
    }

    /// The group broke: drop the channel and have the keeper form it again.
    pub fn lose(&self, why: &str) {
        if self.slot().take().is_some() {
            warn!(group = %self.config.name, "the trainer group broke: {why}");
        }
        self.lost.notify_one();
    }

    /// Sends `command` to the other ranks, runs `local` here, and gathers how every rank
    /// did (on the engine thread, with [`Leader::turn`] held). A failed channel breaks the
    /// group.
    pub fn lead<T>(&self, control: &TcpCollective, command: &Command, local: impl FnOnce() -> Result<T>) -> Result<T> {
        process::lead_command(control, command, local, |channel| {
            let error = lost(&channel);
            self.lose(&error.to_string());
            error
        })
    }
}

/// A rank's tensor-parallel and data-parallel communicators (`None`: a size of 1).
type Comms = Result<(Option<keel_collective::SharedComm>, Option<keel_collective::SharedComm>)>;

/// This rank's device for `request` and its communicators for the load (session
/// `session`); the device's error when it has none.
async fn join_for(
    meeting: &Meeting,
    request: &LoadRequest,
    session: &str,
    own_device: &str,
) -> (Result<tch::Device>, Comms) {
    let run_device = request.device.clone().unwrap_or_else(|| own_device.to_string());
    match rank_device(&run_device, own_device) {
        Ok(device) => (Ok(device), join_run(meeting, request, session, device).await),
        Err(e) => (Err(e), Ok((None, None))),
    }
}

/// This rank's tensor- and data-parallel communicators for a load of `request` (session
/// `session`), on `device`.
async fn join_run(meeting: &Meeting, request: &LoadRequest, session: &str, device: tch::Device) -> Comms {
    let (tp, dp) = (request.tensor_parallel_size, request.data_parallel_size);
    if tp * dp != meeting.config.size {
        return Err(Error::InvalidConfig(format!(
            "this trainer is a group of {} processes: a run it takes has data_parallel_size × \
             tensor_parallel_size equal to that, not {dp} × {tp}",
            meeting.config.size
        )));
    }
    let rank = meeting.config.rank;
    let (replica, tp_rank) = (rank / tp, rank % tp);
    let tensor =
        if tp > 1 { Some(meeting.join(&format!("{session}.tp{replica}"), tp_rank, tp, device).await?) } else { None };
    let data =
        if dp > 1 { Some(meeting.join(&format!("{session}.dp{tp_rank}"), replica, dp, device).await?) } else { None };
    Ok((tensor, data))
}

/// This rank's device for a run on `run_device`: the process's own GPU (`own`, its
/// configured device) for a CUDA run, the CPU for a CPU run.
pub fn rank_device(run_device: &str, own: &str) -> Result<tch::Device> {
    let cuda = |name: &str| name == "cuda" || name.strip_prefix("cuda:").is_some_and(|n| n.parse::<usize>().is_ok());
    if run_device == "cpu" {
        return Ok(tch::Device::Cpu);
    }
    if !cuda(run_device) {
        return Err(Error::InvalidConfig(format!("unknown device `{run_device}` (use cpu, cuda or cuda:N)")));
    }
    if !cuda(own) {
        return Err(Error::InvalidConfig(format!(
            "the run trains on {run_device}, and this rank of the trainer group is configured for {own}"
        )));
    }
    keel_model::device::parse_device(own).map_err(|e| Error::InvalidConfig(e.to_string()))
}

/// Loads this rank's share of the run's models on `device` with the communicators joined.
fn load_rank(request: &LoadRequest, device: tch::Device, comms: Comms) -> Result<Trainer> {
    let (tensor, data) = comms?;
    Trainer::of_process(request, device, tensor, data)
}

/// The leader's `load`: every rank joins the run's collectives and loads its share. Returns
/// what `summary` reads from the loaded trainer.
pub async fn lead_load<S: Send + 'static>(
    leader: &Leader,
    meeting: &Meeting,
    engine: &EngineThread,
    request: LoadRequest,
    own_device: &str,
    summary: impl FnOnce(&Trainer) -> S + Send + 'static,
) -> Result<S> {
    let _turn = leader.turn.lock().await;
    let control = leader.control()?;
    let session = uuid::Uuid::new_v4().simple().to_string();
    let command = process::encode(&Command::Load { request: Box::new(request.clone()), session: session.clone() })?;
    let sent = control.clone();
    let handed = engine
        .call(move |slot| {
            *slot = None;
            sent.broadcast_bytes(&command, 0).map_err(|e| lost(&e))
        })
        .await;
    if let Err(e) = handed {
        leader.lose(&e.to_string());
        return Err(e);
    }
    let (device, comms) = join_for(meeting, &request, &session, own_device).await;
    let outcome = engine
        .call(move |slot| {
            let mine = device.and_then(|device| load_rank(&request, device, comms)).map(|trainer| {
                let read = summary(&trainer);
                *slot = Some(trainer);
                read
            });
            let settled = match control.all_gather_bytes(&process::status(&mine)) {
                Ok(statuses) => process::settle(mine, &statuses),
                Err(e) => Err(lost(&e)),
            };
            if settled.is_err() {
                *slot = None;
            }
            settled
        })
        .await;
    if let Err(Error::Group(why)) = &outcome {
        leader.lose(why);
    }
    outcome
}

/// Keeps the leader's group: forms it, pings it while idle, and forms it again (dropping the
/// models) when it breaks. Runs until the process stops.
pub async fn keep(leader: Arc<Leader>, meeting: Meeting, engine: EngineThread) {
    loop {
        let control = meeting.form().await;
        *leader.slot() = Some(control);
        loop {
            tokio::select! {
                () = tokio::time::sleep(process::PING) => {}
                () = leader.lost.notified() => {}
            }
            let _turn = leader.turn.lock().await;
            let Ok(control) = leader.control() else { break };
            let pinged = tokio::task::spawn_blocking(move || process::ping(&control).map_err(|e| e.to_string()))
                .await
                .map_err(|e| e.to_string())
                .and_then(|pinged| pinged);
            if let Err(why) = pinged {
                leader.lose(&why);
                break;
            }
        }
        drop_models(&engine).await;
    }
}

/// A follower's part of `command` on its engine (every command but `Load`).
fn execute(command: Command, slot: &mut Option<Trainer>) -> Result<()> {
    if let Command::Drop = command {
        *slot = None;
        return Ok(());
    }
    let engine = slot.as_mut().ok_or(Error::NotLoaded)?;
    match command {
        Command::Load { .. } | Command::Drop => Ok(()),
        Command::Logprobs { scorer, sequences, temperature } => {
            engine.logprobs(scorer, sequences, temperature).map(drop)
        }
        Command::Scores { sequences } => engine.scores(&sequences).map(drop),
        Command::Train { batch, temperature } => engine.train(batch, temperature).map(drop),
        Command::Evaluate { batch, temperature } => engine.evaluate(batch, temperature).map(drop),
        Command::Save { path, info } => engine.save(std::path::PathBuf::from(path), info).map(drop),
        Command::Export { dtype, bucket_bytes } => {
            let kind = dtype
                .map(|name| keel_model::device::parse_kind(&name))
                .transpose()
                .map_err(|e| Error::InvalidRequest(e.to_string()))?;
            engine.export(kind, bucket_bytes, keel_model::packing::PackTarget::Memory).map(drop)
        }
        Command::Offload { weights } => engine.offload(weights).map(drop),
        Command::Onload => engine.onload().map(drop),
    }
}

/// Drops the models on this rank's engine thread.
pub async fn drop_models(engine: &EngineThread) {
    let dropped = engine
        .call(|slot| {
            *slot = None;
            Ok(())
        })
        .await;
    if let Err(e) = dropped {
        warn!("could not drop the models: {e}");
    }
}

/// A follower: forms the group, then runs the leader's commands until the group breaks,
/// and forms it again. Runs until the process stops.
pub async fn follow(meeting: Meeting, engine: EngineThread, own_device: String) {
    loop {
        let control = meeting.form().await;
        let (at, on, device) = (meeting.clone(), engine.clone(), own_device.clone());
        let handle = Handle::current();
        let following = tokio::task::spawn_blocking(move || {
            let run = |command, _: &TcpCollective| handle.block_on(run_command(&at, &on, &device, command));
            let why = process::follow(&control, run, |_| false);
            warn!(group = %at.config.name, rank = at.config.rank, "left the trainer group: {why}");
        });
        if let Err(e) = following.await {
            warn!("the trainer group's follower stopped: {e}");
        }
        drop_models(&engine).await;
    }
}

/// A follower's part of the leader's `command`: a load joins the run's collectives first.
async fn run_command(meeting: &Meeting, engine: &EngineThread, own_device: &str, command: Command) -> Result<()> {
    match command {
        Command::Load { request, session } => {
            drop_models(engine).await;
            let (device, comms) = join_for(meeting, &request, &session, own_device).await;
            engine
                .call(move |slot| {
                    *slot = Some(device.and_then(|device| load_rank(&request, device, comms))?);
                    Ok(())
                })
                .await
        }
        command => engine.call(move |slot| run_rank(slot, |slot| execute(command, slot))).await,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_rank_takes_its_own_gpu_for_a_cuda_run_and_the_cpu_for_a_cpu_run() {
        assert_eq!(rank_device("cpu", "cuda:3").unwrap(), tch::Device::Cpu);
        let e = rank_device("cuda", "cpu").unwrap_err().to_string();
        assert!(e.contains("configured for cpu"), "{e}");
        let e = rank_device("tpu", "cuda").unwrap_err().to_string();
        assert!(e.contains("unknown device `tpu`"), "{e}");
        // A CUDA run takes the rank's own GPU (where this machine has one).
        if tch::Cuda::device_count() > 0 {
            assert_eq!(rank_device("cuda:5", "cuda").unwrap(), tch::Device::Cuda(0));
        } else {
            eprintln!("SKIPPED the CUDA case: no GPU here");
        }
    }

    #[test]
    fn a_followers_error_reaches_the_leader_with_its_reply_type() {
        let ok = process::status(&Ok::<(), Error>(()));
        let cause = process::status(&Err::<(), _>(Error::NonFinite("loss is NaN".into())));
        let e = process::settle(Ok(7), &[ok.clone(), ok, cause]).unwrap_err();
        assert!(matches!(&e, Error::Rank { rank: 2, kind: "non_finite", .. }), "{e:?}");
        assert_eq!(e.kind(), keel_protocol::trainer::error_types::NON_FINITE);
        assert!(e.to_string().starts_with("rank 2 of the trainer group: loss is NaN"), "{e}");
    }
}
