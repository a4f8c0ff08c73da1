//! All-reduce bandwidth of the CPU backend: `world` ranks (threads) each all-reduce (sum) an
//! f32 tensor of each size, timed over `iters` rounds after a warm-up. Prints one JSON line per
//! (world, size): seconds per all-reduce, algorithm bandwidth (bytes / time) and bus bandwidth
//! (algorithm bandwidth × 2(w-1)/w, the figure NCCL's tests report).
//!
//!   cargo run --release -p keel-collective --example all_reduce_bandwidth -- [WORLD...]

use std::time::Instant;

use keel_collective::cpu::CpuGroup;
use keel_collective::{Collective, ReduceOp};
use tch::{Device, Kind, Tensor};

const SIZES: [i64; 4] = [1 << 16, 1 << 20, 1 << 22, 1 << 24];

fn main() {
    let worlds: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let worlds = if worlds.is_empty() { vec![2, 4] } else { worlds };
    tch::set_num_threads(1);
    for world in worlds {
        for elements in SIZES {
            let iters = (256 * 1024 * 1024 / (elements * 4)).clamp(5, 200) as u32;
            let ranks = CpuGroup::new(world).expect("a group");
            let threads: Vec<_> = ranks
                .into_iter()
                .map(|c| {
                    std::thread::spawn(move || {
                        tch::set_num_threads(1);
                        let mut t = Tensor::ones([elements], (Kind::Float, Device::Cpu));
                        for _ in 0..3 {
                            c.all_reduce(&mut t, ReduceOp::Sum).expect("warm-up");
                        }
                        c.barrier().expect("barrier");
                        let started = Instant::now();
                        for _ in 0..iters {
                            c.all_reduce(&mut t, ReduceOp::Sum).expect("all_reduce");
                        }
                        c.barrier().expect("barrier");
                        started.elapsed().as_secs_f64() / f64::from(iters)
                    })
                })
                .collect();
            let seconds = threads.into_iter().map(|h| h.join().expect("a rank")).fold(0.0, f64::max);
            let bytes = (elements * 4) as f64;
            let algbw = bytes / seconds / 1e9;
            let busbw = algbw * 2.0 * (world as f64 - 1.0) / world as f64;
            println!(
                "{{\"impl\": \"keel-cpu\", \"world\": {world}, \"bytes\": {bytes}, \"iters\": {iters}, \"seconds\": {seconds:.6}, \"algbw_gbps\": {algbw:.3}, \"busbw_gbps\": {busbw:.3}}}"
            );
        }
    }
}
