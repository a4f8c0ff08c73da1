//! The learning-rate schedule: linear warm-up from `warmup_start_factor × lr` to `lr` over
//! `warmup_steps`, then constant, or cosine / linear decay to `min_lr_ratio × lr` at
//! `total_steps` (held there afterwards).

use keel_protocol::training::{Decay, SchedulerConfig};

/// The factor applied to the base learning rate at optimiser step `step` (0-based).
pub fn lr_factor(config: &SchedulerConfig, step: u64) -> f64 {
    let warmup = config.warmup_steps;
    if step < warmup {
        let progress = step as f64 / warmup as f64;
        return config.warmup_start_factor + (1.0 - config.warmup_start_factor) * progress;
    }
    let Some(total) = config.total_steps else { return 1.0 };
    let span = total.saturating_sub(warmup).max(1) as f64;
    let progress = ((step - warmup) as f64 / span).min(1.0);
    let floor = config.min_lr_ratio;
    match config.decay {
        Decay::Constant => 1.0,
        Decay::Linear => floor + (1.0 - floor) * (1.0 - progress),
        Decay::Cosine => floor + (1.0 - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn warmup_then_decay() {
        let mut c = SchedulerConfig { warmup_steps: 4, warmup_start_factor: 0.2, ..Default::default() };
        assert!(close(lr_factor(&c, 0), 0.2));
        assert!(close(lr_factor(&c, 2), 0.6));
        assert!(close(lr_factor(&c, 4), 1.0));
        assert!(close(lr_factor(&c, 1000), 1.0));
        c.decay = Decay::Cosine;
        c.total_steps = Some(14);
        c.min_lr_ratio = 0.1;
        assert!(close(lr_factor(&c, 4), 1.0));
        assert!(close(lr_factor(&c, 9), 0.55));
        assert!(close(lr_factor(&c, 14), 0.1));
        assert!(close(lr_factor(&c, 20), 0.1));
        c.decay = Decay::Linear;
        assert!(close(lr_factor(&c, 9), 0.55));
        assert!(close(lr_factor(&c, 6), 1.0 - 0.9 * 0.2));
    }
}
