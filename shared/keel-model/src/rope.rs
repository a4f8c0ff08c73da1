//! Rotary position embeddings as transformers computes them: inverse frequencies in f32
//! (default, `linear`, `llama3` and Phi-3's `longrope` scaling), cos/sin of
//! `position × inv_freq` over the rotated dimensions of each head (all of them, or the first
//! `partial_rotary_factor` of them), applied to the two halves of those dimensions
//! (`rotate_half`) or, as GLM does, to interleaved pairs.
//!
//! A model's layers may rotate differently ([`Rotations`]): Gemma 3's and OLMo 3's
//! sliding-window layers have rotary embeddings of their own, SmolLM3's NoPE layers none.

use tch::{Device, Kind, Tensor};

use crate::config::{ModelConfig, RopeConfig, RopeScaling};
use crate::error::Result;

#[derive(Debug)]
pub struct Rotary {
    /// Inverse frequencies [rotary_dim / 2] (LongRoPE's short ones).
    inv_freq: Tensor,
    /// LongRoPE's long inverse frequencies, used in a pass whose positions reach
    /// `original_max_position_embeddings`.
    long: Option<(Tensor, i64)>,
    /// cos and sin are multiplied by this (LongRoPE's attention factor; 1 otherwise).
    attention_factor: f64,
    style: Style,
}

/// Which dimensions of a head rotate, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Style {
    rotary_dim: i64,
    head_dim: i64,
    interleaved: bool,
}

/// `1 / (theta^(2i / dim))` for i < dim / 2, in f32 on the CPU.
fn base_inv_freq(theta: f64, dim: i64) -> Result<Tensor> {
    let exponents = Tensor::f_arange_start_step(0, dim, 2, (Kind::Int64, Device::Cpu))?
        .f_to_kind(Kind::Float)?
        .f_div_scalar(dim as f64)?;
    Ok(Tensor::f_pow_scalar(theta, &exponents)?.f_reciprocal()?)
}

impl Rotary {
    pub fn new(rope: &RopeConfig, head_dim: i64, device: Device) -> Result<Self> {
        let dim = rope.rotary_dim;
        let inv_freq = base_inv_freq(rope.theta, dim)?;
        let (mut long, mut attention_factor) = (None, 1.0);
        let inv_freq = match &rope.scaling {
            RopeScaling::None => inv_freq,
            RopeScaling::Linear { factor } => inv_freq.f_div_scalar(*factor)?,
            &RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let old_len = original_max_position_embeddings as f64;
                let low_freq_wavelen = old_len / low_freq_factor;
                let high_freq_wavelen = old_len / high_freq_factor;
                let wavelen = inv_freq.f_reciprocal()?.f_mul_scalar(2.0 * std::f64::consts::PI)?;
                let long = wavelen.f_gt(low_freq_wavelen)?;
                let scaled = inv_freq.f_div_scalar(factor)?.f_where_self(&long, &inv_freq)?;
                let smooth = wavelen
                    .f_reciprocal()?
                    .f_mul_scalar(old_len)?
                    .f_sub_scalar(low_freq_factor)?
                    .f_div_scalar(high_freq_factor - low_freq_factor)?;
                let smoothed = smooth
                    .f_neg()?
                    .f_add_scalar(1.0)?
                    .f_mul(&scaled)?
                    .f_div_scalar(factor)?
                    .f_add(&smooth.f_mul(&scaled)?)?;
                let medium = wavelen.f_ge(high_freq_wavelen)?.f_logical_and(&long.f_logical_not()?)?;
                smoothed.f_where_self(&medium, &scaled)?
            }
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
                attention_factor: a,
            } => {
                attention_factor = *a;
                let by = |factors: &[f64]| -> Result<Tensor> {
                    let factors = Tensor::from_slice(factors).f_to_kind(Kind::Float)?;
                    Ok(inv_freq.f_div(&factors)?.f_to_device(device)?)
                };
                long = Some((by(long_factor)?, *original_max_position_embeddings));
                by(short_factor)?
            }
        };
        Ok(Self {
            inv_freq: inv_freq.f_to_device(device)?,
            long,
            attention_factor,
            style: Style { rotary_dim: dim, head_dim, interleaved: rope.interleaved },
        })
    }

    /// cos and sin for `positions` [B, S] (i64), each [B, 1, S, rotary_dim] in `kind`, laid out
    /// as [`Self::apply`] reads them.
    pub fn cos_sin(&self, positions: &Tensor, kind: Kind) -> Result<(Tensor, Tensor)> {
        let inv_freq = match &self.long {
            // transformers' LongRoPE: the long factors once the pass reaches the original
            // context (checked on the device, so no host read and graph capture stays possible).
            Some((long, original)) => {
                let reaches = positions.f_max()?.f_ge(*original)?;
                long.f_where_self(&reaches, &self.inv_freq)?
            }
            None => self.inv_freq.shallow_clone(),
        };
        let freqs = positions.f_to_kind(Kind::Float)?.f_unsqueeze(-1)?.f_mul(&inv_freq)?;
        let emb = if self.style.interleaved {
            freqs.f_repeat_interleave_self_int(2, -1, None)?
        } else {
            Tensor::f_cat(&[&freqs, &freqs], -1)?
        }
        .f_unsqueeze(1)?;
        let (mut cos, mut sin) = (emb.f_cos()?, emb.f_sin()?);
        if self.attention_factor != 1.0 {
            cos = cos.f_mul_scalar(self.attention_factor)?;
            sin = sin.f_mul_scalar(self.attention_factor)?;
        }
        Ok((cos.f_to_kind(kind)?, sin.f_to_kind(kind)?))
    }
}

