//! Collective operations on tch tensors, the communication tensor parallelism needs.
//!
//! [`Collective`] is what a tensor-parallel layer calls: one instance per rank, every rank
//! calling the same operations in the same order with tensors of the same shape and dtype.
//! Backends:
//! - [`cpu::CpuGroup`]: ranks are threads of one process exchanging tensors through shared
//!   memory. For tests, CPU runs and the reference the GPU backend is checked against.
//!
//! A rank that stops calling (it failed, or its thread ended) makes the others' next
//! operation fail with [`Error::Timeout`] or [`Error::Aborted`] instead of hanging.

pub mod cpu;

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
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Collective operations across the ranks of one group. Every rank must call the same
/// operations in the same order.
pub trait Collective: Send {
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
