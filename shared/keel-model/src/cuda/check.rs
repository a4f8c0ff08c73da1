//! Each kernel against the tch path it replaces, on random inputs on the device: what
//! [`super::Kernels::load`] runs before it lets the model use a kernel, and what the GPU
//! tests run. Shapes are small but cover what the model does: strided views, the residual
//! form of RMSNorm, grouped-query heads, ragged rows, sliding windows and split contexts.

use tch::{Device, IndexOp, Kind, Tensor};

use super::{Kernel, KernelError, Kernels, Result};
use crate::config::{RopeConfig, RopeScaling};

/// Largest |got − want| / (1 + |want|) allowed: a few units in the last place of the dtype.
fn tolerance(kind: Kind) -> f64 {
    match kind {
        Kind::BFloat16 => 3e-2,
        Kind::Half => 4e-3,
        _ => 1e-4,
    }
}

fn compare(kernel: Kernel, kind: Kind, got: &Tensor, want: &Tensor) -> Result<()> {
    let (got, want) = (got.f_to_kind(Kind::Double)?, want.f_to_kind(Kind::Double)?);
    if got.size() != want.size() {
        return Err(KernelError::Shape(format!("{} gave {:?}, expected {:?}", kernel.name(), got.size(), want.size())));
    }
    let worst = got.f_sub(&want)?.f_abs()?.f_div(&want.f_abs()?.f_add_scalar(1.0)?)?.f_max()?.f_double_value(&[])?;
    let tolerance = tolerance(kind);
    if worst.is_nan() || worst > tolerance {
        return Err(KernelError::Mismatch { kernel: kernel.name(), kind, worst, tolerance });
    }
    Ok(())
}

fn randn(size: &[i64], kind: Kind, device: Device) -> Result<Tensor> {
    Ok(Tensor::f_randn(size, (Kind::Float, device))?.f_to_kind(kind)?)
}

/// Runs `kernel` on `kind` tensors on `device` and compares it with the tch path.
pub fn against_tch(kernels: &Kernels, kernel: Kernel, kind: Kind, device: Device) -> Result<()> {
    let _no_grad = tch::no_grad_guard();
    match kernel {
        Kernel::RmsNorm => {
            let x = randn(&[3, 5, 200], kind, device)?;
            let residual = randn(&[3, 5, 200], kind, device)?;
            let weight = randn(&[200], kind, device)?;
            let (normed, _) = kernels.rms_norm(&x, None, &weight, 1e-6)?;
            compare(kernel, kind, &normed, &crate::model::rms_norm(&x, &weight, 1e-6)?)?;
            let (normed, sum) = kernels.rms_norm(&x, Some(&residual), &weight, 1e-5)?;
            let want_sum = x.f_add(&residual)?;
            compare(kernel, kind, &sum.unwrap_or(normed.shallow_clone()), &want_sum)?;
            compare(kernel, kind, &normed, &crate::model::rms_norm(&want_sum, &weight, 1e-5)?)
        }
        Kernel::Rotary => {
            // [B, S, H, D] transposed to [B, H, S, D], as the attention layer hands it over.
            let x = randn(&[2, 7, 4, 64], kind, device)?.f_transpose(1, 2)?;
            let rope = RopeConfig { theta: 10_000.0, scaling: RopeScaling::None, rotary_dim: 64, interleaved: false };
            let positions = Tensor::f_arange(14, (Kind::Int64, device))?.f_view([2, 7])?.f_add_scalar(300)?;
            let (cos, sin) = crate::rope::Rotary::new(&rope, 64, device)?.cos_sin(&positions, kind)?;
            compare(kernel, kind, &kernels.rotary(&x, &cos, &sin)?, &crate::rope::apply(&x, &cos, &sin)?)
        }
        Kernel::SiluMul => {
            let (gate, up) = (randn(&[3, 333], kind, device)?, randn(&[3, 333], kind, device)?);
            compare(kernel, kind, &kernels.silu_mul(&gate, &up)?, &crate::model::silu_mul(&gate, &up)?)
        }
        Kernel::PagedDecode => {
            // Ragged rows, a busy batch, and one long row that splits its context.
            paged_case(kernels, kind, device, &[1, 37, 150, 16], None)?;
            paged_case(kernels, kind, device, &[40, 95], Some(32))?;
            paged_case(kernels, kind, device, &[1300], None)
        }
    }
}

/// Decode attention of 8 query heads over 2 KV heads of 64 values for rows of `lens` keys,
/// their blocks scattered over the pool, against gather + softmax in f32.
fn paged_case(kernels: &Kernels, kind: Kind, device: Device, lens: &[i64], window: Option<i64>) -> Result<()> {
    const BLOCK: i64 = 16;
    let (heads, kv_heads, dim) = (8, 2, 64);
    let rows = lens.len() as i64;
    let per_row: Vec<i64> = lens.iter().map(|l| (l + BLOCK - 1) / BLOCK).collect();
    let width = per_row.iter().copied().max().unwrap_or(1);
    let blocks: i64 = per_row.iter().sum::<i64>() + 3;
    let keys = randn(&[kv_heads, blocks * BLOCK, dim], kind, device)?;
    let values = randn(&[kv_heads, blocks * BLOCK, dim], kind, device)?;
    // Each row's blocks, taken from a shuffled pool; unused table entries name block 0.
    let shuffled = Tensor::f_randperm(blocks, (Kind::Int64, Device::Cpu))?;
    let shuffled: Vec<i64> = Vec::<i64>::try_from(&shuffled)?;
    let mut table = vec![0i32; (rows * width) as usize];
    let mut next = 0;
    for (r, &n) in per_row.iter().enumerate() {
        for b in 0..n as usize {
            table[r * width as usize + b] = shuffled[next] as i32;
            next += 1;
        }
    }
    let tables = Tensor::from_slice(&table).f_view([rows, width])?.f_to_device(device)?;
    let lens32: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
    let lens_t = Tensor::from_slice(&lens32).f_to_device(device)?;
    let q = randn(&[heads, rows, dim], kind, device)?;
    let max_len = lens.iter().copied().max().unwrap_or(1);
    let got = kernels.paged_decode(&q, &keys, &values, &tables, &lens_t, max_len, BLOCK, window)?;
    let mut want = Vec::new();
    for (r, &len) in lens.iter().enumerate() {
        let first = window.map_or(0, |w| (len - w).max(0));
        let slots: Vec<i64> = (first..len)
            .map(|p| i64::from(table[r * width as usize + (p / BLOCK) as usize]) * BLOCK + p % BLOCK)
            .collect();
        let slots = Tensor::from_slice(&slots).f_to_device(device)?;
        let k = keys.f_index_select(1, &slots)?.f_to_kind(Kind::Float)?;
        let v = values.f_index_select(1, &slots)?.f_to_kind(Kind::Float)?;
        // [heads, D] queries, each against its KV head's keys.
        let qr = q.i((.., r as i64, ..)).f_to_kind(Kind::Float)?.f_view([kv_heads, heads / kv_heads, dim])?;
        let scores = qr.f_matmul(&k.f_transpose(1, 2)?)?.f_mul_scalar((dim as f64).powf(-0.5))?;
        let out = scores.f_softmax(-1, Kind::Float)?.f_matmul(&v)?.f_view([heads, 1, dim])?;
        want.push(out);
    }
    compare(Kernel::PagedDecode, kind, &got, &Tensor::f_cat(&want, 1)?)
}
