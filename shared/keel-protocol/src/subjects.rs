//! NATS subject names, built only here. Every subject starts with a prefix, `keel.v1` by
//! default; a deployment (or a test) may choose another so that several stacks share one
//! NATS server without hearing each other.

/// The queue group every free trainer worker joins on [`Subjects::trainer_claim`].
pub const TRAINER_QUEUE_GROUP: &str = "trainer";

/// The queue group every free generator joins on [`Subjects::generator_claim`], and the
/// one a run's generators form on the run's [`Subjects::generate`].
pub const GENERATOR_QUEUE_GROUP: &str = "generator";

/// The operations a generator serves on its own subjects (a run's rollouts, refits and
/// memory changes come on the run's subjects instead: see [`Subjects::generate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GeneratorOp {
    /// Claim this generator by name (refused while another run holds it).
    Claim,
    /// Load the run's model.
    Load,
    Heartbeat,
    Release,
    /// Open an agent session: a key scoped to one sample of the run.
    AgentOpen,
    /// Close an agent session and take what was generated under its key.
    AgentClose,
}

impl GeneratorOp {
    pub const ALL: [GeneratorOp; 6] =
        [Self::Claim, Self::Load, Self::Heartbeat, Self::Release, Self::AgentOpen, Self::AgentClose];

    pub fn name(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Load => "load",
            Self::Heartbeat => "heartbeat",
            Self::Release => "release",
            Self::AgentOpen => "agent_open",
            Self::AgentClose => "agent_close",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|op| op.name() == name)
    }
}

/// The operations a claimed trainer worker serves on its own subjects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrainerOp {
    /// Claim this worker by name (refused while another run holds it).
    Claim,
    Load,
    Logprobs,
    Train,
    /// The loss on a batch without an update (validation).
    Evaluate,
    Score,
    Save,
    Export,
    /// Colocated runs: optimiser state (and weights) to host memory, and back.
    Offload,
    Onload,
    Heartbeat,
    Release,
}

impl TrainerOp {
    pub const ALL: [TrainerOp; 12] = [
        Self::Claim,
        Self::Load,
        Self::Logprobs,
        Self::Train,
        Self::Evaluate,
        Self::Score,
        Self::Save,
        Self::Export,
        Self::Offload,
        Self::Onload,
        Self::Heartbeat,
        Self::Release,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Load => "load",
            Self::Logprobs => "logprobs",
            Self::Train => "train",
            Self::Evaluate => "evaluate",
            Self::Score => "score",
            Self::Save => "save",
            Self::Export => "export",
            Self::Offload => "offload",
            Self::Onload => "onload",
            Self::Heartbeat => "heartbeat",
            Self::Release => "release",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|op| op.name() == name)
    }
}

/// Subject builder for one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subjects {
    prefix: String,
}

/// A subject prefix with an empty token, a wildcard, a space or another odd character.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("subject prefix `{0}` must be dot-separated tokens of letters, digits, `-` and `_`")]
pub struct InvalidPrefix(pub String);

impl Default for Subjects {
    fn default() -> Self {
        Self { prefix: "keel.v1".into() }
    }
}

