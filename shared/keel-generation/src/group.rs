//! Generator groups: the tensor-parallel ranks of one generator as processes of their own
//! (one per GPU, on one machine or several), led by rank 0.
//!
//! - The leader is the generator clients see: its scheduler runs a [`Grouped`] backend
//!   whose rank is the leader's own share of the model. Every pass, block copy, sleep, wake
//!   and refit is a [`Command`] the leader sends its other ranks over the group's control
//!   channel (a [`TcpCollective`] whose hub is the leader) before running it itself; every
//!   rank then runs it on its share, meeting the others in the tensor-parallel collectives
//!   (NCCL between GPUs, TCP on the CPU), and tells the leader how it went. The leader
//!   answers with its own result (its logits: every rank has the same), or with the error
//!   that started a failure.
//! - New weights reach the leader (from the object store, shared memory, CUDA IPC or a
//!   directory, see the service) and travel to the other ranks over the tensor-parallel
//!   communicator, broadcast from the leader tensor by tensor; each rank cuts its slices.
//!   A directory is read by every rank itself (it must be there on every host, as the model
//!   directory must). As on one process, every rank stages its slices first and swaps only
//!   when all have them.
//! - The other ranks take no request of their own: the service runs [`execute`] for each
//!   command (and joins the tensor-parallel communicator for [`Command::Load`]).
//! - A rank that dies closes its connections: the leader's next command, or its next ping
//!   (every [`process::PING`] while idle), fails, and the group is over: every later call fails with
//!   [`Error::GroupLost`] and the leader's `lost` signal fires, so that the service exits
//!   and its supervisor starts it again, once every rank is back, on the start-up weights
//!   (the orchestrator announces the run's weights again to a generator that serves others).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use keel_collective::process;
use keel_collective::tcp::TcpCollective;
use keel_collective::{Collective, SharedComm};
use keel_model::{Error, PromptLogprobs, Result, SeqChunk};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::backend::{Rank, Weights};

/// What the leader has every rank do, in the order it sends them.
#[derive(Debug, Serialize, Deserialize)]
pub enum Command {
    /// Check that this rank can load `load`; when every rank can, join the
    /// tensor-parallel communicator of `load.session` and load this rank's slices.
    Load(Load),
    Forward {
        chunks: Vec<SeqChunk>,
    },
    CopyBlock {
        from: usize,
        to: usize,
    },
    Sleep {
        offload_weights: bool,
    },
    Wake,
    /// Read and check this rank's slices of new weights (tensors follow over the
    /// tensor-parallel communicator, broadcast from the leader in the order listed).
    Stage {
        weights: Incoming,
    },
    /// Swap the staged weights in (`commit`: every rank staged its own), or drop them.
    Commit {
        commit: bool,
    },
    /// Score a prompt's tokens (`echo`, `prompt_logprobs`): every rank runs the pass.
    PromptLogprobs {
        prompt: Vec<i64>,
        top: usize,
    },
}

/// The model every rank loads its slices of, and where the ranks meet.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Load {
    /// The load's own part of the subject its tensor-parallel communicator is found on.
    pub session: String,
    /// The model directory (the same path on every host).
    pub model: PathBuf,
    /// The serving dtype (`f32`, `bf16`, `f16`).
    pub dtype: String,
    /// Blocks of each rank's KV pool (the leader's scheduler owns the block tables).
    pub blocks: usize,
    /// Whether the leader serves on a GPU (every rank must: NCCL), or on the CPU (TCP).
    pub cuda: bool,
}

impl Load {
    /// Whether a rank on `device` can take part: the error that says why not.
    pub fn check(&self, device: Device) -> Result<()> {
        let cuda = device.is_cuda();
        if cuda == self.cuda {
            return Ok(());
        }
        let (leader, this) = if self.cuda { ("a GPU", "the CPU") } else { ("the CPU", "a GPU") };
        Err(Error::Device(format!("the group's leader serves on {leader} and this rank is configured for {this}")))
    }
}

/// New weights as the other ranks are told of them.
#[derive(Debug, Serialize, Deserialize)]
pub enum Incoming {
    /// A directory every rank reads itself.
    Dir(PathBuf),
    /// Whole tensors, broadcast from the leader.
    Tensors(Vec<Spec>),
    /// A LoRA run's adapters (broadcast), their scale and the base directory (read by each).
    Adapters { tensors: Vec<Spec>, scale: f64, base: PathBuf },
}

/// A broadcast tensor's name, shape and dtype.
#[derive(Debug, Serialize, Deserialize)]
pub struct Spec {
    name: String,
    shape: Vec<i64>,
    dtype: String,
}

