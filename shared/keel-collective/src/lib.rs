//! Collective operations on tch tensors, the communication tensor parallelism needs.
//!
//! [`Collective`] is what a tensor-parallel layer calls: one instance per rank, every rank
//! calling the same operations in the same order with tensors of the same shape and dtype.
//! Backends:
//! - [`cpu::CpuGroup`]: ranks are threads of one process exchanging tensors through shared
//!   memory. For tests, CPU runs and the reference the GPU backend is checked against.
//! - [`tcp::TcpCollective`]: ranks in separate processes or machines on the CPU, over TCP
//!   through rank 0, found over NATS like NCCL's ranks. For CPU runs whose ranks are
//!   processes (data parallelism across trainer processes) and their tests.
//! - [`nccl`]: NCCL communicators on CUDA tensors, one per GPU, in one process
//!   ([`nccl::NcclGroup`]) or across processes ([`nccl::NcclCollective::join`] with a unique
//!   id that [`bootstrap`] carries over NATS).
//!
//! [`RankGroup`] runs one thread per rank, each owning its state, and drives them in lockstep.
//! [`process`] drives ranks that are processes of their own, from the group's leader.
//!
//! On the CPU backends, a rank that stops calling (it failed, or its thread ended) makes the
//! others' next operation fail with [`Error::Timeout`] or [`Error::Aborted`] instead of
//! hanging. NCCL has no such guard of its own: a multi-process NCCL group
//! ([`join_process_group`]) gets a [`watchdog::Watchdog`], which aborts each surviving rank's
//! communicator when a rank process is lost, so their collectives end with an error. The
//! GPUs of one process ([`nccl::NcclGroup`]) live and die together and need none.

pub mod bootstrap;
pub mod cpu;
pub mod group;
pub mod nccl;
pub mod process;
pub mod tcp;
pub mod watchdog;

pub use group::{RankGroup, is_consequence, rank_zero};

use tch::Tensor;

