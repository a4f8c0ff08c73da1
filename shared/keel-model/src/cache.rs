//! Key/value caches for incremental decoding.
//!
//! - [`KvCache`]: preallocated keys and values [batch, kv_heads, capacity, head_dim] per
//!   layer; every row has the same length (the CLI's benches and the contiguous reference).
//! - [`PagedCache`]: one pool of fixed-size blocks per layer for continuous batching. A
//!   sequence's keys and values live in the blocks its block table names, in any order; the
//!   caller (the generator's block manager) decides which blocks a sequence owns, shares or
//!   copies, and a forward pass ([`crate::CausalLm::forward_paged`]) reads and writes the
//!   blocks where they are.

use tch::{Device, Kind, Tensor};

use crate::attention::{Mask, attention};
use crate::config::ModelConfig;
use crate::error::{Error, Result};

#[derive(Debug)]
pub struct KvCache {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    len: i64,
    capacity: i64,
}

impl KvCache {
    /// A cache for `batch` rows of up to `capacity` tokens each.
    pub fn new(cfg: &ModelConfig, batch: i64, capacity: i64, kind: Kind, device: Device) -> Result<Self> {
        if batch <= 0 || capacity <= 0 {
            return Err(Error::InvalidInput(format!(
                "KV cache needs a positive batch and capacity, got {batch} × {capacity}"
            )));
        }
        let shape = [batch, cfg.num_key_value_heads, capacity, cfg.head_dim];
        let layers = cfg.num_hidden_layers as usize;
        let alloc =
            || -> Result<Vec<Tensor>> { (0..layers).map(|_| Ok(Tensor::f_zeros(shape, (kind, device))?)).collect() };
        Ok(Self { keys: alloc()?, values: alloc()?, len: 0, capacity })
    }

    /// Tokens held per row.
    pub fn len(&self) -> i64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> i64 {
        self.capacity
    }

    /// Forgets every token; the storage is kept.
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Checks that the cache was made for this model and batch (layers, batch size, dtype,
    /// device) and that `new_tokens` more fit.
    pub(crate) fn check(&self, layers: usize, batch: i64, kind: Kind, device: Device, new_tokens: i64) -> Result<()> {
        let size = self.keys.first().map(Tensor::size).unwrap_or_default();
        let (cache_kind, cache_device) = self.keys.first().map_or((kind, device), |k| (k.kind(), k.device()));
        if self.keys.len() != layers || size.first() != Some(&batch) || cache_kind != kind || cache_device != device {
            return Err(Error::InvalidInput(format!(
                "KV cache is for {} layers, batch {:?}, {cache_kind:?} on {cache_device:?}; the input needs {layers} layers, \
                 batch {batch}, {kind:?} on {device:?}",
                self.keys.len(),
                size.first()
            )));
        }
        self.reserve(new_tokens)
    }

    /// Checks that `new_tokens` more fit.
    fn reserve(&self, new_tokens: i64) -> Result<()> {
        if self.len + new_tokens > self.capacity {
            return Err(Error::InvalidInput(format!(
                "KV cache holds {} of {} tokens; {new_tokens} more do not fit",
                self.len, self.capacity
            )));
        }
        Ok(())
    }

    /// Writes layer `layer`'s new keys and values [B, kv_heads, S, D] after the cached ones and
    /// returns all of them. The length advances in [`Self::advance`] once every layer is done.
    pub(crate) fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let new = k.size()[2];
        let total = self.len + new;
        self.keys[layer].f_narrow(2, self.len, new)?.f_copy_(k)?;
        self.values[layer].f_narrow(2, self.len, new)?.f_copy_(v)?;
        Ok((self.keys[layer].f_narrow(2, 0, total)?, self.values[layer].f_narrow(2, 0, total)?))
    }

    pub(crate) fn advance(&mut self, new_tokens: i64) {
        self.len += new_tokens;
    }
}

/// Where one forward pass keeps its keys and values and how it attends to them.
pub(crate) trait LayerCache {
    /// Attention output [B, heads, S, D] of layer `layer` for queries `q` [B, heads, S, D]
    /// and the new keys and values `k`, `v` [B, kv_heads, S, D] (after rotary), which the
    /// cache stores. `mask` and `window` say which keys each query sees; `softcap` caps the
    /// logits where the family does so.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &mut self,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Mask,
        window: Option<i64>,
        softcap: Option<f64>,
    ) -> Result<Tensor>;
}

impl LayerCache for KvCache {
    fn attend(
        &mut self,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Mask,
        _window: Option<i64>,
        softcap: Option<f64>,
    ) -> Result<Tensor> {
        let (k, v) = self.append(layer, k, v)?;
        attention(q, &k, &v, mask, softcap)
    }
}

