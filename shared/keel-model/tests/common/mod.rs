//! Helpers for keel-model's tests on top of `keel-testkit`.

#![allow(dead_code)]

use std::path::Path;

use keel_model::CausalLm;
use tch::{Device, Kind, Tensor};

/// Keel's logprobs of right-padded `seqs`, one row per sequence, cut to its length.
pub fn keel_logprobs(model: &CausalLm, seqs: &[Vec<i64>], temperature: f64) -> Vec<Vec<f64>> {
    let width = seqs.iter().map(Vec::len).max().unwrap_or(0);
    let padded: Vec<i64> =
        seqs.iter().flat_map(|s| s.iter().copied().chain(std::iter::repeat_n(3, width - s.len()))).collect();
    let ids = Tensor::from_slice(&padded).view([seqs.len() as i64, width as i64]);
    let lengths: Vec<i64> = seqs.iter().map(|s| s.len() as i64).collect();
    let lp = model.token_logprobs(&ids, &lengths, temperature).expect("token_logprobs");
    let flat = Vec::<f64>::try_from(lp.to_kind(Kind::Double).flatten(0, -1)).expect("to vec");
    seqs.iter().enumerate().map(|(row, s)| flat[row * width..row * width + s.len()].to_vec()).collect()
}

pub fn load_f32(dir: &Path) -> CausalLm {
    CausalLm::load(dir, Device::Cpu, Kind::Float).expect("load model")
}
