//! The `keel` command line.
//!
//! Layout: [`Cli`] is the clap tree; [`model`] holds `keel model init|score|generate`;
//! [`bench`] holds `keel model bench`; [`runtime`] the model, dtype and device flags both
//! share; [`train`] holds `keel train bench`; [`generate`] holds
//! `keel generate bench`; [`serve`] holds `keel generate serve-bench`, a load generator for
//! OpenAI-compatible servers; [`reward`] holds `keel reward bench`; [`checkpoint`] holds
//! `keel checkpoint list|upload|download|export`; [`run`] holds
//! `keel run submit|validate|list|show|watch|cancel|samples`, and [`spec`] reads the spec files
//! they send (`${VAR}` from the environment, `--set` overrides); [`stack`] holds
//! `keel stack up|status|down` and the local stack's settings the REST commands fall back on.
//! Commands return `anyhow` errors whose chain reads as one line. The engine commands
//! (`model`, `train`, `generate`, `reward`) need the `engines` feature (on by default), which
//! links libtorch; without it `keel` is the REST client alone.

#[cfg(feature = "engines")]
pub mod bench;
pub mod checkpoint;
#[cfg(feature = "engines")]
pub mod generate;
#[cfg(feature = "engines")]
pub mod model;
#[cfg(feature = "engines")]
pub mod reward;
pub mod run;
#[cfg(feature = "engines")]
pub mod runtime;
#[cfg(feature = "engines")]
pub mod serve;
pub mod spec;
pub mod stack;
#[cfg(feature = "engines")]
pub mod train;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "keel", version, about = "Keel: post-training LLMs with RL, as services")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Make, score with and sample from Hugging Face model directories.
    #[cfg(feature = "engines")]
    #[command(subcommand)]
    Model(model::ModelCommand),
    /// The generator's engine outside the service.
    #[cfg(feature = "engines")]
    #[command(subcommand)]
    Generate(generate::GenerateCommand),
    /// The checkpoint service: list, upload, download as an HF directory, export as tar.
    #[command(subcommand)]
    Checkpoint(checkpoint::CheckpointCommand),
    /// Reward environments outside the service.
    #[cfg(feature = "engines")]
    #[command(subcommand)]
    Reward(reward::RewardCommand),
    /// The training engine outside the service.
    #[cfg(feature = "engines")]
    #[command(subcommand)]
    Train(train::TrainCommand),
    /// Runs on the orchestrator: submit, list, show, watch, cancel, samples.
    Run(run::RunArgs),
    /// The local stack without the demo: up, status, down (`.keel/stack.env` holds its URLs
    /// and tokens, which the other commands read).
    #[command(subcommand)]
    Stack(stack::StackCommand),
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        #[cfg(feature = "engines")]
        Command::Model(command) => model::run(command),
        #[cfg(feature = "engines")]
        Command::Train(command) => train::run(command),
        #[cfg(feature = "engines")]
        Command::Generate(command) => generate::run(command),
        #[cfg(feature = "engines")]
        Command::Reward(command) => reward::run(command),
        Command::Checkpoint(command) => checkpoint::run(command),
        Command::Run(args) => run::run(args),
        Command::Stack(command) => stack::run(command),
    }
}

/// Whether `err` is the reader of our output having gone away (a closed pipe): not a
/// failure of the command.
pub fn closed_pipe(err: &anyhow::Error) -> bool {
    err.chain()
        .any(|cause| cause.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe))
}
