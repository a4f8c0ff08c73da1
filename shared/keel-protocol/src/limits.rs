//! Bounds on the sizes a run spec asks for, checked before anything is allocated: far above
//! what a real run uses (NeMo-RL recipes run hundreds of prompts × tens of generations per
//! step, sequences of tens of thousands of tokens), far below what would exhaust memory.

/// Samples one GRPO step generates (prompts × generations) and trains on.
pub const MAX_SAMPLES_PER_STEP: usize = 1 << 20;
pub const MAX_GENERATIONS_PER_PROMPT: usize = 4096;
/// Tokens in one sequence, prompt and response.
pub const MAX_SEQUENCE_LENGTH: usize = 1 << 20;
/// Samples per validation prompt.
pub const MAX_VALIDATION_SAMPLES: usize = 4096;
/// Environment turns of one multi-turn sample.
pub const MAX_ROLLOUT_TURNS: u32 = 1024;
/// Generators one run holds.
pub const MAX_GENERATOR_REPLICAS: usize = 256;
/// Stop strings one request or run gives: each is looked for in every sample's text after
/// every token, so their count and length bound the work each decoding step may be asked.
pub const MAX_STOP_STRINGS: usize = 32;
/// The longest stop string, in bytes.
pub const MAX_STOP_STRING_BYTES: usize = 256;
/// Extra stop token ids one request gives.
pub const MAX_STOP_TOKEN_IDS: usize = 1024;