/// Tensors by name, in the order they are broadcast.
type Ordered = Vec<(String, Tensor)>;

/// `map`'s tensors on `device`, sorted by name, and their specs.
fn ordered(map: &HashMap<String, Tensor>, device: Device) -> Result<(Vec<Spec>, Ordered)> {
    let mut names: Vec<&String> = map.keys().collect();
    names.sort();
    let mut specs = Vec::with_capacity(names.len());
    let mut tensors = Vec::with_capacity(names.len());
    for name in names {
        let tensor = map[name].f_to_device(device)?;
        let dtype = keel_model::weights::dtype_name(tensor.kind()).to_string();
        specs.push(Spec { name: name.clone(), shape: tensor.size(), dtype });
        tensors.push((name.clone(), tensor));
    }
    Ok((specs, tensors))
}

/// What the other ranks are told of `weights`, and the tensors the leader broadcasts.
fn announce(weights: &Weights, device: Device) -> Result<(Incoming, Ordered)> {
    Ok(match weights {
        Weights::Dir(dir) => (Incoming::Dir(dir.clone()), Vec::new()),
        Weights::Tensors(map) => {
            let (specs, tensors) = ordered(map, device)?;
            (Incoming::Tensors(specs), tensors)
        }
        Weights::Adapters { tensors, scale, base } => {
            let (specs, tensors) = ordered(tensors, device)?;
            (Incoming::Adapters { tensors: specs, scale: *scale, base: base.clone() }, tensors)
        }
    })
}

/// The weights `incoming` says, with `tensors` (broadcast) in place of its specs.
fn arrived(incoming: Incoming, tensors: Ordered) -> Weights {
    let map = || tensors.into_iter().collect();
    match incoming {
        Incoming::Dir(dir) => Weights::Dir(dir),
        Incoming::Tensors(_) => Weights::Tensors(map()),
        Incoming::Adapters { scale, base, .. } => Weights::Adapters { tensors: map(), scale, base },
    }
}

/// `weights` with `tensors` (the same, moved to the leader's device) in place of its own.
fn replaced(weights: &Weights, tensors: Ordered) -> Weights {
    let map = || tensors.into_iter().collect();
    match weights {
        Weights::Dir(dir) => Weights::Dir(dir.clone()),
        Weights::Tensors(_) => Weights::Tensors(map()),
        Weights::Adapters { scale, base, .. } => {
            Weights::Adapters { tensors: map(), scale: *scale, base: base.clone() }
        }
    }
}

/// Broadcasts `tensors` from the leader (in place on the other ranks).
fn broadcast(comm: Option<&SharedComm>, tensors: &mut Ordered) -> Result<()> {
    let Some(comm) = comm else { return Ok(()) };
    for (_, tensor) in tensors.iter_mut() {
        comm.broadcast(tensor, 0)?;
    }
    Ok(())
}

/// A rank's receiving side of a refit: the tensors `incoming` names, from the leader.
fn receive(rank: &Rank, incoming: &Incoming) -> Result<Ordered> {
    let specs = match incoming {
        Incoming::Dir(_) => return Ok(Vec::new()),
        Incoming::Tensors(specs) | Incoming::Adapters { tensors: specs, .. } => specs,
    };
    let mut tensors = Vec::with_capacity(specs.len());
    for spec in specs {
        let kind = keel_model::device::parse_kind(&spec.dtype)?;
        tensors.push((spec.name.clone(), Tensor::f_empty(spec.shape.as_slice(), (kind, rank.device()))?));
    }
    broadcast(rank.comm(), &mut tensors)?;
    Ok(tensors)
}

/// A rank's part of `command` (every command but `Load`, which [`follow`] runs: a load
/// joins the communicator over NATS). A failure to receive broadcast weights is a
/// [`Error::GroupLost`]: that rank is out of step with the others and must leave.
pub fn execute(command: Command, slot: &mut Option<Rank>) -> Result<()> {
    let rank = slot.as_mut().ok_or_else(|| Error::GroupLost("this rank has no model loaded, the leader has".into()))?;
    match command {
        Command::Load(_) => Ok(()),
        Command::Forward { chunks } => rank.forward(&chunks).map(drop),
        Command::CopyBlock { from, to } => rank.copy_block(from, to),
        Command::Sleep { offload_weights } => rank.sleep(offload_weights).map(drop),
        Command::Wake => rank.wake().map(drop),
        Command::Stage { weights } => {
            let tensors = receive(rank, &weights)
                .map_err(|e| Error::GroupLost(format!("could not receive the new weights: {e}")))?;
            rank.stage(arrived(weights, tensors))
        }
        Command::Commit { commit } => rank.commit(commit),
        Command::PromptLogprobs { prompt, top } => rank.prompt_logprobs(&prompt, top).map(drop),
    }
}

