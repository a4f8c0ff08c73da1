//! Attention shared by every forward path: which keys each query may see ([`Mask`], one
//! per distinct sliding window of a pass) and scaled dot-product attention over a grouped-
//! query cache. The model's layers, the contiguous [`crate::cache::KvCache`] and the paged
//! cache all attend through [`attention`].

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

/// Which keys each query may attend to.
#[derive(Debug)]
pub(crate) enum Mask {
    /// One query that sees every cached key.
    All,
    /// Plain causal attention over a fresh sequence.
    Causal,
    /// An explicit [1 or B, 1, S, T] boolean mask (cache plus several queries, a window, or
    /// rows of different lengths).
    Allowed(Tensor),
    /// The cache knows each row's keys and masks them itself (the paged cache).
    InCache,
    /// One row of sequences packed end to end ([`crate::packed::PackedRow`]): the queries of
    /// each (start, length) span attend causally (within `window`) to that span only.
    Segments { spans: Vec<(i64, i64)>, window: Option<i64> },
}

impl Mask {
    pub(crate) fn new(queries: i64, past: i64, window: Option<i64>, device: Device) -> Result<Self> {
        let total = past + queries;
        let windowed = window.is_some_and(|w| total > w);
        if !windowed && queries == 1 {
            return Ok(Self::All);
        }
        if !windowed && past == 0 {
            return Ok(Self::Causal);
        }
        let q = Tensor::f_arange_start(past, total, (Kind::Int64, device))?.f_unsqueeze(1)?;
        let k = Tensor::f_arange(total, (Kind::Int64, device))?.f_unsqueeze(0)?;
        let mut allowed = k.f_le_tensor(&q)?;
        if let Some(w) = window {
            allowed = allowed.f_logical_and(&q.f_sub(&k)?.f_lt(w)?)?;
        }
        Ok(Self::Allowed(allowed.f_unsqueeze(0)?.f_unsqueeze(0)?))
    }

    /// Rows whose S new tokens start at different offsets: query s of row b sits at
    /// offsets[b] + s and sees keys 0..=that position (within the window). [B, 1, S, T].
    pub(crate) fn per_row(
        queries: i64,
        offsets: &[i64],
        visible: i64,
        window: Option<i64>,
        device: Device,
    ) -> Result<Self> {
        let starts = Tensor::from_slice(offsets).f_to_device(device)?.f_view([-1, 1, 1])?;
        let q = starts.f_add(&Tensor::f_arange(queries, (Kind::Int64, device))?.f_view([1, -1, 1])?)?;
        let k = Tensor::f_arange(visible, (Kind::Int64, device))?.f_view([1, 1, -1])?;
        let mut allowed = k.f_le_tensor(&q)?;
        if let Some(w) = window {
            allowed = allowed.f_logical_and(&q.f_sub(&k)?.f_lt(w)?)?;
        }
        Ok(Self::Allowed(allowed.f_unsqueeze(1)?))
    }
}

/// The attention mask of each distinct window of a forward pass.
pub(crate) type Masks = Vec<(Option<i64>, Mask)>;

/// One mask per distinct attention window among `windows` (full layers share one, windowed
/// layers another) for S = `queries` new tokens per row starting at `offsets`.
pub(crate) fn masks_for(
    windows: &[Option<i64>],
    queries: i64,
    offsets: &[i64],
    visible: i64,
    device: Device,
) -> Result<Masks> {
    let uniform = offsets.windows(2).all(|w| w[0] == w[1]);
    let mut distinct = windows.to_vec();
    distinct.dedup();
    distinct
        .into_iter()
        .map(|w| {
            let mask = if uniform {
                Mask::new(queries, offsets.first().copied().unwrap_or(0), w, device)?
            } else {
                Mask::per_row(queries, offsets, visible, w, device)?
            };
            Ok((w, mask))
        })
        .collect()
}

/// [B, kv_heads, T, D] → [B, heads, T, D] for grouped-query attention.
pub(crate) fn repeat_kv(x: &Tensor, heads: i64) -> Result<Tensor> {
    let size = x.size();
    let (b, kv_heads, t, d) = (size[0], size[1], size[2], size[3]);
    let groups = heads / kv_heads;
    if groups == 1 {
        return Ok(x.shallow_clone());
    }
    Ok(x.f_unsqueeze(2)?.f_expand([b, kv_heads, groups, t, d], false)?.f_reshape([b, heads, t, d])?)
}

