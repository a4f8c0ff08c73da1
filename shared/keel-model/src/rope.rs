//! Rotary position embeddings as transformers computes them: inverse frequencies in f32
//! (default, `linear` and `llama3` scaling), cos/sin of `position × inv_freq` duplicated
//! over both halves of the head, and `rotate_half` application.

use tch::{Device, Kind, Tensor};

use crate::config::{RopeConfig, RopeScaling};
use crate::error::Result;

#[derive(Debug)]
pub struct Rotary {
    inv_freq: Tensor,
}

impl Rotary {
    pub fn new(rope: &RopeConfig, head_dim: i64, device: Device) -> Result<Self> {
        let exponents = Tensor::f_arange_start_step(0, head_dim, 2, (Kind::Int64, Device::Cpu))?
            .f_to_kind(Kind::Float)?
            .f_div_scalar(head_dim as f64)?;
        let inv_freq = Tensor::f_pow_scalar(rope.theta, &exponents)?.f_reciprocal()?;
        let inv_freq = match rope.scaling {
            RopeScaling::None => inv_freq,
            RopeScaling::Linear { factor } => inv_freq.f_div_scalar(factor)?,
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
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
        };
        Ok(Self { inv_freq: inv_freq.f_to_device(device)? })
    }

    /// cos and sin for `positions` [B, S] (i64), each [B, 1, S, head_dim] in `kind`.
    pub fn cos_sin(&self, positions: &Tensor, kind: Kind) -> Result<(Tensor, Tensor)> {
        let freqs = positions.f_to_kind(Kind::Float)?.f_unsqueeze(-1)?.f_mul(&self.inv_freq)?;
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?.f_unsqueeze(1)?;
        Ok((emb.f_cos()?.f_to_kind(kind)?, emb.f_sin()?.f_to_kind(kind)?))
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
