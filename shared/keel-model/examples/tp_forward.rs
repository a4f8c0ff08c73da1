//! The cost of tensor parallelism on a forward pass, on this CPU: token logprobs of a batch
//! with a model of the given shape at TP = 1 (one thread) and at TP = N (N ranks as threads
//! of the CPU collective, one compute thread each). Prints one JSON line per TP size with
//! the seconds per forward, the speed-up over TP = 1 and the parallel efficiency
//! (speed-up / N; 1.0 = no overhead).
//!
//! With `MODE=train` each pass is a training pass instead: token logprobs with gradients,
//! a loss over them, and the backward pass through every rank (the TP backward included).
//!
//!   cargo run --release -p keel-model --example tp_forward -- [TP...]
//!   HIDDEN=1024 LAYERS=8 BATCH=8 SEQ=256 cargo run --release -p keel-model --example tp_forward -- 2
//!   MODE=train cargo run --release -p keel-model --example tp_forward -- 2

use std::time::Instant;

use keel_collective::cpu::CpuGroup;
use keel_model::{CausalLm, Init, ModelConfig};
use tch::{Device, Kind, Tensor};

fn var(name: &str, default: i64) -> i64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let sizes: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let sizes = if sizes.is_empty() { vec![2] } else { sizes };
    let (hidden, layers, batch, seq) = (var("HIDDEN", 512), var("LAYERS", 4), var("BATCH", 8), var("SEQ", 128));
    let iters = var("ITERS", 5) as u32;
    let train = std::env::var("MODE").is_ok_and(|m| m == "train");
    let cfg = ModelConfig::from_json(serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": hidden, "intermediate_size": hidden * 3,
        "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": hidden / 8,
        "vocab_size": 8192, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    }))
    .expect("a config");
    tch::set_num_threads(1);
    tch::manual_seed(1);
    let full = CausalLm::new(cfg, Device::Cpu, Kind::Float, Init::Random { std: 0.02 }).expect("a model");
    let ids = Tensor::randint(8192, [batch, seq], (Kind::Int64, Device::Cpu));
    let lengths = vec![seq; batch as usize];
    let time = |f: &dyn Fn()| {
        f();
        let started = Instant::now();
        for _ in 0..iters {
            f();
        }
        started.elapsed().as_secs_f64() / f64::from(iters)
    };
    let single = time(&|| {
        if train {
            full.token_logprobs(&ids, &lengths, 1.0).expect("logprobs").sum(Kind::Float).backward();
            full.var_store().variables().values_mut().for_each(Tensor::zero_grad);
        } else {
            let _no_grad = tch::no_grad_guard();
            let _ = full.token_logprobs(&ids, &lengths, 1.0).expect("logprobs");
        }
    });
    let mode = if train { "train" } else { "forward" };
    println!(
        "{{\"mode\": \"{mode}\", \"tp\": 1, \"hidden\": {hidden}, \"layers\": {layers}, \"batch\": {batch}, \"seq\": {seq}, \"seconds\": {single:.4}}}"
    );
    for tp in sizes {
        let ranks: Vec<_> = CpuGroup::new(tp)
            .expect("a group")
            .into_iter()
            .map(|comm| keel_model::CausalLm::shard(&full, std::sync::Arc::new(comm)).expect("a shard"))
            .collect();
        let threads: Vec<_> = ranks
            .into_iter()
            .map(|model| {
                let (ids, lengths) = (ids.copy(), lengths.clone());
                std::thread::spawn(move || {
                    tch::set_num_threads(1);
                    model.set_trainable(train).expect("trainable");
                    let pass = || {
                        if train {
                            let (logprobs, tape) = model.train_logprobs(&ids, &lengths, 1.0).expect("logprobs");
                            logprobs.sum(Kind::Float).backward();
                            model.backward(tape).expect("backward");
                            model.reduce_replicated_gradients().expect("gradients");
                            model.parameters().iter().for_each(|(_, p, _)| p.shallow_clone().zero_grad());
                        } else {
                            let _ = model.token_logprobs(&ids, &lengths, 1.0).expect("logprobs");
                        }
                    };
                    pass();
                    let started = Instant::now();
                    for _ in 0..iters {
                        pass();
                    }
                    started.elapsed().as_secs_f64() / f64::from(iters)
                })
            })
            .collect();
        let seconds = threads.into_iter().map(|t| t.join().expect("a rank")).fold(0.0, f64::max);
        let speedup = single / seconds;
        println!(
            "{{\"mode\": \"{mode}\", \"tp\": {tp}, \"seconds\": {seconds:.4}, \"speedup\": {speedup:.3}, \"efficiency\": {:.3}}}",
            speedup / tp as f64
        );
    }
}