impl Subjects {
    /// Subjects under `prefix` (dot-separated tokens without wildcards or spaces).
    pub fn new(prefix: &str) -> Result<Self, InvalidPrefix> {
        let valid_token =
            |t: &str| !t.is_empty() && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if prefix.split('.').all(valid_token) {
            Ok(Self { prefix: prefix.to_string() })
        } else {
            Err(InvalidPrefix(prefix.to_string()))
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Claims any free trainer worker (queue group [`TRAINER_QUEUE_GROUP`]).
    pub fn trainer_claim(&self) -> String {
        format!("{}.trainer.claim", self.prefix)
    }

    /// One worker's subject for `op`.
    pub fn trainer(&self, worker: &str, op: TrainerOp) -> String {
        format!("{}.trainer.{worker}.{}", self.prefix, op.name())
    }

    /// Claims any free generator (queue group [`GENERATOR_QUEUE_GROUP`]).
    pub fn generator_claim(&self) -> String {
        format!("{}.generator.claim", self.prefix)
    }

    /// One generator's subject for `op`.
    pub fn generator(&self, generator: &str, op: GeneratorOp) -> String {
        format!("{}.generator.{generator}.{}", self.prefix, op.name())
    }

    /// Every per-generator subject of `generator` (for subscribing).
    pub fn generator_all(&self, generator: &str) -> String {
        format!("{}.generator.{generator}.*", self.prefix)
    }

    /// Run `run_id`'s rollout requests, served by the generators it claimed (queue group
    /// [`GENERATOR_QUEUE_GROUP`]): no other run's generator hears them.
    pub fn generate(&self, run_id: &str) -> String {
        format!("{}.run.{run_id}.generate", self.prefix)
    }

    /// Direct scoring of completions (queue group [`crate::reward::REWARD_QUEUE_GROUP`]).
    pub fn reward_score(&self) -> String {
        format!("{}.reward.score", self.prefix)
    }

    /// Environment steps (queue group [`crate::reward::REWARD_QUEUE_GROUP`]).
    pub fn reward_env_step(&self) -> String {
        format!("{}.reward.env.step", self.prefix)
    }

    /// A checkpoint was committed (JetStream).
    pub fn checkpoint_created(&self) -> String {
        format!("{}.checkpoint.created", self.prefix)
    }

    /// A checkpoint was deleted (JetStream).
    pub fn checkpoint_deleted(&self) -> String {
        format!("{}.checkpoint.deleted", self.prefix)
    }

    /// The JetStream stream holding this prefix's checkpoint events.
    pub fn checkpoint_stream(&self) -> String {
        format!("KEEL_CHECKPOINTS_{}", self.prefix.replace(['.', '-'], "_").to_uppercase())
    }

    /// New weights for run `run_id`'s generators (each of them hears it).
    pub fn weights_updated(&self, run_id: &str) -> String {
        format!("{}.run.{run_id}.weights", self.prefix)
    }

    /// Sleep and wake of run `run_id`'s colocated generators (each of them hears it and
    /// answers on the reply subject).
    pub fn generator_memory(&self, run_id: &str) -> String {
        format!("{}.run.{run_id}.memory", self.prefix)
    }

    /// Where a generator asks `worker` to send it an export kept for the collective
    /// transfer (see [`crate::trainer::SendWeights`]; not an operation of the run holding
    /// the worker: the export's id is what admits it).
    pub fn trainer_send_weights(&self, worker: &str) -> String {
        format!("{}.trainer.{worker}.send_weights", self.prefix)
    }

    /// The prefix under which `worker` and a generator form the communicator of one
    /// collective transfer (`<this>.<session>`).
    pub fn trainer_weights_meeting(&self, worker: &str) -> String {
        format!("{}.trainer.{worker}.weights", self.prefix)
    }

    /// Every per-worker subject of `worker` (for subscribing).
    pub fn trainer_all(&self, worker: &str) -> String {
        format!("{}.trainer.{worker}.*", self.prefix)
    }
}

/// Whether `id` can be one token of a subject (a worker id).
pub fn is_subject_token(id: &str) -> bool {
    !id.is_empty() && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// A request–reply operation served by a queue group (any replica may answer), by its
/// request type: the subject it is sent on and the reply it gets. Callers and the services'
/// subscriptions both take the subject from it.
pub trait QueueCall: serde::Serialize + serde::de::DeserializeOwned {
    type Reply: serde::Serialize + serde::de::DeserializeOwned;
    fn subject(subjects: &Subjects) -> String;
}

impl QueueCall for crate::reward::EnvStepRequest {
    type Reply = crate::reward::EnvStepReply;
    fn subject(subjects: &Subjects) -> String {
        subjects.reward_env_step()
    }
}

impl QueueCall for crate::reward::ScoreRequest {
    type Reply = crate::reward::ScoreReply;
    fn subject(subjects: &Subjects) -> String {
        subjects.reward_score()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_are_versioned_and_prefixed() {
        let s = Subjects::default();
        assert_eq!(s.trainer_claim(), "keel.v1.trainer.claim");
        assert_eq!(
            (s.generate("r1"), s.weights_updated("r1"), s.generator_memory("r1")),
            ("keel.v1.run.r1.generate".into(), "keel.v1.run.r1.weights".into(), "keel.v1.run.r1.memory".into())
        );
        assert_eq!(
            (s.generator_claim(), s.generator("g1", GeneratorOp::Load)),
            ("keel.v1.generator.claim".into(), "keel.v1.generator.g1.load".into())
        );
        assert_eq!(
            (s.reward_score(), s.reward_env_step()),
            ("keel.v1.reward.score".into(), "keel.v1.reward.env.step".into())
        );
        assert_eq!(s.trainer("w1", TrainerOp::Train), "keel.v1.trainer.w1.train");
        assert_eq!(Subjects::new("t.abc-1").unwrap().trainer_all("w"), "t.abc-1.trainer.w.*");
        assert!(Subjects::new("keel.*").is_err());
        assert!(Subjects::new("a..b").is_err());
        for op in TrainerOp::ALL {
            assert_eq!(TrainerOp::from_name(op.name()), Some(op));
        }
        for op in GeneratorOp::ALL {
            assert_eq!(GeneratorOp::from_name(op.name()), Some(op));
        }
    }
}
