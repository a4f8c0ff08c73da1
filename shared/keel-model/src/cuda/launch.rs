//! Launch shapes of the kernels in `kernels.cu`, computed and checked on the host: grid and
//! block sizes within CUDA's limits, shared memory within the default 48 KiB, and the split
//! of long contexts for decode attention. Pure functions, tested without a GPU.

use super::KernelError;

/// CUDA's limits on a launch.
const MAX_THREADS: u32 = 1024;
const MAX_GRID_X: i64 = (1 << 31) - 1;
const MAX_GRID_YZ: i64 = 65_535;
const MAX_SHARED_BYTES: i64 = 48 * 1024;
/// Threads per block of the elementwise kernels.
const ELEMENTWISE_THREADS: u32 = 256;
/// Threads per block of decode attention: four warps.
pub const ATTENTION_THREADS: u32 = 128;
/// Keys one decode-attention block takes when a context is split.
pub const PARTITION: i64 = 512;
/// (head, row) pairs from which decode attention has enough blocks without splitting.
const BUSY_PAIRS: i64 = 256;

/// Grid, block and dynamic shared memory of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchShape {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
}

/// ⌈a / b⌉ for positive i64 (`div_ceil` on signed integers is not stable).
fn ceil_div(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

fn shape_error(message: String) -> KernelError {
    KernelError::Shape(message)
}

fn grid_x(what: &str, blocks: i64) -> Result<u32, KernelError> {
    if !(1..=MAX_GRID_X).contains(&blocks) {
        return Err(shape_error(format!("{what}: {blocks} blocks is outside CUDA's grid (1..={MAX_GRID_X})")));
    }
    Ok(blocks as u32)
}

fn grid_yz(what: &str, blocks: i64) -> Result<u32, KernelError> {
    if !(1..=MAX_GRID_YZ).contains(&blocks) {
        return Err(shape_error(format!("{what}: {blocks} is outside CUDA's grid y/z limit (1..={MAX_GRID_YZ})")));
    }
    Ok(blocks as u32)
}

/// One block per row of `cols` values (RMSNorm): a warp multiple of threads, at most 1024.
pub fn per_row(rows: i64, cols: i64) -> Result<LaunchShape, KernelError> {
    if cols < 1 {
        return Err(shape_error(format!("rows of {cols} values")));
    }
    let threads = (cols.min(i64::from(MAX_THREADS)) as u32).div_ceil(32) * 32;
    Ok(LaunchShape { grid: (grid_x("rows", rows)?, 1, 1), block: (threads, 1, 1), shared_bytes: 0 })
}

/// One thread per item of `n`.
pub fn elementwise(n: i64) -> Result<LaunchShape, KernelError> {
    if n < 1 {
        return Err(shape_error(format!("{n} elements")));
    }
    let blocks = ceil_div(n, i64::from(ELEMENTWISE_THREADS));
    Ok(LaunchShape { grid: (grid_x("elements", blocks)?, 1, 1), block: (ELEMENTWISE_THREADS, 1, 1), shared_bytes: 0 })
}

/// Values of a head each lane of decode attention holds (`KEEL_VALUES_PER_LANE` in
/// kernels.cu): heads of up to 32 × this many values sum their values warp by warp, through
/// shared memory.
const VALUES_PER_LANE: i64 = 8;
/// The fewest keys a block takes when a context is split to spread it over the GPU.
const MIN_PARTITION: i64 = 32;

/// Decode attention of `rows` queries of `heads` heads of `dim` values over at most
/// `max_keys` keys a row: the launch, the keys each block takes and the number of splits
/// (above 1, partial results go through the reduction). With enough (head, row) pairs for the
/// GPU, one block takes a whole context; with fewer (small batches), contexts are split into
/// more blocks, of at least 32 keys, until there are about as many blocks as that many pairs
/// would give; and a context too long for one block's shared memory is split either way.
pub fn paged_decode(heads: i64, rows: i64, max_keys: i64, dim: i64) -> Result<(LaunchShape, i64, i64), KernelError> {
    if dim < 1 || dim > i64::from(MAX_THREADS) * 4 || max_keys < 1 {
        return Err(shape_error(format!("decode attention of head size {dim} over {max_keys} keys")));
    }
    let warps = i64::from(ATTENTION_THREADS / 32);
    // The query, then the scores, then (small heads) each warp's value sums.
    let shared_for = |partition: i64| (dim + partition + if dim <= 32 * VALUES_PER_LANE { warps * dim } else { 0 }) * 4;
    let whole = ceil_div(max_keys, 32) * 32;
    let pairs = heads * rows;
    let partition = if pairs >= BUSY_PAIRS && shared_for(whole) <= MAX_SHARED_BYTES {
        whole
    } else if pairs >= BUSY_PAIRS {
        PARTITION
    } else {
        let wanted = ceil_div(BUSY_PAIRS, pairs.max(1));
        (ceil_div(ceil_div(max_keys, wanted), 32) * 32).clamp(MIN_PARTITION, PARTITION).min(whole)
    };
    let splits = ceil_div(max_keys, partition);
    let shared = shared_for(partition);
    if shared > MAX_SHARED_BYTES {
        return Err(shape_error(format!("decode attention needs {shared} bytes of shared memory")));
    }
    let shape = LaunchShape {
        grid: (grid_x("heads", heads)?, grid_yz("rows", rows)?, grid_yz("splits", splits)?),
        block: (ATTENTION_THREADS, 1, 1),
        shared_bytes: shared as u32,
    };
    Ok((shape, partition, splits))
}

/// The reduction over splits: one block per (head, row), threads over the head's values.
pub fn paged_reduce(heads: i64, rows: i64, dim: i64) -> Result<LaunchShape, KernelError> {
    let threads = (dim.clamp(1, i64::from(MAX_THREADS)) as u32).div_ceil(32) * 32;
    Ok(LaunchShape {
        grid: (grid_x("heads", heads)?, grid_yz("rows", rows)?, 1),
        block: (threads, 1, 1),
        shared_bytes: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_and_elements_stay_within_cuda_limits() {
        assert_eq!(per_row(7, 1024).unwrap().block, (1024, 1, 1));
        assert_eq!(per_row(7, 4096).unwrap().block, (1024, 1, 1));
        assert_eq!(per_row(7, 40).unwrap().block, (64, 1, 1), "a warp multiple");
        assert_eq!(per_row(7, 40).unwrap().grid, (7, 1, 1));
        assert!(per_row(0, 40).is_err() && per_row(3, 0).is_err());
        assert_eq!(elementwise(257).unwrap().grid, (2, 1, 1));
        assert!(elementwise(0).is_err());
        assert!(elementwise(MAX_GRID_X * 256 + 1).is_err(), "past the grid");
    }

    #[test]
    fn decode_attention_splits_long_contexts_of_small_batches() {
        // Batch 1, 16 heads, a 4096-token context: 8 splits of 512 keys.
        let (shape, partition, splits) = paged_decode(16, 1, 4096, 128).unwrap();
        assert_eq!((partition, splits), (256, 16));
        assert_eq!(shape.grid, (16, 1, 16));
        assert_eq!(shape.shared_bytes, ((128 + 256 + 4 * 128) * 4) as u32, "query, scores, the warps' sums");
        // 64 rows × 16 heads: enough blocks, one split over the whole context.
        let (shape, partition, splits) = paged_decode(16, 64, 1000, 128).unwrap();
        assert_eq!((partition, splits), (1024, 1));
        assert_eq!(shape.grid, (16, 64, 1));
        // One sequence of 16 heads: a short context splits into blocks of 32 keys, so the GPU
        // gets tens of blocks, not 16.
        let (shape, partition, splits) = paged_decode(16, 1, 130, 128).unwrap();
        assert_eq!((partition, splits), (32, 5));
        assert_eq!(shape.grid, (16, 1, 5));
        // Never more splits than keys in blocks of 32, nor blocks longer than the context.
        let (_, partition, splits) = paged_decode(2, 1, 20, 64).unwrap();
        assert_eq!((partition, splits), (32, 1));
        // A context too long for one block's shared memory splits even when the GPU is busy.
        let (shape, partition, splits) = paged_decode(32, 256, 32_768, 128).unwrap();
        assert_eq!((partition, splits), (512, 64));
        assert!(i64::from(shape.shared_bytes) <= MAX_SHARED_BYTES);
        // Large heads keep no value sums in shared memory.
        assert_eq!(paged_decode(4, 64, 100, 512).unwrap().0.shared_bytes, ((512 + 128) * 4) as u32);
    }

    #[test]
    fn impossible_attention_launches_are_refused() {
        assert!(paged_decode(16, 70_000, 100, 128).is_err(), "rows past grid y");
        assert!(paged_decode(16, 1, 0, 128).is_err());
        assert!(paged_decode(16, 1, 100, 0).is_err());
        assert!(paged_decode(16, 1, 100, 1 << 13).is_err());
        assert_eq!(paged_reduce(16, 3, 128).unwrap().block, (128, 1, 1));
    }
}
