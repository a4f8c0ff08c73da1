//! A decode step with fixed shapes, the step a CUDA graph captures: `rows` sequences of one
//! new token each, block tables `width` blocks wide, every input in a device buffer that
//! [`DecodeBatch::fill`] overwrites in place before each run (one host-to-device copy). The
//! pass makes no host round trip and no shape depends on the batch's contents: rows past
//! the batch are padding (token 0 at position 0, writing and reading only the pool's pad
//! block), and attention reads every row's `width` blocks, masked to its length — through
//! the paged decode kernel where one runs, else gathered as the packed pass does.

use tch::{Device, Kind, Tensor};

use super::paged::{grouped_decode, in_cache_masks};
use crate::attention::{Mask, Masks};
use crate::cache::{BLOCK_SIZE, LayerCache, PagedCache, SeqChunk};
use crate::cuda::{Kernel, Kernels};
use crate::error::{Error, Result};
use crate::rope::{RopeTables, Rotations};

/// The device buffers of one fixed-shape decode step.
#[derive(Debug)]
pub struct DecodeBatch {
    rows: i64,
    width: i64,
    /// Every input in one int64 buffer: ids, positions, slots and lengths (`rows` each), then
    /// the block tables (`rows · width`); the fields below are views of it.
    buffer: Tensor,
    ids: Tensor,
    positions: Tensor,
    slots: Tensor,
    lens: Tensor,
    tables: Tensor,
}