/// How values from the ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// The ranks passed tensors that cannot be combined.
    #[error("rank {rank}: {message}")]
    Mismatch { rank: usize, message: String },
    /// Not every rank reached the operation in time.
    #[error("rank {rank}: {operation}: not every rank arrived within {seconds} s")]
    Timeout { rank: usize, operation: &'static str, seconds: f64 },
    /// Another rank gave up, so this group can no longer be used.
    #[error("rank {rank}: {operation}: the group was aborted ({reason})")]
    Aborted { rank: usize, operation: &'static str, reason: String },
    /// A rank's thread has ended (it panicked), so the group can no longer be used.
    #[error("rank {rank} has stopped")]
    Stopped { rank: usize },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The element-wise reduction of `tensors` in rank order (the same bits on every rank).
pub(crate) fn reduce(tensors: &[Tensor], op: ReduceOp) -> Tensor {
    let mut acc = tensors[0].copy();
    for t in &tensors[1..] {
        match op {
            ReduceOp::Sum => acc += t,
            ReduceOp::Max => acc = acc.maximum(t),
        }
    }
    acc
}

/// Chunk `rank` of `world_size` equal chunks of `tensor` along `dim`: what a reduce-scatter
/// gives that rank.
pub(crate) fn scatter_chunk(
    tensor: &Tensor,
    dim: i64,
    rank: usize,
    world_size: usize,
) -> std::result::Result<Tensor, BadSplit> {
    let (ndim, world) = (tensor.dim() as i64, world_size as i64);
    let length = (-ndim..ndim).contains(&dim).then(|| tensor.size()[dim.rem_euclid(ndim) as usize]);
    match length {
        Some(length) if length % world == 0 => {
            let part = length / world;
            tensor
                .f_narrow(dim, rank as i64 * part, part)
                .map(|c| c.contiguous())
                .map_err(|e| BadSplit::Tensor { dim, reason: e.to_string() })
        }
        _ => Err(BadSplit::Uneven { dim, shape: tensor.size(), world_size }),
    }
}

/// Why a reduce-scatter's result cannot be cut into the ranks' chunks.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum BadSplit {
    #[error("reduce_scatter: dimension {dim} of {shape:?} does not split into {world_size}")]
    Uneven { dim: i64, shape: Vec<i64>, world_size: usize },
    #[error("reduce_scatter along {dim}: {reason}")]
    Tensor { dim: i64, reason: String },
}

/// A shared library (NCCL, libtorch's CUDA library, a shim) that cannot be used on this
/// machine, and why. It is `Clone` so that a failed load can be kept for the life of the
/// process and reported on every later use without loading again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LibraryUnavailable(pub String);

/// Collective operations across the ranks of one group. Every rank must call the same
/// operations in the same order.
pub trait Collective: Send + std::fmt::Debug {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Replaces `tensor` on every rank by the element-wise reduction over the ranks.
    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()>;
    /// The ranks' tensors concatenated along `dim`, in rank order (the same on every rank).
    fn all_gather(&self, tensor: &Tensor, dim: i64) -> Result<Tensor>;
    /// The reduction over the ranks, split into `world_size` equal chunks along `dim`; this
    /// rank gets chunk `rank`.
    fn reduce_scatter(&self, tensor: &Tensor, dim: i64, op: ReduceOp) -> Result<Tensor>;
    /// Replaces `tensor` on every rank by `root`'s.
    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<()>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
}

/// The group of one rank: every operation is the identity. What a model uses at TP = 1.
#[derive(Debug, Default, Clone, Copy)]
pub struct Single;

impl Collective for Single {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_reduce(&self, _tensor: &mut Tensor, _op: ReduceOp) -> Result<()> {
        Ok(())
    }

    fn all_gather(&self, tensor: &Tensor, _dim: i64) -> Result<Tensor> {
        Ok(tensor.shallow_clone())
    }

    fn reduce_scatter(&self, tensor: &Tensor, _dim: i64, _op: ReduceOp) -> Result<Tensor> {
        Ok(tensor.shallow_clone())
    }

    fn broadcast(&self, _tensor: &mut Tensor, root: usize) -> Result<()> {
        if root == 0 { Ok(()) } else { Err(Error::Invalid(format!("broadcast from rank {root} in a group of 1"))) }
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}

/// A pointer to a communicator is one: `Box<dyn Collective>`, `Arc<dyn Collective + Sync>`.
macro_rules! delegate_collective {
    ($($pointer:ident<$t:ident: $($bound:path)?>),*) => {$(
        impl<$t: Collective $(+ $bound)? + ?Sized> Collective for $pointer<$t> {
            fn rank(&self) -> usize {
                (**self).rank()
            }

            fn world_size(&self) -> usize {
                (**self).world_size()
            }

            fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
                (**self).all_reduce(tensor, op)
            }

            fn all_gather(&self, tensor: &Tensor, dim: i64) -> Result<Tensor> {
                (**self).all_gather(tensor, dim)
            }

            fn reduce_scatter(&self, tensor: &Tensor, dim: i64, op: ReduceOp) -> Result<Tensor> {
                (**self).reduce_scatter(tensor, dim, op)
            }

            fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<()> {
                (**self).broadcast(tensor, root)
            }

            fn barrier(&self) -> Result<()> {
                (**self).barrier()
            }
        }
    )*};
}

use std::sync::Arc;

/// Waits between tries that double from 1 ms to `ceiling`, for ever: a peer that is nearly
/// ready (the usual case when two processes meet) is found within a millisecond or two, one
/// that is not is asked at most every `ceiling`.
pub(crate) fn backoff(ceiling: std::time::Duration) -> impl Iterator<Item = std::time::Duration> {
    use backon::BackoffBuilder;
    let first = std::time::Duration::from_millis(1).min(ceiling);
    backon::ExponentialBuilder::new().with_min_delay(first).with_max_delay(ceiling).without_max_times().build()
}

delegate_collective!(Box<T:>, Arc<T: Sync>);

/// A rank's communicator shared by the models of one rank (a policy and its reference run
/// one after the other on the same thread).
pub type SharedComm = std::sync::Arc<dyn Collective + Sync>;

/// The device of `rank` in a group made by [`new_group`] for `device`: `cuda:N+rank` for
/// `cuda:N`, the CPU for the CPU.
pub fn rank_device(device: tch::Device, rank: usize) -> tch::Device {
    match device {
        tch::Device::Cuda(first) => tch::Device::Cuda(first + rank),
        other => other,
    }
}

/// The communicators of a new group of `world_size` ranks whose tensors live on `device`:
/// threads over shared memory for the CPU; for CUDA, one NCCL communicator per GPU from
/// `cuda:N` on (rank r on `cuda:N+r`).
pub fn new_group(world_size: usize, device: tch::Device) -> Result<Vec<SharedComm>> {
    let devices: Vec<tch::Device> = (0..world_size).map(|rank| rank_device(device, rank)).collect();
    if world_size == 0 {
        return Err(Error::Invalid("a group needs at least one rank".into()));
    }
    new_group_on(&devices)
}

/// The communicators of a new group whose rank r's tensors live on `devices[r]`: threads
/// over shared memory when they are all the CPU, one NCCL communicator per GPU when they
/// are all CUDA devices.
pub fn new_group_on(devices: &[tch::Device]) -> Result<Vec<SharedComm>> {
    let world_size = devices.len();
    let device = *devices.first().ok_or_else(|| Error::Invalid("a group needs at least one rank".into()))?;
    match device {
        tch::Device::Cpu => {
            Ok(cpu::CpuGroup::new(world_size)?.into_iter().map(|c| std::sync::Arc::new(c) as SharedComm).collect())
        }
        tch::Device::Cuda(_) => {
            let indices = devices
                .iter()
                .map(|d| match d {
                    tch::Device::Cuda(index) => Ok(*index),
                    other => Err(Error::Invalid(format!("a group mixes CUDA and {other:?}"))),
                })
                .collect::<Result<Vec<usize>>>()?;
            Ok(nccl::NcclGroup::new(&indices)?.into_iter().map(|c| std::sync::Arc::new(c) as SharedComm).collect())
        }
        other => Err(Error::Invalid(format!("no collective backend for device {other:?}"))),
    }
}

/// This process's communicator in a group whose ranks are separate processes (on one
/// machine or several) that find each other over NATS on `subject` (unique to the group):
/// NCCL on GPU `ordinal` for `cuda:ordinal` (rank 0 makes the group's id and shares it on
/// `subject`), TCP through rank 0 on the CPU (rank 0 listens on `ip`, an address the others
/// reach). Every rank calls it; it returns once all have joined, or fails after `timeout`.
/// An NCCL rank is watched ([`watchdog::Watchdog`], its channel on `subject`.watchdog): when
/// another rank's process is lost, its communicator is aborted.
pub async fn join_process_group(
    client: &async_nats::Client,
    subject: &str,
    rank: usize,
    world_size: usize,
    device: tch::Device,
    ip: std::net::IpAddr,
    timeout: std::time::Duration,
) -> Result<SharedComm> {
    match device {
        tch::Device::Cpu => {
            Ok(Arc::new(tcp::TcpCollective::join(client, subject, rank, world_size, ip, timeout).await?))
        }
        tch::Device::Cuda(ordinal) => {
            let comm =
                nccl::NcclCollective::join_over_nats(client, subject, rank, world_size, ordinal, timeout).await?;
            let abort = comm.abort_handle();
            let on_failure = move |reason: String| abort.abort(&format!("the watchdog lost the group: {reason}"));
            let channel = format!("{subject}.watchdog");
            let channel = tcp::TcpCollective::join(client, &channel, rank, world_size, ip, timeout).await?;
            let watchdog = watchdog::Watchdog::start(channel, on_failure)?;
            Ok(Arc::new(comm.watched_by(watchdog)))
        }
        other => Err(Error::Invalid(format!("no collective backend for device {other:?}"))),
    }
}
