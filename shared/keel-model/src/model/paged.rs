//! The paged forward pass: chunks of many sequences (one token of each decoding sequence,
//! any number of prompt tokens of others) packed into one pass of the linear layers, with
//! attention reading and writing the [`PagedCache`] blocks where they are.
//!
//! Packing puts the single-token chunks first, then the longer ones, each contiguous. In
//! every layer the new keys and values are written to their slots in one indexed copy; the
//! single-token chunks then attend together, over their own blocks gathered by block table
//! (padded with the pool's zero block and masked to each row's length); each longer chunk
//! attends on its own: to its fresh keys with a causal mask when it starts a sequence, or to
//! its blocks with a causal mask offset by its context when it continues one (chunked
//! prefill, recomputation, a prefix found in the cache). No pass touches blocks of sequences
//! that are not in it, so the work per step follows the tokens in the step, not the pool.

use tch::{Device, Kind, Tensor};

use crate::attention::{Mask, Masks, attention, eager_attention};
use crate::cache::{BLOCK_SIZE, LayerCache, PagedCache, SeqChunk};
use crate::cuda::{Kernel, Kernels};
use crate::error::{Error, Result};
use crate::rope::{RopeTables, Rotations};

/// Final hidden states [R, hidden] of the last token of every chunk that asks for logits
/// (inference, no gradients): the chunks are checked, packed and run through `layers` (given
/// the packed ids, the rotary tables, the masks and the pass's view of `cache`). What a
/// whole model and a tensor-parallel rank share of a paged pass; each applies its own head.
/// With `kernels` whose decode attention runs here, the single-token chunks attend through
/// it, reading their blocks in place.
#[allow(clippy::too_many_arguments)]
pub(crate) fn last_hidden(
    chunks: &[SeqChunk],
    cache: &mut PagedCache,
    vocab: i64,
    windows: &[Option<i64>],
    rotary: &Rotations,
    kind: Kind,
    kernels: Option<&Kernels>,
    layers: impl FnOnce(&Tensor, &RopeTables, &Masks, &mut dyn LayerCache) -> Result<Tensor>,
) -> Result<Tensor> {
    let _no_grad = tch::no_grad_guard();
    cache.zero_fresh(chunks)?;
    let kernels = kernels.filter(|k| k.runs(Kernel::PagedDecode, cache.device(), kind));
    let packed = Packed::new(chunks, vocab, cache, windows, cache.device(), kernels.is_some())?;
    let rope = rotary.tables(&packed.positions, kind)?;
    let masks = in_cache_masks(windows);
    let (ids, rows) = (packed.ids.shallow_clone(), packed.logit_rows.shallow_clone());
    let mut step = packed.step(cache, kernels);
    let hidden = layers(&ids, &rope, &masks, &mut step)?;
    Ok(hidden.f_squeeze_dim(0)?.f_index_select(0, &rows)?)
}

/// One [`Mask::InCache`] per distinct window: the paged step masks by itself.
pub(super) fn in_cache_masks(windows: &[Option<i64>]) -> Masks {
    let mut distinct = windows.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    distinct.into_iter().map(|w| (w, Mask::InCache)).collect()
}

/// The single-token chunks, attending together.
struct Decodes {
    rows: i64,
    /// Block ids [rows · blocks_per_row], padded with the zero block.
    blocks: Tensor,
    /// Keys each row reads: the longest row's.
    keys: i64,
    /// Mask [1, rows, 1, keys] per window (none when every row sees every key).
    masks: Vec<(Option<i64>, Option<Tensor>)>,
    /// For the decode-attention kernel: block tables [rows, blocks_per_row] and keys per row
    /// [rows], both int32.
    kernel_tables: Option<(Tensor, Tensor)>,
}

/// A longer chunk, attending on its own.
struct Prefill {
    start: i64,
    len: i64,
    context: i64,
    /// Its block ids when it continues a sequence (context > 0).
    blocks: Option<Tensor>,
    masks: Vec<(Option<i64>, Mask)>,
}

