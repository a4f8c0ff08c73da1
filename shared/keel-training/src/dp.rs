//! Data parallelism: what the ranks of a data-parallel group exchange. Every rank holds the
//! whole model (or, under tensor parallelism too, the same slices as its peers of the same
//! tensor-parallel rank) and the whole global batch; each trains on its share of the global
//! batch's rows with the loss normalised by the whole global batch's counts, so the sum of the
//! ranks' gradients is the gradient of the whole global batch. Gradients are summed over the
//! group in buckets of flattened tensors, metrics combined by kind (sums add, minima and
//! maxima combine), and the optimiser's state is sharded (ZeRO stage 1, in [`crate::optim`]):
//! each rank steps the parameters it owns and sends their new values to the others. Logprobs
//! are split the same way: each rank scores its share of the rows ([`all_gather_rows`]).
//!
//! The backward pass is not overlapped with the reduction: tch exposes no gradient hooks, so
//! the buckets are reduced after the last microbatch's backward pass.

use std::ops::Range;

use keel_collective::{Collective, ReduceOp};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// Bytes of gradients reduced in one collective call.
pub const BUCKET_BYTES: i64 = 32 << 20;

/// The rows of a global batch of `len` rows that data-parallel rank `rank` of `world`
/// trains on: contiguous, sizes differing by at most one.
pub fn shard(len: usize, rank: usize, world: usize) -> Range<usize> {
    (len * rank / world)..(len * (rank + 1) / world)
}

/// Sums `grads` (every rank's, in the same order and shapes) over the group, in buckets of at
/// most [`BUCKET_BYTES`] (a tensor larger than that is a bucket of its own), in place.
pub fn all_reduce_gradients(grads: &[Tensor], comm: &dyn Collective) -> Result<()> {
    let _guard = tch::no_grad_guard();
    let mut bucket: Vec<&Tensor> = Vec::new();
    let mut bytes = 0i64;
    let flush = |bucket: &mut Vec<&Tensor>| -> Result<()> {
        if bucket.is_empty() {
            return Ok(());
        }
        let flat: Vec<Tensor> = bucket.iter().map(|g| g.f_reshape([-1])).collect::<Result<_, _>>()?;
        let mut joined = Tensor::f_cat(&flat, 0)?;
        comm.all_reduce(&mut joined, ReduceOp::Sum)?;
        let mut at = 0;
        for grad in bucket.drain(..) {
            let n = grad.numel() as i64;
            // Into the gradient itself, whatever its layout (a reshaped copy would not write back).
            let mut target = grad.shallow_clone();
            target.f_copy_(&joined.f_narrow(0, at, n)?.f_view(grad.size().as_slice())?)?;
            at += n;
        }
        Ok(())
    };
    for grad in grads {
        let size = grad.numel() as i64 * grad.kind().elt_size_in_bytes() as i64;
        let same_kind = bucket.first().is_none_or(|first| first.kind() == grad.kind());
        if !bucket.is_empty() && (bytes + size > BUCKET_BYTES || !same_kind) {
            flush(&mut bucket)?;
            bytes = 0;
        }
        bucket.push(grad);
        bytes += size;
    }
    flush(&mut bucket)
}

/// Every rank's [`shard`] of a `len`-row result, gathered in row order on every rank: `mine`
/// holds this rank's rows (CPU); the exchange runs on `device` (NCCL reduces GPU tensors
/// only) and the whole comes back on the CPU.
pub fn all_gather_rows(mine: &Tensor, len: usize, comm: &dyn Collective, device: Device) -> Result<Tensor> {
    let world = comm.world_size();
    let most = len.div_ceil(world) as i64;
    let padded = mine.f_constant_pad_nd([0, 0, 0, most - mine.size()[0]])?.f_to_device(device)?;
    let gathered = comm.all_gather(&padded, 0)?.f_to_device(Device::Cpu)?;
    let parts = (0..world)
        .map(|rank| gathered.f_narrow(0, rank as i64 * most, shard(len, rank, world).len() as i64))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Tensor::f_cat(&parts, 0)?)
}

/// The ranks' bytes, in rank order (each rank passes its own; lengths may differ).
fn all_gather_bytes(mine: &[u8], comm: &dyn Collective, device: Device) -> Result<Vec<Vec<u8>>> {
    let world = comm.world_size();
    let length = Tensor::from_slice(&[mine.len() as i64]).f_to_device(device)?;
    let lengths = Vec::<i64>::try_from(comm.all_gather(&length, 0)?.f_to_device(Device::Cpu)?)?;
    let longest = lengths.iter().copied().max().unwrap_or(0).max(1);
    let padded = Tensor::f_zeros([longest], (Kind::Uint8, Device::Cpu))?;
    if !mine.is_empty() {
        padded.f_narrow(0, 0, mine.len() as i64)?.f_copy_(&Tensor::from_slice(mine))?;
    }
    let gathered = comm.all_gather(&padded.f_to_device(device)?, 0)?.f_to_device(Device::Cpu)?;
    let all = Vec::<u8>::try_from(gathered)?;
    Ok((0..world).map(|r| all[r * longest as usize..][..lengths[r] as usize].to_vec()).collect())
}

