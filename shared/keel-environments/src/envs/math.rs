//! `math`: the final answer (last `\boxed{}`, or the configured pattern) compared with
//! `metadata.ground_truth` by mathematical equivalence ([`crate::math`]). Reward 1 or 0; a
//! sample that runs past its time limit scores 0 (its `info.reason` says so).

use keel_protocol::FieldError;
use keel_protocol::reward::{EnvSample, EnvStepResult, MathConfig};
use serde_json::json;

use crate::envs::{Outcome, SampleEnv, last_turn, metadata_text};
use crate::math::MathVerifier;

#[derive(Debug)]
pub struct MathEnv {
    verifier: MathVerifier,
}

impl MathEnv {
    pub fn new(config: &MathConfig) -> Result<Self, FieldError> {
        Ok(Self { verifier: MathVerifier::new(config)? })
    }
}

impl SampleEnv for MathEnv {
    fn step_one(&self, sample: &EnvSample) -> Outcome {
        let response = last_turn(sample)?;
        let truth = metadata_text(&sample.metadata, "ground_truth")?;
        let verdict = self.verifier.verify(response, &truth);
        let mut result = EnvStepResult::done(f64::from(u8::from(verdict.correct)), sample.metadata.clone());
        result.answer = verdict.extracted;
        if let Some(reason) = verdict.reason {
            result.info = json!({"reason": reason});
        }
        Ok(result)
    }
}