/// A batch of chunks packed for one pass.
struct Packed {
    /// Token ids [1, N] in packed order.
    ids: Tensor,
    /// Positions [1, N].
    positions: Tensor,
    /// Packed index of the last token of each chunk that asks for logits, in the caller's
    /// order [R].
    logit_rows: Tensor,
    /// Where each token's key and value go: [N] rows of the flattened pool.
    slots: Tensor,
    decodes: Option<Decodes>,
    prefills: Vec<Prefill>,
}

fn ids_tensor(values: &[i64], device: Device) -> Result<Tensor> {
    Ok(Tensor::from_slice(values).f_to_device(device)?)
}

/// Checks one chunk against the vocabulary and the pool.
fn check_chunk(index: usize, chunk: &SeqChunk, vocab: i64, blocks: usize) -> Result<()> {
    if chunk.tokens.is_empty() {
        return Err(Error::InvalidInput(format!("chunk {index} has no tokens")));
    }
    if let Some((position, &id)) = chunk.tokens.iter().enumerate().find(|(_, id)| !(0..vocab).contains(*id)) {
        return Err(Error::TokenOutOfRange { id, row: index, position, vocab_size: vocab });
    }
    let end = chunk.context + chunk.tokens.len();
    if chunk.blocks.len() * BLOCK_SIZE < end {
        return Err(Error::InvalidInput(format!(
            "chunk {index} reaches position {end} but its {} blocks hold {}",
            chunk.blocks.len(),
            chunk.blocks.len() * BLOCK_SIZE
        )));
    }
    if let Some(bad) = chunk.blocks.iter().find(|&&b| b as usize >= blocks) {
        return Err(Error::InvalidInput(format!("chunk {index} names block {bad}; the pool has {blocks}")));
    }
    Ok(())
}

/// The pool row of position `p` of a sequence with block table `blocks`.
fn slot(blocks: &[u32], p: usize) -> i64 {
    i64::from(blocks[p / BLOCK_SIZE]) * BLOCK_SIZE as i64 + (p % BLOCK_SIZE) as i64
}