impl DecodeBatch {
    /// Buffers for `rows` sequences whose block tables hold up to `width` blocks.
    pub fn new(rows: usize, width: usize, device: Device) -> Result<Self> {
        if rows == 0 || width == 0 {
            return Err(Error::InvalidInput(format!("a decode batch of {rows} rows and {width} blocks")));
        }
        let (r, w) = (rows as i64, width as i64);
        let buffer = Tensor::f_zeros([4 * r + r * w], (Kind::Int64, device))?;
        let part = |i: i64| buffer.f_narrow(0, i * r, r);
        Ok(Self {
            rows: r,
            width: w,
            ids: part(0)?.f_view([1, r])?,
            positions: part(1)?.f_view([1, r])?,
            slots: part(2)?,
            lens: part(3)?,
            tables: buffer.f_narrow(0, 4 * r, r * w)?.f_view([r, w])?,
            buffer,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows as usize
    }

    /// Blocks a row's table may hold: positions up to `width · BLOCK_SIZE`.
    pub fn width(&self) -> usize {
        self.width as usize
    }

    /// Writes `chunks` (one token each, logits wanted, at most `rows`) into the buffers, and
    /// zeroes the blocks they use for the first time.
    pub fn fill(&mut self, chunks: &[SeqChunk], cache: &mut PagedCache) -> Result<()> {
        let (rows, width) = (self.rows as usize, self.width as usize);
        if chunks.len() > rows {
            return Err(Error::InvalidInput(format!("{} sequences in a decode batch of {rows}", chunks.len())));
        }
        let pad = cache.pad_block();
        let mut host = vec![0i64; 4 * rows + rows * width];
        for (r, chunk) in chunks.iter().enumerate() {
            let p = chunk.context;
            let used = (p + 1).div_ceil(BLOCK_SIZE);
            if chunk.tokens.len() != 1 || used > width || chunk.blocks.len() < used {
                return Err(Error::InvalidInput(format!(
                    "decode row {r}: {} tokens at position {p} with {} blocks (one token, at most {width} blocks)",
                    chunk.tokens.len(),
                    chunk.blocks.len()
                )));
            }
            if let Some(&bad) = chunk.blocks[..used].iter().find(|&&b| b as usize >= cache.blocks()) {
                return Err(Error::InvalidInput(format!(
                    "decode row {r} names block {bad}; the pool has {}",
                    cache.blocks()
                )));
            }
            host[r] = chunk.tokens[0];
            host[rows + r] = p as i64;
            host[2 * rows + r] = i64::from(chunk.blocks[p / BLOCK_SIZE]) * BLOCK_SIZE as i64 + (p % BLOCK_SIZE) as i64;
            host[3 * rows + r] = p as i64 + 1;
            let table = &mut host[4 * rows + r * width..4 * rows + (r + 1) * width];
            for (slot, block) in table.iter_mut().zip(chunk.blocks[..used].iter().map(|&b| i64::from(b))) {
                *slot = block;
            }
            table[used..].fill(pad);
        }
        for r in chunks.len()..rows {
            host[2 * rows + r] = pad * BLOCK_SIZE as i64;
            host[3 * rows + r] = 1;
            host[4 * rows + r * width..4 * rows + (r + 1) * width].fill(pad);
        }
        cache.zero_fresh(chunks)?;
        self.buffer.f_copy_(&Tensor::from_slice(&host))?;
        Ok(())
    }
}

/// Final hidden states [rows, hidden] of a decode step over `batch` (see [`super::paged::last_hidden`]
/// for `layers`; here every token asks for logits).
pub(crate) fn decode_hidden(
    batch: &DecodeBatch,
    cache: &mut PagedCache,
    windows: &[Option<i64>],
    rotary: &Rotations,
    kind: Kind,
    kernels: Option<&Kernels>,
    layers: impl FnOnce(&Tensor, &RopeTables, &Masks, &mut dyn LayerCache) -> Result<Tensor>,
) -> Result<Tensor> {
    let _no_grad = tch::no_grad_guard();
    let device = cache.device();
    if batch.buffer.device() != device {
        return Err(Error::InvalidInput(format!(
            "a decode batch on {:?} for a pool on {device:?}",
            batch.buffer.device()
        )));
    }
    let rope = rotary.tables(&batch.positions, kind)?;
    let masks = in_cache_masks(windows);
    let read = match kernels.filter(|k| k.runs(Kernel::PagedDecode, device, kind)) {
        Some(kernels) => {
            Read::Kernel { kernels, tables: batch.tables.f_to_kind(Kind::Int)?, lens: batch.lens.f_to_kind(Kind::Int)? }
        }
        None => Read::Gather { masks: gather_masks(batch, windows)? },
    };
    let mut step = DecodeStep { cache, batch, read };
    let hidden = layers(&batch.ids, &rope, &masks, &mut step)?;
    Ok(hidden.f_squeeze_dim(0)?)
}

/// Which keys each row reads on the gather path, per window: [1, rows, 1, width · BLOCK_SIZE].
fn gather_masks(batch: &DecodeBatch, windows: &[Option<i64>]) -> Result<Vec<(Option<i64>, Tensor)>> {
    let keys = batch.width * BLOCK_SIZE as i64;
    let key = Tensor::f_arange(keys, (Kind::Int64, batch.buffer.device()))?.f_view([1, 1, 1, keys])?;
    let last = batch.lens.f_sub_scalar(1)?.f_view([1, batch.rows, 1, 1])?;
    let mut distinct = windows.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    distinct
        .into_iter()
        .map(|w| {
            let mut allowed = key.f_le_tensor(&last)?;
            if let Some(w) = w {
                allowed = allowed.f_logical_and(&last.f_sub(&key)?.f_lt(w)?)?;
            }
            Ok((w, allowed))
        })
        .collect()
}

/// How the step's attention reads the pool.
enum Read<'a> {
    Kernel { kernels: &'a Kernels, tables: Tensor, lens: Tensor },
    Gather { masks: Vec<(Option<i64>, Tensor)> },
}

struct DecodeStep<'a> {
    cache: &'a mut PagedCache,
    batch: &'a DecodeBatch,
    read: Read<'a>,
}

impl LayerCache for DecodeStep<'_> {
    fn attend(
        &mut self,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _mask: &Mask,
        window: Option<i64>,
        softcap: Option<f64>,
    ) -> Result<Tensor> {
        self.cache.write(layer, &self.batch.slots, k, v)?;
        let (keys, values) = (&self.cache.keys[layer], &self.cache.values[layer]);
        let (rows, width) = (self.batch.rows, self.batch.width);
        match &self.read {
            Read::Kernel { kernels, tables, lens } => {
                let out = kernels.paged_decode(
                    &q.f_squeeze_dim(0)?,
                    keys,
                    values,
                    tables,
                    lens,
                    width * BLOCK_SIZE as i64,
                    BLOCK_SIZE as i64,
                    window,
                )?;
                Ok(out.f_unsqueeze(0)?)
            }
            Read::Gather { masks } => {
                let blocks = self.batch.tables.f_reshape([-1])?;
                let (kd, vd) = (self.cache.gather(keys, &blocks, rows)?, self.cache.gather(values, &blocks, rows)?);
                let mask = masks.iter().find(|(w, _)| *w == window).map(|(_, m)| m);
                grouped_decode(q, &kd, &vd, mask, softcap)
            }
        }
    }
}

/// Batch sizes a decode step is captured at: 1, 2, 4, 8, then multiples of 8 up to
/// `max_num_seqs` (which is always one). A step runs in the smallest that holds it.
pub fn graph_buckets(max_num_seqs: usize) -> Vec<usize> {
    let mut buckets: Vec<usize> =
        [1, 2, 4].into_iter().chain((8..).step_by(8)).take_while(|&b| b < max_num_seqs).collect();
    buckets.push(max_num_seqs.max(1));
    buckets
}