impl Style {
    /// Whether the whole head rotates by halves: what the CUDA rotary kernel computes.
    pub fn is_plain(&self) -> bool {
        self.rotary_dim == self.head_dim && !self.interleaved
    }

    /// The rotary embedding of `x` [B, H, S, D] with tables from [`Rotary::cos_sin`]: its
    /// first `rotary_dim` dimensions rotated, the rest passed through.
    pub fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let rotate = |x: &Tensor| if self.interleaved { interleaved(x, cos, sin) } else { apply(x, cos, sin) };
        if self.rotary_dim == self.head_dim {
            return rotate(x);
        }
        let rotated = rotate(&x.f_narrow(-1, 0, self.rotary_dim)?)?;
        let passed = x.f_narrow(-1, self.rotary_dim, self.head_dim - self.rotary_dim)?;
        Ok(Tensor::f_cat(&[&rotated, &passed], -1)?)
    }
}

/// `x · cos + rotate_half(x) · sin` for x [B, H, S, D].
pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.size()[3] / 2;
    let x1 = x.f_narrow(-1, 0, half)?;
    let x2 = x.f_narrow(-1, half, half)?;
    let rotated = Tensor::f_cat(&[&x2.f_neg()?, &x1], -1)?;
    Ok(x.f_mul(cos)?.f_add(&rotated.f_mul(sin)?)?)
}

/// GLM's rotation of pairs: (x0, x1) → (x0·cos − x1·sin, x1·cos + x0·sin), with cos and sin
/// repeated per pair.
fn interleaved(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let size = x.size();
    let d = size[3];
    let pairs = x.f_reshape([size[0], size[1], size[2], d / 2, 2])?;
    let (even, odd) = (pairs.f_select(-1, 0)?, pairs.f_select(-1, 1)?);
    let rotated = Tensor::f_stack(&[&odd.f_neg()?, &even], -1)?.f_reshape([size[0], size[1], size[2], d])?;
    Ok(x.f_mul(cos)?.f_add(&rotated.f_mul(sin)?)?)
}

/// The rotary embeddings of a model's layers: the distinct ones, and which each layer uses.
#[derive(Debug)]
pub struct Rotations {
    variants: Vec<Rotary>,
    layers: std::sync::Arc<[Option<usize>]>,
}

impl Rotations {
    pub fn new(cfg: &ModelConfig, device: Device) -> Result<Self> {
        let mut configs: Vec<&RopeConfig> = Vec::new();
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers as usize);
        for layer in 0..cfg.num_hidden_layers as usize {
            layers.push(cfg.layer_rope(layer).map(|rope| match configs.iter().position(|c| *c == rope) {
                Some(index) => index,
                None => {
                    configs.push(rope);
                    configs.len() - 1
                }
            }));
        }
        let variants =
            configs.into_iter().map(|rope| Rotary::new(rope, cfg.head_dim, device)).collect::<Result<_>>()?;
        Ok(Self { variants, layers: layers.into() })
    }

    /// Whether every layer's rotary embedding (if any) rotates whole heads by halves: what the
    /// CUDA rotary kernel computes.
    pub fn is_plain(&self) -> bool {
        self.variants.iter().all(|r| r.style.is_plain())
    }

    /// The cos/sin tables of every variant for `positions` [B, S].
    pub fn tables(&self, positions: &Tensor, kind: Kind) -> Result<RopeTables> {
        let tables = self
            .variants
            .iter()
            .map(|r| {
                let (cos, sin) = r.cos_sin(positions, kind)?;
                Ok(Table { style: r.style, cos, sin })
            })
            .collect::<Result<_>>()?;
        Ok(RopeTables { layers: self.layers.clone(), tables })
    }
}

/// The cos/sin tables of one pass's positions for one rotary embedding.
#[derive(Debug)]
pub struct Table {
    pub style: Style,
    pub cos: Tensor,
    pub sin: Tensor,
}

/// The cos/sin tables of one pass's positions, for every layer's rotary embedding.
#[derive(Debug)]
pub struct RopeTables {
    layers: std::sync::Arc<[Option<usize>]>,
    tables: Vec<Table>,
}

impl RopeTables {
    /// Layer `layer`'s tables (`None`: a NoPE layer).
    pub fn layer(&self, layer: usize) -> Option<&Table> {
        self.layers[layer].map(|index| &self.tables[index])
    }
}