impl Packed {
    fn new(
        chunks: &[SeqChunk],
        vocab: i64,
        cache: &PagedCache,
        windows: &[Option<i64>],
        device: Device,
        kernel: bool,
    ) -> Result<Self> {
        if chunks.is_empty() {
            return Err(Error::InvalidInput("a paged pass needs at least one chunk".into()));
        }
        for (i, chunk) in chunks.iter().enumerate() {
            check_chunk(i, chunk, vocab, cache.blocks())?;
        }
        let order: Vec<usize> = (0..chunks.len())
            .filter(|&i| chunks[i].tokens.len() == 1)
            .chain((0..chunks.len()).filter(|&i| chunks[i].tokens.len() > 1))
            .collect();
        let mut distinct = windows.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        let (mut ids, mut positions, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        let mut last = vec![0i64; chunks.len()];
        for &i in &order {
            let chunk = &chunks[i];
            for (k, &id) in chunk.tokens.iter().enumerate() {
                let p = chunk.context + k;
                ids.push(id);
                positions.push(p as i64);
                slots.push(slot(&chunk.blocks, p));
            }
            last[i] = ids.len() as i64 - 1;
        }
        let singles: Vec<&SeqChunk> = order.iter().map(|&i| &chunks[i]).take_while(|c| c.tokens.len() == 1).collect();
        let decodes = if singles.is_empty() {
            None
        } else {
            Some(Self::decodes(&singles, cache.pad_block(), &distinct, device, kernel)?)
        };
        let mut prefills = Vec::new();
        let mut start = singles.len() as i64;
        for chunk in order[singles.len()..].iter().map(|&i| &chunks[i]) {
            let len = chunk.tokens.len() as i64;
            let context = chunk.context as i64;
            let blocks = if context > 0 {
                let used = (chunk.context + chunk.tokens.len()).div_ceil(BLOCK_SIZE);
                let table: Vec<i64> = chunk.blocks[..used].iter().map(|&b| i64::from(b)).collect();
                Some(ids_tensor(&table, device)?)
            } else {
                None
            };
            let masks =
                distinct.iter().map(|&w| Ok((w, Mask::new(len, context, w, device)?))).collect::<Result<Vec<_>>>()?;
            prefills.push(Prefill { start, len, context, blocks, masks });
            start += len;
        }
        let rows: Vec<i64> = (0..chunks.len()).filter(|&i| chunks[i].logits).map(|i| last[i]).collect();
        Ok(Self {
            ids: ids_tensor(&ids, device)?.f_unsqueeze(0)?,
            positions: ids_tensor(&positions, device)?.f_unsqueeze(0)?,
            logit_rows: ids_tensor(&rows, device)?,
            slots: ids_tensor(&slots, device)?,
            decodes,
            prefills,
        })
    }

    fn decodes(
        singles: &[&SeqChunk],
        pad: i64,
        windows: &[Option<i64>],
        device: Device,
        kernel: bool,
    ) -> Result<Decodes> {
        let lens: Vec<i64> = singles.iter().map(|c| c.context as i64 + 1).collect();
        let per_row = singles.iter().map(|c| (c.context + 1).div_ceil(BLOCK_SIZE)).max().unwrap_or(1);
        let mut table = Vec::with_capacity(singles.len() * per_row);
        for chunk in singles {
            let used = (chunk.context + 1).div_ceil(BLOCK_SIZE);
            table.extend(chunk.blocks[..used].iter().map(|&b| i64::from(b)));
            table.extend(std::iter::repeat_n(pad, per_row - used));
        }
        // Keys past the longest row are padding every row masks: they are not read at all.
        let keys = lens.iter().copied().max().unwrap_or(1);
        let rows = singles.len() as i64;
        let query = ids_tensor(&lens, device)?.f_sub_scalar(1)?.f_view([1, rows, 1, 1])?;
        let key = Tensor::f_arange(keys, (Kind::Int64, device))?.f_view([1, 1, 1, keys])?;
        let masks = windows
            .iter()
            .map(|&w| {
                let bounded = w.is_some_and(|w| lens.iter().any(|&l| l > w));
                if !bounded && lens.iter().all(|&l| l == keys) {
                    return Ok((w, None));
                }
                let mut allowed = key.f_le_tensor(&query)?;
                if let Some(w) = w {
                    allowed = allowed.f_logical_and(&query.f_sub(&key)?.f_lt(w)?)?;
                }
                Ok((w, Some(allowed)))
            })
            .collect::<Result<Vec<_>>>()?;
        let kernel_tables = if kernel {
            let table32: Vec<i32> = table.iter().map(|&b| b as i32).collect();
            let lens32: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
            let tables = Tensor::from_slice(&table32).f_view([rows, per_row as i64])?.f_to_device(device)?;
            Some((tables, Tensor::from_slice(&lens32).f_to_device(device)?))
        } else {
            None
        };
        Ok(Decodes { rows, blocks: ids_tensor(&table, device)?, keys, masks, kernel_tables })
    }

    /// The pass's view of `cache`.
    fn step<'a>(self, cache: &'a mut PagedCache, kernels: Option<&'a Kernels>) -> PagedStep<'a> {
        PagedStep { cache, packed: self, kernels }
    }
}

/// One paged pass over `cache`.
struct PagedStep<'a> {
    cache: &'a mut PagedCache,
    packed: Packed,
    /// Kernels whose decode attention runs on this cache's device and dtype.
    kernels: Option<&'a Kernels>,
}

