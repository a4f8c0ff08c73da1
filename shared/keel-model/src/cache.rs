//! A preallocated key/value cache for incremental decoding: per layer, keys and values of
//! shape [batch, kv_heads, capacity, head_dim]; every row of the batch has the same length.

use tch::{Device, Kind, Tensor};

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

/// Where one forward pass writes its new keys and values and reads all of a layer's keys and
/// values back.
pub(crate) trait LayerCache {
    /// Stores layer `layer`'s new keys and values [B, kv_heads, S, D] and returns every key
    /// and value the queries may see, [B, kv_heads, T, D].
    fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)>;
}

impl LayerCache for KvCache {
    fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        KvCache::append(self, layer, k, v)
    }
}

/// A preallocated cache of independent sequences for continuous batching: `slots` rows of
/// up to `capacity` tokens each, every row with its own length. A forward pass runs on any
/// subset of rows ([`crate::CausalLm::forward_slots`]); rows of different lengths decode
/// together, each query masked to its own row's tokens.
#[derive(Debug)]
pub struct SlotCache {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    lens: Vec<i64>,
    capacity: i64,
}

impl SlotCache {
    pub fn new(cfg: &ModelConfig, slots: usize, capacity: i64, kind: Kind, device: Device) -> Result<Self> {
        Self::with_kv_heads(cfg, cfg.num_key_value_heads, slots, capacity, kind, device)
    }

    /// A cache holding `kv_heads` of the model's KV heads (a tensor-parallel rank's share).
    pub(crate) fn with_kv_heads(
        cfg: &ModelConfig,
        kv_heads: i64,
        slots: usize,
        capacity: i64,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        if slots == 0 || capacity <= 0 {
            return Err(Error::InvalidInput(format!(
                "slot cache needs at least one slot and a positive capacity, got {slots} × {capacity}"
            )));
        }
        let shape = [slots as i64, kv_heads, capacity, cfg.head_dim];
        let layers = cfg.num_hidden_layers as usize;
        let alloc =
            || -> Result<Vec<Tensor>> { (0..layers).map(|_| Ok(Tensor::f_zeros(shape, (kind, device))?)).collect() };
        Ok(Self { keys: alloc()?, values: alloc()?, lens: vec![0; slots], capacity })
    }

    pub fn slots(&self) -> usize {
        self.lens.len()
    }

    pub fn capacity(&self) -> i64 {
        self.capacity
    }

    /// Tokens held by `slot`.
    pub fn len(&self, slot: usize) -> i64 {
        self.lens[slot]
    }

    /// Empties `slot` (its storage is reused).
    pub fn reset(&mut self, slot: usize) {
        self.lens[slot] = 0;
    }

    /// Makes `to` hold a copy of `from`'s tokens (n samples sharing one prefill).
    pub fn copy_slot(&mut self, from: usize, to: usize) -> Result<()> {
        let len = self.lens[from];
        if from != to && len > 0 {
            for tensors in [&mut self.keys, &mut self.values] {
                for layer in tensors.iter_mut() {
                    let source = layer.f_narrow(0, from as i64, 1)?.f_narrow(2, 0, len)?;
                    layer.f_narrow(0, to as i64, 1)?.f_narrow(2, 0, len)?.f_copy_(&source)?;
                }
            }
        }
        self.lens[to] = len;
        Ok(())
    }

    /// Checks the slots of one pass: distinct, in range, with room for `new_tokens` more.
    pub(crate) fn check(
        &self,
        slots: &[usize],
        layers: usize,
        kind: Kind,
        device: Device,
        new_tokens: i64,
    ) -> Result<()> {
        let (cache_kind, cache_device) = self.keys.first().map_or((kind, device), |k| (k.kind(), k.device()));
        if self.keys.len() != layers || cache_kind != kind || cache_device != device {
            return Err(Error::InvalidInput(format!(
                "slot cache is for {} layers, {cache_kind:?} on {cache_device:?}; the model has {layers} layers, {kind:?} on {device:?}",
                self.keys.len()
            )));
        }
        for (i, &slot) in slots.iter().enumerate() {
            if slot >= self.slots() || slots[..i].contains(&slot) {
                return Err(Error::InvalidInput(format!("slot {slot} is out of range or repeated")));
            }
            if self.lens[slot] + new_tokens > self.capacity {
                return Err(Error::InvalidInput(format!(
                    "slot {slot} holds {} of {} tokens; {new_tokens} more do not fit",
                    self.lens[slot], self.capacity
                )));
            }
        }
        Ok(())
    }

    pub(crate) fn advance(&mut self, slots: &[usize], new_tokens: i64) {
        for &slot in slots {
            self.lens[slot] += new_tokens;
        }
    }
}

/// One pass's view of a [`SlotCache`]: which rows, and where each row's new tokens go.
pub(crate) struct SlotView<'a> {
    pub cache: &'a mut SlotCache,
    pub slots: &'a [usize],
    /// Index tensor of `slots` on the cache's device.
    pub index: Tensor,
    /// Keys visible after this pass: the longest row's length plus the new tokens.
    pub visible: i64,
}

impl LayerCache for SlotView<'_> {
    fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let new = k.size()[2];
        if new == 1 {
            // One token per row: a single indexed write per tensor at (slot, position).
            let positions: Vec<i64> = self.slots.iter().map(|&slot| self.cache.lens[slot]).collect();
            let positions = Tensor::from_slice(&positions).f_to_device(self.index.device())?;
            let at = [Some(self.index.shallow_clone()), None, Some(positions), None];
            for (store, value) in [(&mut self.cache.keys[layer], k), (&mut self.cache.values[layer], v)] {
                let _ = store.f_index_put_(&at, &value.f_squeeze_dim(2)?, false)?;
            }
        } else {
            for (row, &slot) in self.slots.iter().enumerate() {
                let at = self.cache.lens[slot];
                for (store, value) in [(&self.cache.keys[layer], k), (&self.cache.values[layer], v)] {
                    store
                        .f_narrow(0, slot as i64, 1)?
                        .f_narrow(2, at, new)?
                        .f_copy_(&value.f_narrow(0, row as i64, 1)?)?;
                }
            }
        }
        // Consecutive ascending slots are a view of the storage; others are gathered.
        let first = self.slots[0];
        let consecutive = self.slots.iter().enumerate().all(|(i, &slot)| slot == first + i);
        let rows = |store: &Tensor| -> Result<Tensor> {
            let selected = if consecutive {
                store.f_narrow(0, first as i64, self.slots.len() as i64)?
            } else {
                store.f_index_select(0, &self.index)?
            };
            Ok(selected.f_narrow(2, 0, self.visible)?)
        };
        Ok((rows(&self.cache.keys[layer])?, rows(&self.cache.values[layer])?))
    }
}