/// Tokens per block of a [`PagedCache`] (vLLM's default).
pub const BLOCK_SIZE: usize = 16;

/// Per layer, one pool of `blocks` blocks of [`BLOCK_SIZE`] tokens (keys and values of
/// shape [kv_heads, (blocks + 1) · BLOCK_SIZE, head_dim]: head-major, so that the blocks
/// of a batch's rows gathered along the middle dimension are already the [heads, rows,
/// keys, head_dim] that attention reads); the extra last block stays zero and pads the
/// block tables of a batch to one length.
///
/// The pools are allocated without being written, so memory is committed as blocks are
/// first used; a block is zeroed the first time a pass uses it, so that what lies past a
/// sequence's end in its last block is always finite (a masked key must not turn an
/// attention row into NaN).
#[derive(Debug)]
pub struct PagedCache {
    pub(crate) keys: Vec<Tensor>,
    pub(crate) values: Vec<Tensor>,
    blocks: usize,
    kv_heads: i64,
    head_dim: i64,
    /// Layers, dtype and device of the pool (kept while it is released).
    layers: usize,
    kind: Kind,
    device: Device,
    /// Blocks zeroed (or copied into) since the pool was made.
    touched: Vec<bool>,
}

impl PagedCache {
    pub fn new(cfg: &ModelConfig, blocks: usize, kind: Kind, device: Device) -> Result<Self> {
        Self::with_kv_heads(cfg, cfg.num_key_value_heads, blocks, kind, device)
    }

    /// A pool holding `kv_heads` of the model's KV heads (a tensor-parallel rank's share).
    pub(crate) fn with_kv_heads(
        cfg: &ModelConfig,
        kv_heads: i64,
        blocks: usize,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        if blocks == 0 {
            return Err(Error::InvalidInput("a paged KV cache needs at least one block".into()));
        }
        let mut cache = Self {
            keys: Vec::new(),
            values: Vec::new(),
            blocks,
            kv_heads,
            head_dim: cfg.head_dim,
            layers: cfg.num_hidden_layers as usize,
            kind,
            device,
            touched: Vec::new(),
        };
        let _bytes = cache.restore()?;
        Ok(cache)
    }

    /// Frees the pool's memory (a colocated generator sleeping while the trainer trains):
    /// what it held is gone, and passes fail until [`PagedCache::restore`]. Returns the
    /// bytes released.
    pub fn release(&mut self) -> u64 {
        let bytes = self.bytes();
        self.keys.clear();
        self.values.clear();
        bytes
    }

    /// Whether the pool's memory is released.
    pub fn is_released(&self) -> bool {
        self.keys.is_empty()
    }

    /// Allocates the pool again (empty, every block fresh) when it was released; returns
    /// the bytes allocated.
    pub fn restore(&mut self) -> Result<u64> {
        if !self.is_released() {
            return Ok(0);
        }
        let rows = (self.blocks as i64 + 1) * BLOCK_SIZE as i64;
        let shape = [self.kv_heads, rows, self.head_dim];
        let (kind, device) = (self.kind, self.device);
        let alloc = || -> Result<Vec<Tensor>> {
            (0..self.layers)
                .map(|_| {
                    let pool = Tensor::f_empty(shape, (kind, device))?;
                    let _ = pool.f_narrow(1, rows - BLOCK_SIZE as i64, BLOCK_SIZE as i64)?.f_zero_()?;
                    Ok(pool)
                })
                .collect()
        };
        let (keys, values) = (alloc()?, alloc()?);
        self.keys = keys;
        self.values = values;
        self.touched = vec![false; self.blocks];
        Ok(self.bytes())
    }

    /// Bytes the pool holds now (none while released).
    fn bytes(&self) -> u64 {
        self.keys.iter().chain(&self.values).map(|t| (t.numel() * self.kind.elt_size_in_bytes()) as u64).sum()
    }

    /// Zeroes the blocks `chunks` use for the first time.
    pub(crate) fn zero_fresh(&mut self, chunks: &[SeqChunk]) -> Result<()> {
        let mut fresh = Vec::new();
        for chunk in chunks {
            let used = (chunk.context + chunk.tokens.len()).div_ceil(BLOCK_SIZE).min(chunk.blocks.len());
            for &block in &chunk.blocks[..used] {
                let b = block as usize;
                if b < self.blocks && !self.touched[b] {
                    self.touched[b] = true;
                    fresh.push(i64::from(block));
                }
            }
        }
        if fresh.is_empty() {
            return Ok(());
        }
        let (kv_heads, head_dim) = (self.kv_heads, self.head_dim);
        let index = Tensor::from_slice(&fresh).f_to_device(self.device())?;
        for pool in self.keys.iter().chain(self.values.iter()) {
            let _ = Self::block_view(pool, kv_heads, head_dim)?.f_index_fill_(1, &index, 0.0)?;
        }
        Ok(())
    }

