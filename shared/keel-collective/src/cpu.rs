//! The CPU backend: the ranks are threads of one process. Each operation starts with a
//! meeting where every rank puts (a reference to) its tensor in its slot and waits for the
//! others; each then reads what it needs from all slots in rank order (so every rank gets
//! bit-identical values) and waits again, so that no rank changes its tensor while another
//! still reads it; then each writes its own result. All-reduce splits the work: rank r
//! reduces the r-th of W chunks of the flattened tensors, and every rank then gathers the
//! W reduced chunks (three meetings).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tch::Tensor;

use crate::{Collective, Error, ReduceOp, Result, reduce, scatter_chunk};

/// How long a rank waits for the others by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Makes the ranks of a CPU group.
#[derive(Debug)]
pub struct CpuGroup;

impl CpuGroup {
    /// `world_size` ranks, one [`CpuCollective`] each, to be moved to their threads.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world_size: usize) -> Result<Vec<CpuCollective>> {
        Self::with_timeout(world_size, DEFAULT_TIMEOUT)
    }

    /// [`CpuGroup::new`] where a rank gives up after waiting `timeout` for the others.
    pub fn with_timeout(world_size: usize, timeout: Duration) -> Result<Vec<CpuCollective>> {
        if world_size == 0 {
            return Err(Error::Invalid("a group needs at least one rank".into()));
        }
        let shared = Arc::new(Shared {
            world_size,
            timeout,
            state: Mutex::new(State {
                slots: (0..world_size).map(|_| None).collect(),
                parts: (0..world_size).map(|_| None).collect(),
                arrived: 0,
                generation: 0,
                aborted: None,
            }),
            changed: Condvar::new(),
        });
        Ok((0..world_size).map(|rank| CpuCollective { rank, shared: shared.clone() }).collect())
    }
}

#[derive(Debug)]
struct Shared {
    world_size: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Debug)]
struct State {
    slots: Vec<Option<Tensor>>,
    /// All-reduce: the chunk each rank reduced.
    parts: Vec<Option<Tensor>>,
    arrived: usize,
    generation: u64,
    aborted: Option<String>,
}

/// One rank of a [`CpuGroup`]. Dropping it before the others are done aborts the group.
#[derive(Debug)]
pub struct CpuCollective {
    rank: usize,
    shared: Arc<Shared>,
}

impl Drop for CpuCollective {
    /// A rank leaving (done, failed or panicking) aborts the group, so the others get an
    /// error at their next operation instead of waiting for the timeout. Operations that
    /// already met are unaffected.
    fn drop(&mut self) {
        let why = if std::thread::panicking() { "panicked" } else { "left the group" };
        self.abort(format!("rank {} {why}", self.rank));
    }
}

impl CpuCollective {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks the group unusable and wakes every waiting rank.
    pub fn abort(&self, reason: String) {
        let mut state = self.lock();
        state.aborted.get_or_insert(reason);
        self.shared.changed.notify_all();
    }

    /// Waits until every rank has arrived here.
    fn meet(&self, operation: &'static str) -> Result<()> {
        let mut state = self.lock();
        if let Some(reason) = &state.aborted {
            return Err(Error::Aborted { rank: self.rank, operation, reason: reason.clone() });
        }
        let generation = state.generation;
        state.arrived += 1;
        if state.arrived == self.shared.world_size {
            state.arrived = 0;
            state.generation += 1;
            self.shared.changed.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + self.shared.timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (next, _) = self.shared.changed.wait_timeout(state, left).unwrap_or_else(|e| e.into_inner());
            state = next;
            if state.generation != generation {
                return Ok(());
            }
            if let Some(reason) = &state.aborted {
                return Err(Error::Aborted { rank: self.rank, operation, reason: reason.clone() });
            }
            if Instant::now() >= deadline {
                let seconds = self.shared.timeout.as_secs_f64();
                state.aborted = Some(format!("rank {} waited {seconds} s in {operation}", self.rank));
                self.shared.changed.notify_all();
                return Err(Error::Timeout { rank: self.rank, operation, seconds });
            }
        }
    }

    /// Shares `tensor` and returns every rank's, in rank order, once all have shared. The
    /// caller must call [`CpuCollective::done`] after reading them.
    fn exchange(&self, operation: &'static str, tensor: &Tensor) -> Result<Vec<Tensor>> {
        self.lock().slots[self.rank] = Some(tensor.shallow_clone());
        self.meet(operation)?;
        let tensors: Vec<Tensor> = self
            .lock()
            .slots
            .iter()
            .map(|slot| slot.as_ref().map(Tensor::shallow_clone))
            .collect::<Option<_>>()
            .ok_or(Error::Aborted { rank: self.rank, operation, reason: "a rank's tensor is missing".into() })?;
        let first = &tensors[0];
        for (rank, other) in tensors.iter().enumerate().skip(1) {
            if other.kind() != first.kind() || other.device() != first.device() {
                let message = format!(
                    "{operation}: rank {rank} passed {:?} on {:?}, rank 0 {:?} on {:?}",
                    other.kind(),
                    other.device(),
                    first.kind(),
                    first.device()
                );
                self.done(operation)?;
                return Err(Error::Mismatch { rank: self.rank, message });
            }
        }
        Ok(tensors)
    }