/// A decode step captured at one batch size, with its buffers and its output (final hidden
/// states: the LM head runs after the replay, on the real rows only, so no bucket keeps a
/// [rows, vocab] buffer in the pool).
#[derive(Debug)]
struct Captured {
    batch: DecodeBatch,
    graph: crate::cuda::graph::CudaGraph,
    hidden: Tensor,
}

/// The decode step of one model captured as CUDA graphs, one per batch-size bucket
/// ([`graph_buckets`]), sharing one memory pool. A step of single-token rows is replayed
/// in the smallest bucket that holds it, its rows padded; anything else runs eagerly.
#[derive(Debug)]
pub struct DecodeGraphs {
    captured: Vec<Captured>,
    width: usize,
}

impl DecodeGraphs {
    /// Captures `model`'s decode step over `cache` for every bucket up to `max_num_seqs`
    /// rows of tables `width` blocks wide (`max_model_len` / BLOCK_SIZE, rounded up). Needs
    /// the model's paged decode kernel (the gather path reads every row's whole table, too
    /// slow at full width). Each graph is replayed once and compared with the eager step.
    pub fn capture(model: &super::CausalLm, cache: &mut PagedCache, max_num_seqs: usize, width: usize) -> Result<Self> {
        if model.config().moe.is_some() {
            // The experts' token counts are read on the host to group the tokens: a sync no
            // graph can hold.
            return Err(Error::Device("CUDA graphs are not captured for mixture-of-experts models".into()));
        }
        let device = model.device();
        let runs = model.kernels.as_deref().is_some_and(|k| k.runs(Kernel::PagedDecode, device, model.kind()));
        if !runs {
            return Err(Error::Device("CUDA graphs need the paged decode kernel, which is off".into()));
        }
        let pool = crate::cuda::graph::GraphPool::new()?;
        let mut captured = Vec::new();
        // Largest first, so smaller graphs reuse the pool's memory.
        for rows in graph_buckets(max_num_seqs).into_iter().rev() {
            let mut batch = DecodeBatch::new(rows, width, device)?;
            batch.fill(&[], cache)?;
            // Warm-up: libtorch settles its allocations and lazy initialisation eagerly first.
            let eager = model.decode_hidden_states(&batch, cache)?;
            let _ = model.decode_hidden_states(&batch, cache)?;
            let (graph, hidden) =
                crate::cuda::graph::CudaGraph::capture(device, &pool, || model.decode_hidden_states(&batch, cache))?;
            graph.replay()?;
            let worst = hidden.f_sub(&eager)?.f_abs()?.f_max()?.f_to_kind(Kind::Double)?.f_double_value(&[])?;
            if worst.is_nan() || worst > 1e-3 {
                return Err(Error::Device(format!(
                    "the decode graph of {rows} rows differs from the eager step by {worst:e}"
                )));
            }
            captured.push(Captured { batch, graph, hidden });
        }
        captured.reverse();
        Ok(Self { captured, width })
    }

    /// The batch sizes captured.
    pub fn buckets(&self) -> Vec<usize> {
        self.captured.iter().map(|c| c.batch.rows()).collect()
    }

    /// Whether `chunks` can replay a graph: single tokens wanting logits, few enough rows,
    /// tables within the captured width.
    pub fn fits(&self, chunks: &[SeqChunk]) -> bool {
        let rows = self.captured.last().map_or(0, |c| c.batch.rows());
        !chunks.is_empty()
            && chunks.len() <= rows
            && chunks
                .iter()
                .all(|c| c.tokens.len() == 1 && c.logits && (c.context + 1).div_ceil(BLOCK_SIZE) <= self.width)
    }

    /// Logits [chunks, vocab] of a decode step of `model` replayed in the smallest bucket
    /// that holds `chunks` (which must [fit](Self::fits)), the LM head applied after it.
    pub fn run(&mut self, model: &super::CausalLm, chunks: &[SeqChunk], cache: &mut PagedCache) -> Result<Tensor> {
        if !self.fits(chunks) {
            return Err(Error::InvalidInput(format!("{} chunks do not fit the captured decode graphs", chunks.len())));
        }
        let bucket = self
            .captured
            .iter_mut()
            .find(|c| c.batch.rows() >= chunks.len())
            .ok_or_else(|| Error::InvalidInput("no decode graph holds this step".into()))?;
        bucket.batch.fill(chunks, cache)?;
        bucket.graph.replay()?;
        model.lm_logits(&bucket.hidden.f_narrow(0, 0, chunks.len() as i64)?)
    }
}