/// A rank other than the leader: runs the leader's commands on `control` until this rank has
/// to leave (the channel failed, or its communicators are unusable), with its share of the
/// model in `slot` and its own `device`; `join` joins a load's tensor-parallel communicator
/// (given its session). Returns why it left.
pub fn follow(
    control: &TcpCollective,
    device: Device,
    mut join: impl FnMut(&str) -> Result<SharedComm>,
    slot: &mut Option<Rank>,
) -> String {
    let mut run = |command: Command, control: &TcpCollective| {
        let outcome = match command {
            Command::Load(load) => {
                *slot = None;
                load_share(control, &load, device, &mut join).map(|rank| *slot = rank)
            }
            command => execute(command, slot),
        };
        // A rank that must leave drops its share first: its communicator closes, and the
        // other ranks waiting in a collective with it learn it at once.
        if outcome.as_ref().is_err_and(must_leave) {
            *slot = None;
        }
        outcome
    };
    process::follow(control, &mut run, must_leave)
}

/// A rank's part of a load: it tells every rank whether it can take part, and only when all
/// can does it join the load's communicator and load its slices (`None`: another rank
/// cannot, and this one's own check is what it reports).
fn load_share(
    control: &TcpCollective,
    load: &Load,
    device: Device,
    join: &mut impl FnMut(&str) -> Result<SharedComm>,
) -> Result<Option<Rank>> {
    let checked = load.check(device);
    let statuses = control.all_gather_bytes(&process::status(&checked)).map_err(|e| Error::GroupLost(e.to_string()))?;
    if !process::all_succeeded(&statuses) {
        return checked.map(|()| None);
    }
    tracing::info!(model = %load.model.display(), "loading this rank's slices");
    let kind = keel_model::device::parse_kind(&load.dtype)?;
    let comm = join(&load.session)?;
    Ok(Some(Rank::load(&load.model, comm, device, kind, load.blocks)?))
}

/// Whether a rank that failed with `error` must leave the group (its communicators are
/// unusable, or it is out of step).
pub fn must_leave(error: &Error) -> bool {
    matches!(error, Error::Collective(_) | Error::GroupLost(_))
}

/// The leader's backend: its own rank and the group's control channel.
#[derive(Debug)]
pub struct Grouped {
    rank: Rank,
    control: Arc<TcpCollective>,
    blocks: usize,
    /// Why the group broke, once it has: nothing runs on it any more.
    broken: Option<String>,
    /// When the leader last sent a command.
    last: Instant,
    /// Told why, once, when the group breaks.
    lost: tokio::sync::watch::Sender<Option<String>>,
}

impl Grouped {
    /// Loads `dir` in `kind` on every rank of the group (the leader's own rank on `device`),
    /// each with a pool of `blocks`: every rank checks that it can, then joins the load's
    /// tensor-parallel communicator (`join`, given the load's session) and loads its slices.
    /// Fails with the error that started a failure; `lost` is told when the group breaks.
    pub fn load(
        control: Arc<TcpCollective>,
        model: &Path,
        (device, kind, blocks): (Device, Kind, usize),
        lost: tokio::sync::watch::Sender<Option<String>>,
        join: impl FnOnce(&str) -> Result<SharedComm>,
    ) -> Result<Self> {
        let load = Load {
            session: format!("{:016x}", rand::random::<u64>()),
            model: model.to_path_buf(),
            dtype: keel_model::weights::dtype_name(kind).to_string(),
            blocks,
            cuda: device.is_cuda(),
        };
        let channel = |e: keel_collective::Error| Error::GroupLost(e.to_string());
        // Every rank checks that it can take part, and all go on only when all can (as
        // `load_share` does on the others).
        let rank = process::lead_command(
            &control,
            &Command::Load(load.clone()),
            || {
                let checked = load.check(device);
                let statuses = control.all_gather_bytes(&process::status(&checked)).map_err(channel)?;
                process::settle(checked, &statuses)?;
                Rank::load(model, join(&load.session)?, device, kind, blocks)
            },
            channel,
        )?;
        Ok(Self { rank, control, blocks, broken: None, last: Instant::now(), lost })
    }

