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
