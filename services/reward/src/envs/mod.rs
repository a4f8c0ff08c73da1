//! The built-in environments, one file each: [`math`], [`code`] (in the sandbox),
//! [`puzzle`] (`sliding_puzzle`), [`matching`] (`exact_match`, `regex`, `multiple_choice`),
//! [`http`] (the user's reward service) and [`reward_model`] (a Bradley–Terry model on a
//! trainer worker).

pub mod addresses;
pub mod code;
pub mod http;
pub mod matching;
pub mod math;
pub mod puzzle;
pub mod reward_model;