/// Decode attention of single-token rows `q` [1, heads, rows, D] over their gathered keys
/// and values `k`, `v` [kv_heads, rows, keys, D], batched over (KV head, row) with the query
/// heads of a KV group as that group's queries (no repeat_kv); returns [1, heads, rows, D].
pub(super) fn grouped_decode(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    softcap: Option<f64>,
) -> Result<Tensor> {
    let [_, heads, rows, head_dim] = q.size()[..] else {
        return Err(Error::InvalidInput(format!("decode queries {:?} are not [1, heads, rows, D]", q.size())));
    };
    let kv_heads = k.size()[0];
    let qd = q.f_reshape([kv_heads, heads / kv_heads, rows, head_dim])?.f_permute([0, 2, 1, 3])?;
    let out = decode_attention(&qd, k, v, mask, softcap)?;
    Ok(out.f_permute([0, 2, 1, 3])?.f_reshape([1, heads, rows, head_dim])?)
}

/// Attention of a few queries per (KV head, row) `q` [kv_heads, rows, group, D] over `k`,
/// `v` [kv_heads, rows, keys, D] under `mask` [1, rows, 1, keys]. On the CPU (and with
/// soft-capped logits anywhere) it is two batched matrix products around a softmax in f32:
/// libtorch's CPU SDPA kernel takes about twice as long for so few queries per batch entry;
/// elsewhere it is SDPA.
pub(super) fn decode_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    softcap: Option<f64>,
) -> Result<Tensor> {
    if q.device() != Device::Cpu && softcap.is_none() {
        return Ok(Tensor::f_scaled_dot_product_attention(q, k, v, mask, 0.0, false, None, false)?);
    }
    eager_attention(q, k, v, mask, softcap)
}

impl LayerCache for PagedStep<'_> {
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
        self.cache.write(layer, &self.packed.slots, k, v)?;
        let (keys, values) = (&self.cache.keys[layer], &self.cache.values[layer]);
        let mut outs = Vec::with_capacity(1 + self.packed.prefills.len());
        if let (Some(d), Some(kernels)) = (&self.packed.decodes, self.kernels)
            && let Some((tables, lens)) = &d.kernel_tables
        {
            // [1, heads, rows, D] → [heads, rows, D], attended where the blocks lie.
            let qd = q.f_narrow(2, 0, d.rows)?.f_squeeze_dim(0)?;
            let out = kernels.paged_decode(&qd, keys, values, tables, lens, d.keys, BLOCK_SIZE as i64, window)?;
            outs.push(out.f_unsqueeze(0)?);
        } else if let Some(d) = &self.packed.decodes {
            let kd = self.cache.gather(keys, &d.blocks, d.rows)?.f_narrow(2, 0, d.keys)?;
            let vd = self.cache.gather(values, &d.blocks, d.rows)?.f_narrow(2, 0, d.keys)?;
            let mask = d.masks.iter().find(|(w, _)| *w == window).and_then(|(_, m)| m.as_ref());
            outs.push(grouped_decode(&q.f_narrow(2, 0, d.rows)?, &kd, &vd, mask, softcap)?);
        }
        for p in &self.packed.prefills {
            let qp = q.f_narrow(2, p.start, p.len)?;
            let (kp, vp) = match &p.blocks {
                None => (k.f_narrow(2, p.start, p.len)?, v.f_narrow(2, p.start, p.len)?),
                Some(blocks) => {
                    // [kv_heads, 1, keys, D] → [1, kv_heads, keys, D].
                    let visible = p.context + p.len;
                    let gathered = |pool: &Tensor| -> Result<Tensor> {
                        Ok(self.cache.gather(pool, blocks, 1)?.f_narrow(2, 0, visible)?.f_transpose(0, 1)?)
                    };
                    (gathered(keys)?, gathered(values)?)
                }
            };
            let (_, mask) = p.masks.iter().find(|(w, _)| *w == window).expect("a mask for every window");
            outs.push(attention(&qp, &kp, &vp, mask, softcap)?);
        }
        Ok(if outs.len() == 1 { outs.remove(0) } else { Tensor::f_cat(&outs, 2)? })
    }
}
