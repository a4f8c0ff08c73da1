//! PLACEHOLDER replaced by the math verifier.
use keel_protocol::reward::MathConfig;
#[derive(Debug)]
pub struct MathVerifier;
pub struct Verdict {
    pub correct: bool,
    pub extracted: Option<String>,
    pub reason: Option<String>,
}
impl MathVerifier {
    pub fn new(_c: &MathConfig) -> Result<Self, String> {
        Ok(Self)
    }
    pub fn verify(&self, r: &str, t: &str) -> Verdict {
        Verdict { correct: r == t, extracted: None, reason: None }
    }
}