    pub fn blocks(&self) -> usize {
        self.blocks
    }

    pub fn world_size(&self) -> usize {
        self.rank.world_size()
    }

    /// The group is over: every later call fails and the service is told.
    fn lose(&mut self, why: String) {
        if self.broken.is_none() {
            tracing::error!("the generator group broke: {why}");
            let _ = self.lost.send(Some(why.clone()));
            self.broken = Some(why);
        }
    }

    /// Sends `command` to the other ranks, runs `local` on the leader's rank, and gathers
    /// how every rank did.
    fn lead<T>(&mut self, command: &Command, local: impl FnOnce(&mut Rank) -> Result<T>) -> Result<T> {
        if let Some(why) = &self.broken {
            return Err(Error::GroupLost(why.clone()));
        }
        self.last = Instant::now();
        let rank = &mut self.rank;
        let mut channel_failed = None;
        let outcome = process::lead_command(
            &self.control,
            command,
            || local(rank),
            |channel| {
                let why = channel.to_string();
                channel_failed = Some(why.clone());
                Error::GroupLost(why)
            },
        );
        // A failed control channel, a collective that failed here, or a rank that had to
        // leave ends the group. (A rank that had to leave reported why first: the next
        // command finds it gone.)
        match (channel_failed, &outcome) {
            (Some(why), _) => self.lose(why),
            (None, Err(e)) if must_leave(e) => self.lose(e.to_string()),
            _ => {}
        }
        outcome
    }

    pub fn forward(&mut self, chunks: &[SeqChunk]) -> Result<Tensor> {
        self.lead(&Command::Forward { chunks: chunks.to_vec() }, |rank| rank.forward(chunks))
    }

    pub fn copy_block(&mut self, from: usize, to: usize) -> Result<()> {
        self.lead(&Command::CopyBlock { from, to }, |rank| rank.copy_block(from, to))
    }

    pub fn prompt_logprobs(&mut self, prompt: &[i64], top: usize) -> Result<PromptLogprobs> {
        let command = Command::PromptLogprobs { prompt: prompt.to_vec(), top };
        self.lead(&command, |rank| rank.prompt_logprobs(prompt, top))
    }

    /// The bytes the leader's rank freed (each rank frees its own share alike).
    pub fn sleep(&mut self, offload_weights: bool) -> Result<u64> {
        let world = self.world_size() as u64;
        self.lead(&Command::Sleep { offload_weights }, |rank| rank.sleep(offload_weights)).map(|bytes| bytes * world)
    }

    pub fn wake(&mut self) -> Result<u64> {
        let world = self.world_size() as u64;
        self.lead(&Command::Wake, Rank::wake).map(|bytes| bytes * world)
    }

    /// Every rank stages its slices of `weights` (tensors broadcast from here); only when
    /// all have them does any swap.
    pub fn reload(&mut self, weights: &Weights) -> Result<()> {
        let (incoming, mut tensors) = announce(weights, self.rank.device())?;
        let staged = self.lead(&Command::Stage { weights: incoming }, |rank| {
            broadcast(rank.comm(), &mut tensors)?;
            rank.stage(replaced(weights, tensors))
        });
        let commit = staged.is_ok();
        let committed = self.lead(&Command::Commit { commit }, |rank| rank.commit(commit));
        staged.and(committed)
    }

