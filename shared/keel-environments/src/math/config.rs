//! The typed configuration of the `math` environment ([`keel_protocol::reward::MathConfig`],
//! re-exported here) and its validation.

use keel_protocol::FieldError;
use regex::Regex;

pub use keel_protocol::reward::MathConfig;

/// Largest accepted [`MathConfig::time_limit_ms`].
pub const MAX_TIME_LIMIT_MS: u64 = 60_000;

/// Checks every field of `config` and compiles its answer pattern; the error names the field
/// (`"answer_pattern: …"`).
pub(crate) fn check(config: &MathConfig) -> Result<Option<Regex>, FieldError> {
    let pattern = match config.answer_pattern.as_deref() {
        Some("") => return Err(FieldError::new("answer_pattern", "must not be empty")),
        Some(pattern) => Some(crate::envs::compile_pattern("answer_pattern", pattern, true)?),
        None => None,
    };
    let tol = config.relative_tolerance;
    if !tol.is_finite() || !(0.0..1.0).contains(&tol) {
        return Err(FieldError::new("relative_tolerance", format!("must be a finite number in [0, 1), got {tol}")));
    }
    if !(1..=MAX_TIME_LIMIT_MS).contains(&config.time_limit_ms) {
        return Err(FieldError::new(
            "time_limit_ms",
            format!("must be between 1 and {MAX_TIME_LIMIT_MS}, got {}", config.time_limit_ms),
        ));
    }
    Ok(pattern)
}
