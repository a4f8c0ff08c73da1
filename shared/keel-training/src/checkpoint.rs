//! Trainer checkpoints: a directory that transformers and vLLM load as the policy (HF
//! `config.json`, safetensors, tokenizer files, generation config, chat template) plus what
//! resuming needs. A LoRA run's checkpoint holds its adapters in PEFT's layout instead of the
//! weights (`adapter_config.json`, naming the base model's directory, and
//! `adapter_model.safetensors`; see [`keel_model::lora`]): `peft` loads it on top of the base,
//! and Keel loads it as the base with the adapters merged. Beside the weights:
//!
//! - `value_head.safetensors`: the reward model's scalar head (`score.weight`, [1, hidden]);
//! - `optimizer.safetensors`: AdamW moments and, when computing in bf16/f16, the f32 master
//!   weights;
//! - `critic/`: PPO's critic, a checkpoint directory of its own ([`crate::critic`]);
//! - `trainer_state.json`: format, optimiser step (the scheduler's position), seed, compute
//!   dtype, the training configuration, the reference model's path, and the caller's
//!   training info.
//!
//! The directory is written under a hidden temporary name beside its destination and
//! renamed into place, so it appears complete or not at all; an existing checkpoint is never
//! overwritten. Training draws no random numbers after load (unless LoRA's dropout is on), so
//! the seed is the whole RNG state.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::optim::AdamW;
use keel_model::{CausalLm, SaveOptions};
use keel_protocol::training::TrainingConfig;

pub const FORMAT: &str = "keel-trainer-checkpoint/1";
pub const STATE_FILE: &str = "trainer_state.json";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const VALUE_HEAD_FILE: &str = "value_head.safetensors";
pub const VALUE_HEAD_TENSOR: &str = "score.weight";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerState {
    pub format: String,
    pub step: u64,
    pub seed: u64,
    pub compute_dtype: String,
    pub training: TrainingConfig,
    /// The reference model the run trains against (reused when resuming without one).
    #[serde(default)]
    pub reference: Option<String>,
    #[serde(default)]
    pub info: serde_json::Value,
}

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::Checkpoint(format!("{}: {e}", path.display()))
}

fn write_tensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let cpu = tensors
        .iter()
        .map(|(name, t)| Ok((name.clone(), t.f_detach()?.f_to_device(Device::Cpu)?.f_contiguous()?)))
        .collect::<Result<Vec<_>>>()?;
    Tensor::write_safetensors(&cpu, path).map_err(|e| Error::Checkpoint(format!("{}: {e}", path.display())))
}

fn sync(path: &Path) -> Result<()> {
    std::fs::File::open(path).and_then(|f| f.sync_all()).map_err(io_error(path))
}

/// The policy's part of a checkpoint.
#[derive(Debug, Clone, Copy)]
pub enum Weights<'a> {
    /// Every weight, as a Hugging Face model directory.
    Whole(&'a CausalLm),
    /// Only the LoRA adapters of `model`, over the model directory `base`.
    Adapters { model: &'a CausalLm, base: &'a Path },
}

/// One trained model's part of a checkpoint directory.
#[derive(Debug, Clone, Copy)]
pub struct Part<'a> {
    /// The directory the model was loaded from (its tokenizer and side files are copied).
    pub source: &'a Path,
    pub weights: Weights<'a>,
    pub value_head: Option<&'a Tensor>,
    pub optimizer_state: &'a BTreeMap<String, Tensor>,
    pub state: &'a TrainerState,
}

fn write_contents(dir: &Path, part: &Part<'_>) -> Result<()> {
    match part.weights {
        Weights::Whole(model) => model.save(dir, SaveOptions::default())?,
        Weights::Adapters { model, base } => model.save_adapters(dir, base)?,
    }
    keel_model::pretrained::copy_side_files(part.source, dir)?;
    if let Some(head) = part.value_head {
        write_tensors(&dir.join(VALUE_HEAD_FILE), &[(VALUE_HEAD_TENSOR.to_string(), head.shallow_clone())])?;
    }
    let tensors: Vec<(String, Tensor)> =
        part.optimizer_state.iter().map(|(k, t)| (k.clone(), t.shallow_clone())).collect();
    write_tensors(&dir.join(OPTIMIZER_FILE), &tensors)?;
    let text = serde_json::to_string_pretty(part.state).map_err(|e| Error::Internal(e.to_string()))?;
    std::fs::write(dir.join(STATE_FILE), text).map_err(io_error(dir))?;
    for entry in std::fs::read_dir(dir).map_err(io_error(dir))? {
        let path = entry.map_err(io_error(dir))?.path();
        if path.is_file() {
            sync(&path)?;
        }
    }
    Ok(())
}