/// The group's metrics from each rank's share: merged in rank order, as if one rank had
/// run every microbatch.
pub fn combine_metrics(mine: Metrics, comm: &dyn Collective, device: Device) -> Result<Metrics> {
    let mut combined = Metrics::default();
    for (rank, bytes) in all_gather_bytes(&mine.to_bytes(), comm, device)?.into_iter().enumerate() {
        let theirs = Metrics::from_bytes(&bytes)
            .ok_or_else(|| Error::Internal(format!("data-parallel rank {rank} sent unreadable metrics")))?;
        combined.merge(theirs);
    }
    Ok(combined)
}

/// Whether every rank of the group succeeded (each passes its own outcome): so that all of
/// them skip the step together when one failed instead of waiting for it in a collective.
pub fn all_succeeded(ok: bool, comm: &dyn Collective, device: Device) -> Result<bool> {
    let mut failed = Tensor::from_slice(&[i64::from(!ok)]).f_to_device(device)?;
    comm.all_reduce(&mut failed, ReduceOp::Max)?;
    Ok(failed.f_int64_value(&[0])? == 0)
}

/// Which rank owns (steps, and keeps the optimiser state of) each of the parameters of
/// `sizes` elements: the largest first, each to the rank with the fewest elements so far
/// (ties to the lowest rank), so that every rank computes the same assignment.
pub fn owners(sizes: &[i64], world: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(sizes[i]), i));
    let mut load = vec![0i64; world];
    let mut owner = vec![0; sizes.len()];
    for i in order {
        let rank = (0..world).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        owner[i] = rank;
        load[rank] += sizes[i];
    }
    owner
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_collective::cpu::CpuGroup;

    #[test]
    fn shards_cover_the_rows_once() {
        for (len, world) in [(8, 2), (7, 3), (2, 4), (0, 2)] {
            let rows: Vec<usize> = (0..world).flat_map(|r| shard(len, r, world)).collect();
            assert_eq!(rows, (0..len).collect::<Vec<_>>(), "{len} rows over {world}");
        }
    }

    #[test]
    fn owners_balance_the_elements() {
        let owner = owners(&[100, 10, 60, 50, 5], 2);
        assert_eq!(owner, [0, 0, 1, 1, 0]);
        assert_eq!(owners(&[3, 3], 1), [0, 0]);
    }

    #[test]
    fn gradients_metrics_and_failures_combine_over_ranks() {
        let handles: Vec<_> = CpuGroup::new(3)
            .unwrap()
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let rank = c.rank() as f64;
                    // A large tensor (a bucket of its own), small ones, and a bf16 one.
                    let big = Tensor::ones([(BUCKET_BYTES / 4 + 3)], (Kind::Float, Device::Cpu)) * rank;
                    let small = Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]) + rank;
                    let half = Tensor::full([4], rank, (Kind::BFloat16, Device::Cpu));
                    // A transposed (non-contiguous) one is summed in place too.
                    let strided = (Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]) + rank).transpose(0, 1);
                    let grads =
                        [big.shallow_clone(), small.shallow_clone(), half.shallow_clone(), strided.shallow_clone()];
                    all_reduce_gradients(&grads, &c).unwrap();
                    assert_eq!(
                        Vec::<f32>::try_from(strided.contiguous().view(-1)).unwrap(),
                        [3.0, 12.0, 6.0, 15.0, 9.0, 18.0]
                    );
                    let mut metrics = Metrics::default();
                    if c.rank() != 1 {
                        metrics.sum("loss", rank + 1.0);
                        metrics.max("ratio_max", rank);
                    }
                    metrics.global("global_valid_tokens", 9.0);
                    let combined = combine_metrics(metrics, &c, Device::Cpu).unwrap().into_map();
                    let agreed = all_succeeded(c.rank() != 2, &c, Device::Cpu).unwrap();
                    let sums = (big.max().double_value(&[]), Vec::<f32>::try_from(small.view(-1)).unwrap());
                    (sums, half.to_kind(Kind::Float).double_value(&[0]), combined, agreed)
                })
            })
            .collect();
        for handle in handles {
            let ((big, small), half, metrics, agreed) = handle.join().unwrap();
            assert_eq!(big, 3.0);
            assert_eq!(small, [3.0, 6.0, 9.0, 12.0, 15.0, 18.0]);
            assert_eq!(half, 3.0);
            assert_eq!((metrics["loss"], metrics["ratio_max"], metrics["global_valid_tokens"]), (4.0, 2.0, 9.0));
            assert!(!agreed, "rank 2 failed");
        }
    }
}