    /// Bytes one block takes over every layer (keys and values) for `kv_heads` heads.
    pub fn block_bytes(cfg: &ModelConfig, kv_heads: i64, kind: Kind) -> usize {
        let elements = 2 * cfg.num_hidden_layers * BLOCK_SIZE as i64 * kv_heads * cfg.head_dim;
        elements as usize * kind.elt_size_in_bytes()
    }

    /// Usable blocks (ids `0..blocks`).
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// The zero block that pads block tables.
    pub(crate) fn pad_block(&self) -> i64 {
        self.blocks as i64
    }

    /// Copies block `from` into block `to` in every layer (copy on write of a shared block).
    pub fn copy_block(&mut self, from: usize, to: usize) -> Result<()> {
        if from >= self.blocks || to >= self.blocks {
            return Err(Error::InvalidInput(format!("block {from} or {to} is outside the pool of {}", self.blocks)));
        }
        let (size, from, to) = (BLOCK_SIZE as i64, from as i64, to as i64);
        for pool in self.keys.iter_mut().chain(self.values.iter_mut()) {
            let source = pool.f_narrow(1, from * size, size)?;
            pool.f_narrow(1, to * size, size)?.f_copy_(&source)?;
        }
        self.touched[to as usize] = self.touched[from as usize];
        Ok(())
    }

    /// Checks that the pool was made for this model: layers, KV heads, dtype and device.
    pub(crate) fn check(&self, layers: usize, kv_heads: i64, kind: Kind, device: Device) -> Result<()> {
        if self.is_released() {
            return Err(Error::InvalidInput("the paged KV cache is released (restore it first)".into()));
        }
        let (pool_kind, pool_device) = self.keys.first().map_or((kind, device), |k| (k.kind(), k.device()));
        if self.keys.len() != layers || self.kv_heads != kv_heads || pool_kind != kind || pool_device != device {
            return Err(Error::InvalidInput(format!(
                "paged KV cache is for {} layers of {} KV heads, {pool_kind:?} on {pool_device:?}; the model has {layers} \
                 layers of {kv_heads}, {kind:?} on {device:?}",
                self.keys.len(),
                self.kv_heads
            )));
        }
        Ok(())
    }

    /// Writes one pass's keys and values `k`, `v` [1, kv_heads, N, D] of `layer` to the N
    /// pool rows `slots`.
    pub(crate) fn write(&mut self, layer: usize, slots: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
        let _ = self.keys[layer].f_index_copy_(1, slots, &k.f_squeeze_dim(0)?)?;
        let _ = self.values[layer].f_index_copy_(1, slots, &v.f_squeeze_dim(0)?)?;
        Ok(())
    }

    /// Blocks `blocks` (`rows` tables of equal length, one after the other) of `pool` (a
    /// layer's keys or values) as [kv_heads, rows, keys, D], in one contiguous copy.
    pub(crate) fn gather(&self, pool: &Tensor, blocks: &Tensor, rows: i64) -> Result<Tensor> {
        let gathered = Self::block_view(pool, self.kv_heads, self.head_dim)?.f_index_select(1, blocks)?;
        Ok(gathered.f_view([self.kv_heads, rows, -1, self.head_dim])?)
    }

    /// A layer's pool as blocks: [kv_heads, blocks + 1, BLOCK_SIZE, head_dim].
    pub(crate) fn block_view(pool: &Tensor, kv_heads: i64, head_dim: i64) -> Result<Tensor> {
        Ok(pool.f_view([kv_heads, -1, BLOCK_SIZE as i64, head_dim])?)
    }

    /// The device the pools live on.
    pub(crate) fn device(&self) -> Device {
        self.device
    }
}

/// One sequence's share of a paged forward pass: `tokens` continue the `context` tokens
/// already in its blocks, and `blocks` (its block table) holds positions
/// `0..context + tokens.len()`. (Serialisable: a generator group's leader sends each pass's
/// chunks to its other ranks.)
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SeqChunk {
    pub tokens: Vec<i64>,
    pub context: usize,
    pub blocks: Vec<u32>,
    /// Whether the pass returns logits for this chunk's last token.
    pub logits: bool,
}