/// Writes the checkpoint at `path` atomically; returns its file names.
/// Writes the checkpoint at `path` atomically: the policy's `policy` part, and PPO's critic
/// in `critic/` when there is one; returns its files' paths inside it.
pub fn save(path: &Path, policy: Part<'_>, critic: Option<Part<'_>>) -> Result<Vec<String>> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::Checkpoint(format!("{} does not end in a directory name", path.display())))?;
    if path.exists() {
        return Err(Error::Checkpoint(format!("{} already exists; checkpoints are never overwritten", path.display())));
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io_error(parent))?;
    let partial = parent.join(format!(".{name}.partial-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir(&partial).map_err(io_error(&partial))?;
    let critic_dir = partial.join(crate::critic::CRITIC_DIR);
    let written = write_contents(&partial, &policy)
        .and_then(|()| match &critic {
            Some(critic) => std::fs::create_dir(&critic_dir)
                .map_err(io_error(&critic_dir))
                .and_then(|()| write_contents(&critic_dir, critic))
                .and_then(|()| sync(&critic_dir)),
            None => Ok(()),
        })
        .and_then(|()| std::fs::rename(&partial, path).map_err(io_error(path)))
        .and_then(|()| sync(parent));
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(e);
    }
    let mut files = Vec::new();
    list_files(path, "", &mut files)?;
    files.sort();
    Ok(files)
}

/// The files under `dir`, as paths relative to it (`prefix` before each).
fn list_files(dir: &Path, prefix: &str, files: &mut Vec<String>) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(io_error(dir))? {
        let entry = entry.map_err(io_error(dir))?;
        let Ok(name) = entry.file_name().into_string() else { continue };
        if entry.path().is_dir() {
            list_files(&entry.path(), &format!("{prefix}{name}/"), files)?;
        } else {
            files.push(format!("{prefix}{name}"));
        }
    }
    Ok(())
}

/// Reads `trainer_state.json` of a checkpoint directory (None for a plain HF directory).
pub fn read_state(dir: &Path) -> Result<Option<TrainerState>> {
    let path = dir.join(STATE_FILE);
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(io_error(&path))?;
    let state: TrainerState = serde_json::from_str(&text)
        .map_err(|e| Error::Load { what: path.display().to_string(), reason: e.to_string() })?;
    if state.format != FORMAT {
        return Err(Error::Load {
            what: path.display().to_string(),
            reason: format!("unknown format `{}`", state.format),
        });
    }
    Ok(Some(state))
}

/// Optimiser state from [`AdamW::gathered_state`] made whole from the tensor-parallel
/// ranks' parts by their layouts in `model` (every rank of the group calls it); rank 0 keeps
/// the tensors, on the CPU, for the file, the other ranks get none.
pub fn whole_optimizer_state(
    model: &CausalLm,
    tensors: Vec<(String, Tensor, keel_model::model::Layout)>,
) -> Result<BTreeMap<String, Tensor>> {
    let keep = model.rank() == 0;
    let mut state = BTreeMap::new();
    for (key, tensor, layout) in tensors {
        let whole = model.gather_parameter(&tensor, layout)?;
        if keep {
            state.insert(key, whole.f_to_device(Device::Cpu)?);
        }
    }
    Ok(state)
}

/// Restores the optimiser (moments, master weights, step) from a checkpoint directory; a
/// plain HF directory leaves it fresh.
pub fn restore_optimizer(dir: &Path, optimizer: &mut AdamW) -> Result<()> {
    let Some(state) = read_state(dir)? else { return Ok(()) };
    let path: PathBuf = dir.join(OPTIMIZER_FILE);
    let tensors: BTreeMap<String, Tensor> = Tensor::read_safetensors(&path)
        .map_err(|e| Error::Load { what: path.display().to_string(), reason: e.to_string() })?
        .into_iter()
        .collect();
    optimizer
        .restore(&tensors, state.step)
        .map_err(|e| Error::Load { what: path.display().to_string(), reason: e.to_string() })
}

/// Loads a value head ([1, hidden] f32, trainable) from `path`.
pub fn load_value_head(path: &Path, hidden: i64, device: Device) -> Result<Tensor> {
    let what = || path.display().to_string();
    let tensors = Tensor::read_safetensors(path).map_err(|e| Error::Load { what: what(), reason: e.to_string() })?;
    let (_, head) = tensors
        .into_iter()
        .find(|(name, _)| name == VALUE_HEAD_TENSOR)
        .ok_or_else(|| Error::Load { what: what(), reason: format!("no tensor `{VALUE_HEAD_TENSOR}`") })?;
    if head.size() != [1, hidden] {
        return Err(Error::Load {
            what: what(),
            reason: format!("`{VALUE_HEAD_TENSOR}` has shape {:?}, expected [1, {hidden}]", head.size()),
        });
    }
    Ok(head.f_to_kind(Kind::Float)?.f_to_device(device)?.f_set_requires_grad(true)?)
}
