//! Loading and saving a [`CausalLm`] as a Hugging Face model directory (`config.json` plus
//! safetensors weights).

use std::collections::BTreeMap;
use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::{CausalLm, Init};
use crate::weights::{self, SaveOptions};

/// The files of a model directory besides its config and weights (tokenizer, generation
/// config, chat template), copied along wherever a model directory is written from another.
pub const MODEL_SIDE_FILES: [&str; 8] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
];

/// Copies the [`MODEL_SIDE_FILES`] that `from` has into `to`.
pub fn copy_side_files(from: &Path, to: &Path) -> Result<()> {
    for name in MODEL_SIDE_FILES {
        let source = from.join(name);
        if source.is_file() {
            std::fs::copy(&source, to.join(name)).map_err(Error::io(&source))?;
        }
    }
    Ok(())
}

/// Writes `bytes` to `dir/name` through a temporary file and a rename.
pub(crate) fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let (tmp, path) = (dir.join(format!("{name}.tmp")), dir.join(name));
    std::fs::write(&tmp, bytes).map_err(Error::io(&tmp))?;
    weights::sync_file(&tmp)?;
    std::fs::rename(&tmp, &path).map_err(Error::io(&path))
}

pub(crate) fn write_json(dir: &Path, name: &str, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(Error::json(dir.join(name)))?;
    write_atomically(dir, name, text.as_bytes())
}

/// Copies `new` over `current` (tensors by name) in place, once every name of `current` is
/// in `new` with its shape and `new` has no other; otherwise nothing is copied and every
/// problem is listed.
pub(crate) fn copy_all(
    current: &std::collections::HashMap<String, Tensor>,
    new: &std::collections::HashMap<String, Tensor>,
) -> Result<()> {
    let mut problems = Vec::new();
    for (name, param) in current {
        match new.get(name) {
            None => problems.push(crate::error::WeightProblem::Missing { name: name.clone() }),
            Some(t) if t.size() != param.size() => problems.push(crate::error::WeightProblem::Shape {
                name: name.clone(),
                expected: param.size(),
                found: t.size(),
            }),
            Some(_) => {}
        }
    }
    problems.extend(
        new.keys()
            .filter(|n| !current.contains_key(*n))
            .map(|n| crate::error::WeightProblem::Unexpected { name: n.clone() }),
    );
    if !problems.is_empty() {
        return Err(Error::Weights(problems));
    }
    let _no_grad = tch::no_grad_guard();
    for (name, param) in current {
        param.shallow_clone().f_copy_(&new[name])?;
    }
    Ok(())
}

impl CausalLm {
    /// Loads a HF model directory, with parameters in `kind` on `device`. An adapter
    /// directory ([`crate::lora`]) loads as its base model with the adapters merged in.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::MissingDirectory(dir.to_path_buf()));
        }
        if crate::lora::is_adapter_dir(dir) {
            let mut model = crate::lora::AdapterDir::read(dir)?.load(device, Kind::Float)?;
            model.merge_adapters()?;
            model.set_kind(kind)?;
            return Ok(model);
        }
        let cfg = ModelConfig::load(dir)?;
        let (tied, fused) = (cfg.tie_word_embeddings, cfg.fused_weights());
        let model = Self::new(cfg, device, kind, Init::Zeros)?;
        weights::load_into(dir, &model.var_store().variables(), tied, &fused)?;
        Ok(model)
    }

    /// Saves `config.json` and the weights (in the parameters' dtype) to `dir`, creating it.
    pub fn save(&self, dir: &Path, options: SaveOptions) -> Result<()> {
        if self.is_shard() {
            return Err(Error::InvalidInput(
                "a tensor-parallel rank holds slices of the model: save the gathered model (gather_full)".into(),
            ));
        }
        std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
        let mut params: BTreeMap<_, _> = self.var_store().variables().into_iter().collect();
        weights::fuse(&mut params, &self.config().fused_weights())?;
        weights::save(dir, &params, options)?;
        write_json(dir, "config.json", &self.config().to_json(Some(weights::dtype_name(self.kind()))))
    }
}