    /// While idle, checks every [`process::PING`] that every rank is still there.
    pub fn keep_alive(&mut self) {
        if self.broken.is_some() || self.last.elapsed() < process::PING {
            return;
        }
        self.last = Instant::now();
        if let Err(e) = process::ping(&self.control) {
            self.lose(e.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::backend::Backend;
    use crate::backend::tests::{chunk, random_model};
    use keel_model::CausalLm;
    use std::net::TcpListener;
    use std::time::Duration;

    const TIMEOUT: Duration = Duration::from_secs(30);

    /// A pass, a copy on write, a decode step and a block reused, as the scheduler runs them.
    fn run(backend: &mut Backend) -> Vec<Tensor> {
        let mut out = vec![backend.forward(&[chunk(&[3, 50, 7, 96], 0, &[1])]).expect("prefill")];
        backend.copy_block(1, 2).expect("copied");
        out.push(backend.forward(&[chunk(&[11], 4, &[1]), chunk(&[12], 4, &[2])]).expect("decode"));
        out.push(backend.forward(&[chunk(&[40, 41], 0, &[2])]).expect("reuse"));
        out
    }

    fn whole(dir: &Path) -> Vec<Tensor> {
        run(&mut Backend::whole(CausalLm::load(dir, Device::Cpu, Kind::Float).unwrap(), 4).unwrap())
    }

    fn assert_close(got: &[Tensor], want: &[Tensor], what: &str) {
        for (g, w) in got.iter().zip(want) {
            let diff = (g - w).abs().max().double_value(&[]);
            assert!(diff <= 1e-5, "{what}: the group's logits differ from one model's by {diff:e}");
        }
    }

    /// Two ranks of a group, the follower on a thread of its own with its own connections
    /// (over loopback TCP, as processes on one host talk): the leader's backend serves,
    /// refits from a directory and from tensors it broadcasts, refuses weights that do not
    /// fit, sleeps and wakes like one model; a rank that leaves ends the group, and the
    /// leader is told.
    #[test]
    fn a_group_of_rank_processes_serves_and_refits_like_a_whole_model() {
        let dir = tempfile::tempdir().unwrap();
        let (first, second) = (dir.path().join("first"), dir.path().join("second"));
        random_model(&first, 1);
        random_model(&second, 2);
        let control_listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let tp_listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let (control_at, tp_at) = (control_listener.local_addr().unwrap(), tp_listener.local_addr().unwrap());
        let follower = std::thread::spawn(move || {
            let control = TcpCollective::connect(control_at, 1, 2, "control", TIMEOUT).unwrap();
            let join = |_: &str| Ok(Arc::new(TcpCollective::connect(tp_at, 1, 2, "tp", TIMEOUT)?) as SharedComm);
            let mut slot = None;
            follow(&control, Device::Cpu, join, &mut slot)
        });
        let control = Arc::new(TcpCollective::accept(&control_listener, 2, "control", TIMEOUT).unwrap());
        let (lost, told) = tokio::sync::watch::channel(None);
        let join = |_: &str| Ok(Arc::new(TcpCollective::accept(&tp_listener, 2, "tp", TIMEOUT)?) as SharedComm);
        let grouped = Grouped::load(control.clone(), &first, (Device::Cpu, Kind::Float, 4), lost, join).unwrap();
        let mut backend = Backend::Group(grouped);
        assert_eq!((backend.tensor_parallel_size(), backend.blocks()), (2, 4));
        assert_close(&run(&mut backend), &whole(&first), "the first model");
        backend.reload_weights(&Weights::Dir(second.clone())).unwrap();
        assert_close(&run(&mut backend), &whole(&second), "after a refit from a directory");
        // Whole tensors in memory (a weights-only export), broadcast to the other rank.
        let tensors = CausalLm::load(&first, Device::Cpu, Kind::Float).unwrap().var_store().variables();
        backend.reload_weights(&Weights::Tensors(tensors)).unwrap();
        assert_close(&run(&mut backend), &whole(&first), "after a refit from broadcast tensors");
        // Tensors that do not fit are refused on every rank, and the old weights serve.
        let mut bad = CausalLm::load(&second, Device::Cpu, Kind::Float).unwrap().var_store().variables();
        bad.insert("model.norm.weight".into(), Tensor::zeros([3], (Kind::Float, Device::Cpu)));
        let e = backend.reload_weights(&Weights::Tensors(bad)).unwrap_err().to_string();
        assert!(e.contains("model.norm.weight"), "{e}");
        assert_close(&run(&mut backend), &whole(&first), "after a refused refit");
        // Asleep, every rank's pool is freed; awake, they serve again.
        assert!(backend.sleep(true).unwrap() > 0, "the pools are freed");
        let e = backend.forward(&[chunk(&[3], 0, &[1])]).unwrap_err().to_string();
        assert!(e.contains("released"), "{e}");
        assert!(backend.wake().unwrap() > 0, "the pools are back");
        assert_close(&run(&mut backend), &whole(&first), "after a sleep and a wake");
        // The other rank leaves (here: it cannot read a command): the group is over.
        assert!(told.borrow().is_none());
        let garbled = process::lead::<(), Error>(&control, b"not a command", || Ok(())).unwrap();
        assert!(garbled.unwrap_err().to_string().contains("cannot read"), "the rank says why it leaves");
        let why = follower.join().unwrap();
        assert!(why.contains("cannot read"), "{why}");
        backend.forward(&[chunk(&[3], 0, &[1])]).expect_err("a rank is gone");
        assert!(told.borrow().is_some(), "the leader's service is told");
        let again = backend.forward(&[chunk(&[3], 0, &[1])]).unwrap_err();
        assert!(matches!(again, Error::GroupLost(_)), "every later call fails at once: {again}");
    }
}
