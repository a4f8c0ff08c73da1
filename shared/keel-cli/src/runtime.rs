//! Where and in what precision a command runs a model: the flags `keel model score|generate`
//! and `keel model bench` share.

use std::path::PathBuf;

use clap::Args;
use keel_model::CausalLm;
use keel_model::device::{parse_device, parse_kind};

#[derive(Debug, Args)]
pub struct RuntimeArgs {
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub(crate) dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
}

impl RuntimeArgs {
    pub(crate) fn load(&self) -> anyhow::Result<CausalLm> {
        let device = parse_device(&self.device)?;
        let kind = parse_kind(&self.dtype)?;
        Ok(CausalLm::load(&self.model, device, kind)?)
    }
}