    /// The second meeting: every rank has read the others' tensors.
    fn done(&self, operation: &'static str) -> Result<()> {
        let met = self.meet(operation);
        self.lock().slots[self.rank] = None;
        met
    }

    fn same_shapes(&self, operation: &'static str, tensors: &[Tensor]) -> Result<()> {
        let shape = tensors[0].size();
        match tensors.iter().position(|t| t.size() != shape) {
            None => Ok(()),
            Some(rank) => {
                let message =
                    format!("{operation}: rank {rank} passed shape {:?}, rank 0 {shape:?}", tensors[rank].size());
                self.done(operation)?;
                Err(Error::Mismatch { rank: self.rank, message })
            }
        }
    }
}

impl Collective for CpuCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
        const OPERATION: &str = "all_reduce";
        let tensors = self.exchange(OPERATION, &tensor.contiguous())?;
        self.same_shapes(OPERATION, &tensors)?;
        let world = self.shared.world_size as i64;
        let numel = tensor.numel() as i64;
        let (start, end) = (numel * self.rank as i64 / world, numel * (self.rank as i64 + 1) / world);
        let chunks: Vec<Tensor> = tensors.iter().map(|t| t.view(-1).narrow(0, start, end - start)).collect();
        let part = reduce(&chunks, op);
        drop((chunks, tensors));
        self.lock().parts[self.rank] = Some(part);
        self.done(OPERATION)?;
        let parts: Option<Vec<Tensor>> =
            self.lock().parts.iter().map(|p| p.as_ref().map(Tensor::shallow_clone)).collect();
        let Some(parts) = parts else {
            return Err(Error::Aborted {
                rank: self.rank,
                operation: OPERATION,
                reason: "a rank's chunk is missing".into(),
            });
        };
        // The chunks go straight into this rank's tensor when its memory is one block (no
        // rank reads it any more), else through a gathered copy.
        let staged = if tensor.is_contiguous() {
            let flat = tensor.view(-1);
            let mut at = 0;
            for part in &parts {
                let length = part.numel() as i64;
                flat.narrow(0, at, length).copy_(part);
                at += length;
            }
            None
        } else {
            Some(Tensor::cat(&parts, 0))
        };
        drop(parts);
        let met = self.meet(OPERATION);
        self.lock().parts[self.rank] = None;
        met?;
        if let Some(result) = staged {
            tensor.copy_(&result.view(tensor.size().as_slice()));
        }
        Ok(())
    }

    fn all_gather(&self, tensor: &Tensor, dim: i64) -> Result<Tensor> {
        let tensors = self.exchange("all_gather", tensor)?;
        let result = Tensor::f_cat(&tensors, dim);
        drop(tensors);
        self.done("all_gather")?;
        result.map_err(|e| Error::Mismatch { rank: self.rank, message: format!("all_gather along {dim}: {e}") })
    }

    fn reduce_scatter(&self, tensor: &Tensor, dim: i64, op: ReduceOp) -> Result<Tensor> {
        let tensors = self.exchange("reduce_scatter", tensor)?;
        self.same_shapes("reduce_scatter", &tensors)?;
        // Every rank sees the same shape, so every rank takes the same branch.
        let result = scatter_chunk(&reduce(&tensors, op), dim, self.rank, self.shared.world_size)
            .map_err(|e| Error::Mismatch { rank: self.rank, message: e.to_string() });
        drop(tensors);
        self.done("reduce_scatter")?;
        result
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<()> {
        if root >= self.shared.world_size {
            return Err(Error::Invalid(format!("broadcast from rank {root} in a group of {}", self.shared.world_size)));
        }
        let tensors = self.exchange("broadcast", tensor)?;
        self.same_shapes("broadcast", &tensors)?;
        let result = (self.rank != root).then(|| tensors[root].copy());
        drop(tensors);
        self.done("broadcast")?;
        if let Some(result) = result {
            tensor.copy_(&result);
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.meet("barrier")
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// Runs `f(rank collective)` on `world` threads and returns their results in rank order.
    pub(crate) fn on_ranks<T: Send + 'static>(
        world: usize,
        f: impl Fn(CpuCollective) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        let handles: Vec<_> = CpuGroup::new(world)
            .unwrap()
            .into_iter()
            .map(|c| {
                let f = f.clone();
                std::thread::spawn(move || f(c))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn values(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(t.flatten(0, -1).to_kind(Kind::Float)).unwrap()
    }

    fn rank_tensor(rank: usize, n: i64) -> Tensor {
        Tensor::arange(n, (Kind::Float, Device::Cpu)) * (rank as f64 + 1.0) + rank as f64
    }

    #[test]
    fn all_reduce_sum_and_max_give_every_rank_the_same() {
        for world in [1, 2, 3, 4] {
            let results = on_ranks(world, |c| {
                let mut sum = rank_tensor(c.rank(), 6);
                c.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
                let mut max = Tensor::from_slice(&[c.rank() as f32, -(c.rank() as f32)]);
                c.all_reduce(&mut max, ReduceOp::Max).unwrap();
                (values(&sum), values(&max))
            });
            let expected: Vec<f32> =
                (0..6).map(|i| (0..world).map(|r| i as f32 * (r as f32 + 1.0) + r as f32).sum()).collect();
            for (sum, max) in results {
                assert_eq!(sum, expected, "world {world}");
                assert_eq!(max, [world as f32 - 1.0, 0.0], "world {world}");
            }
        }
    }

    #[test]
    fn all_reduce_of_a_non_contiguous_tensor_keeps_its_layout() {
        let results = on_ranks(3, |c| {
            let base = Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]) * (c.rank() as f64 + 1.0);
            let mut t = base.transpose(0, 1);
            c.all_reduce(&mut t, ReduceOp::Sum).unwrap();
            (t.size(), values(&t))
        });
        for (shape, got) in results {
            assert_eq!(shape, [3, 2]);
            assert_eq!(got, [0.0, 18.0, 6.0, 24.0, 12.0, 30.0]);
        }
    }

    #[test]
    fn all_gather_reduce_scatter_and_broadcast() {
        let results = on_ranks(4, |c| {
            let mine = Tensor::full([2, 1], c.rank() as f64, (Kind::Float, Device::Cpu));
            let gathered = c.all_gather(&mine, 1).unwrap();
            let scattered = c.reduce_scatter(&rank_tensor(c.rank(), 8), 0, ReduceOp::Sum).unwrap();
            let mut b = Tensor::full([3], c.rank() as f64 * 10.0, (Kind::Float, Device::Cpu));
            c.broadcast(&mut b, 2).unwrap();
            c.barrier().unwrap();
            (gathered.size(), values(&gathered), values(&scattered), values(&b))
        });
        let total: Vec<f32> = (0..8).map(|i| (0..4).map(|r| i as f32 * (r as f32 + 1.0) + r as f32).sum()).collect();
        for (rank, (shape, gathered, scattered, b)) in results.into_iter().enumerate() {
            assert_eq!(shape, [2, 4]);
            assert_eq!(gathered, [0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0]);
            assert_eq!(scattered, total[rank * 2..rank * 2 + 2]);
            assert_eq!(b, [20.0; 3]);
        }
    }

    #[test]
    fn mismatched_shapes_are_an_error_on_every_rank_and_the_group_goes_on() {
        let results = on_ranks(2, |c| {
            let mut bad = Tensor::zeros([2 + c.rank() as i64], (Kind::Float, Device::Cpu));
            let error = c.all_reduce(&mut bad, ReduceOp::Sum).unwrap_err();
            let mut good = Tensor::ones([2], (Kind::Float, Device::Cpu));
            c.all_reduce(&mut good, ReduceOp::Sum).unwrap();
            (error.to_string(), values(&good))
        });
        for (error, good) in results {
            assert!(error.contains("rank 1 passed shape [3]"), "{error}");
            assert_eq!(good, [2.0, 2.0]);
        }
    }

    #[test]
    fn a_missing_rank_times_out_instead_of_hanging() {
        let mut ranks = CpuGroup::with_timeout(2, Duration::from_millis(200)).unwrap();
        let absent = ranks.pop().unwrap();
        let waiting = ranks.pop().unwrap();
        let error = waiting.barrier().unwrap_err();
        assert!(matches!(error, Error::Timeout { rank: 0, operation: "barrier", .. }), "{error}");
        let after = absent.barrier().unwrap_err();
        assert!(matches!(after, Error::Aborted { rank: 1, .. }), "{after}");
    }

    #[test]
    fn a_rank_that_leaves_aborts_the_group_and_bad_dimensions_are_errors() {
        let mut ranks = CpuGroup::new(2).unwrap();
        drop(ranks.pop());
        let error = ranks[0].barrier().unwrap_err();
        assert!(error.to_string().contains("rank 1 left the group"), "{error}");

        let results = on_ranks(2, |c| {
            let t = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
            let bad = c.reduce_scatter(&t, 2, ReduceOp::Sum).unwrap_err().to_string();
            let good = c.reduce_scatter(&t, -1, ReduceOp::Sum).unwrap();
            (bad, good.size())
        });
        for (bad, good) in results {
            assert!(bad.contains("dimension 2 of [2, 2]"), "{bad}");
            assert_eq!(good, [2, 1]);
        }
    }

    #[test]
    fn single_rank_and_bad_arguments() {
        assert!(CpuGroup::new(0).is_err());
        let single = crate::Single;
        let mut t = Tensor::ones([2], (Kind::Float, Device::Cpu));
        single.all_reduce(&mut t, ReduceOp::Sum).unwrap();
        assert_eq!(values(&t), [1.0, 1.0]);
        assert!(single.broadcast(&mut t, 1).is_err());
        let ranks = CpuGroup::new(2).unwrap();
        assert!(ranks[0].broadcast(&mut t, 2).is_err());
    }
}