/// Scaled dot-product attention of `q` [B, heads, S, D] over `k`, `v` [B, kv_heads, T, D]
/// under `mask`, its logits soft-capped to `softcap` where the family does so; [B, heads, S, D].
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask, softcap: Option<f64>) -> Result<Tensor> {
    let size = q.size();
    let (b, heads, queries, d) = (size[0], size[1], size[2], size[3]);
    let kv_heads = k.size()[1];
    if let Mask::Segments { spans, window } = mask {
        return segments_attention(q, k, v, spans, *window, softcap);
    }
    if let Some(cap) = softcap {
        let (k, v) = (repeat_kv(k, heads)?, repeat_kv(v, heads)?);
        let allowed = match mask {
            Mask::All => None,
            Mask::Causal => {
                let keys = k.size()[2];
                let q_pos = Tensor::f_arange_start(keys - queries, keys, (Kind::Int64, q.device()))?.f_unsqueeze(1)?;
                let k_pos = Tensor::f_arange(keys, (Kind::Int64, q.device()))?.f_unsqueeze(0)?;
                Some(k_pos.f_le_tensor(&q_pos)?)
            }
            Mask::Allowed(allowed) => Some(allowed.shallow_clone()),
            Mask::InCache => return Err(Error::InvalidInput("attention needs the cache's own mask".into())),
            Mask::Segments { .. } => unreachable!("handled above"),
        };
        return eager_attention(q, &k, &v, allowed.as_ref(), Some(cap));
    }
    let per_row_mask = match mask {
        Mask::All => true,
        Mask::Allowed(allowed) => allowed.size()[1] == 1 && allowed.size()[2] == 1,
        Mask::Causal | Mask::InCache | Mask::Segments { .. } => false,
    };
    if queries == 1 && heads != kv_heads && per_row_mask {
        // One query per head (decoding): the query heads of a KV group become that group's
        // queries, so keys and values are read once, never repeated per head.
        let grouped = q.f_view([b, kv_heads, heads / kv_heads, d])?;
        let explicit = match mask {
            Mask::Allowed(allowed) => Some(allowed),
            _ => None,
        };
        let out = Tensor::f_scaled_dot_product_attention(&grouped, k, v, explicit, 0.0, false, None, false)?;
        return Ok(out.f_view([b, heads, 1, d])?);
    }
    let (k, v) = (repeat_kv(k, heads)?, repeat_kv(v, heads)?);
    let (explicit, causal) = match mask {
        Mask::All => (None, false),
        Mask::Causal => (None, true),
        Mask::Allowed(allowed) => (Some(allowed), false),
        Mask::InCache => return Err(Error::InvalidInput("attention needs the cache's own mask".into())),
        Mask::Segments { .. } => return Err(Error::InvalidInput("a packed row attends span by span".into())),
    };
    Ok(Tensor::f_scaled_dot_product_attention(q, &k, &v, explicit, 0.0, causal, None, false)?)
}

/// Attention as transformers' eager path computes it, soft-capped where `softcap` says (no
/// fused kernel caps logits): `q·kᵀ / √D`, then `cap · tanh(· / cap)`, then the mask, then a
/// softmax in f32. `q` [.., S, D], `k`, `v` [.., T, D] with the same leading dimensions (KV
/// heads already matched to the queries), `allowed` broadcastable to [.., S, T].
pub(crate) fn eager_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    allowed: Option<&Tensor>,
    softcap: Option<f64>,
) -> Result<Tensor> {
    let d = q.size().last().copied().unwrap_or(1);
    let mut scores = q.f_matmul(&k.f_transpose(-2, -1)?)?.f_div_scalar((d as f64).sqrt())?;
    if let Some(cap) = softcap {
        scores = scores.f_div_scalar(cap)?.f_tanh()?.f_mul_scalar(cap)?;
    }
    if let Some(allowed) = allowed {
        scores = scores.f_masked_fill(&allowed.f_logical_not()?, f64::NEG_INFINITY)?;
    }
    let weights = scores.f_softmax(-1, Kind::Float)?.f_to_kind(v.kind())?;
    Ok(weights.f_matmul(v)?)
}

/// Attention of a packed row (`q` [1, heads, T, D], `k`, `v` [1, kv_heads, T, D]): each span
/// attends to itself alone, causally, so the work is that of the sequences apart (no [T, T]
/// mask). Positions after the last span (none in a packed row) are left to zero.
fn segments_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spans: &[(i64, i64)],
    window: Option<i64>,
    softcap: Option<f64>,
) -> Result<Tensor> {
    if q.size()[0] != 1 {
        return Err(Error::InvalidInput(format!("a packed row is one row, got {}", q.size()[0])));
    }
    let mut outs = Vec::with_capacity(spans.len() + 1);
    for &(start, len) in spans {
        let span = |x: &Tensor| x.f_narrow(2, start, len);
        let mask = Mask::new(len, 0, window, q.device())?;
        outs.push(attention(&span(q)?, &span(k)?, &span(v)?, &mask, softcap)?);
    }
    let covered = spans.last().map_or(0, |(start, len)| start + len);
    let total = q.size()[2];
    if covered < total {
        outs.push(Tensor::f_zeros_like(&q.f_narrow(2, covered, total - covered)?)?);
    }
    Ok(Tensor::f_cat(&outs, 2)?)
}
