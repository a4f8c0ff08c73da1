//! LoRA: low-rank adapters on a model's linear layers, saved and read in PEFT's layout.
//!
//! A targeted linear `y = W·x + b` computes `y = W·x + b + s·B·(A·dropout(x))`, with A
//! [rank, in] and B [out, rank] (see [`keel_protocol::training::LoraConfig`] for the settings).
//! The adapters live in a var store of their own, so the model's var store keeps exactly the
//! Hugging Face tensors: saving, exporting and refitting the base model are unchanged.
//!
//! An adapter directory is what `peft`'s `save_pretrained` writes: `adapter_config.json`
//! (`base_model_name_or_path` names the base model's directory) and
//! `adapter_model.safetensors`, whose tensors are named
//! `base_model.model.<module>.lora_A.weight` and `….lora_B.weight`. Loading one as a model
//! ([`CausalLm::load`]) loads its base and merges the adapters into it. Adapters of the parts
//! of a fused projection (Phi-3's `qkv_proj`, ...) are written as PEFT's adapter of the fused
//! module ([`fused`]).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use keel_protocol::training::{LORA_TARGETS, LoraConfig};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor, nn};

use crate::error::{Error, Result, WeightProblem};
use crate::model::{CausalLm, FeedForward, Linear, Mlp};

mod fused;

pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// The prefix PEFT's `PeftModelForCausalLM` puts before the base model's tensor names.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// Whether the adapters add their term, and whether dropout is on (training passes).
#[derive(Debug, Default)]
pub(crate) struct Switch {
    off: AtomicBool,
    training: AtomicBool,
}

/// The adapter of one linear layer.
#[derive(Debug)]
pub(crate) struct Adapter {
    a: Tensor,
    b: Tensor,
    scale: f64,
    dropout: f64,
    switch: Arc<Switch>,
}

impl Adapter {
    /// `y + s·B·A·dropout(x)`, or `y` while the adapters are off.
    pub(crate) fn add_to(&self, y: Tensor, x: &Tensor) -> Result<Tensor> {
        if self.switch.off.load(Ordering::Relaxed) {
            return Ok(y);
        }
        let x = if self.dropout > 0.0 && self.switch.training.load(Ordering::Relaxed) {
            x.f_dropout(self.dropout, true)?
        } else {
            x.shallow_clone()
        };
        let low = x.f_linear::<Tensor>(&self.a, None)?.f_linear::<Tensor>(&self.b, None)?;
        Ok(y.f_add(&low.f_mul_scalar(self.scale)?)?)
    }

    /// `s·B·A` in f32 [out, in].
    fn delta(&self) -> Result<Tensor> {
        delta(&self.a, &self.b, self.scale)
    }
}

/// `s·B·A` in f32.
pub fn delta(a: &Tensor, b: &Tensor, scale: f64) -> Result<Tensor> {
    Ok(b.f_to_kind(Kind::Float)?.f_matmul(&a.f_to_kind(Kind::Float)?)?.f_mul_scalar(scale)?)
}

/// A model's adapters: their var store (names are the HF module names with
/// `.lora_A.weight` / `.lora_B.weight`), the settings, and the switch every adapter reads.
#[derive(Debug)]
pub(crate) struct Adapters {
    pub(crate) vs: nn::VarStore,
    pub(crate) config: LoraConfig,
    pub(crate) switch: Arc<Switch>,
}

/// An MLP's gate (0), up (1) or down (2) linear.
fn pick(mlp: &mut Mlp, which: usize) -> &mut Linear {
    match which {
        0 => &mut mlp.gate_proj,
        1 => &mut mlp.up_proj,
        _ => &mut mlp.down_proj,
    }
}

impl CausalLm {
    /// The linears `target` names in layer `layer`, with their HF module names
    /// (`model.layers.3.self_attn.q_proj`, …): one, or one per expert in an MoE layer (the
    /// MLP targets name each expert's linears: `mlp.experts.5.up_proj`, Mixtral's
    /// `block_sparse_moe.experts.5.w3`).
    fn linears_mut(&mut self, layer: usize, target: &str) -> Vec<(String, &mut Linear)> {
        let architecture = self.config().architecture;
        let l = &mut self.layers[layer];
        let prefix = format!("model.layers.{layer}");
        let attention = match target {
            "q_proj" => Some(&mut l.self_attn.q_proj),
            "k_proj" => Some(&mut l.self_attn.k_proj),
            "v_proj" => Some(&mut l.self_attn.v_proj),
            "o_proj" => Some(&mut l.self_attn.o_proj),
            _ => None,
        };
        if let Some(linear) = attention {
            return vec![(format!("{prefix}.self_attn.{target}"), linear)];
        }
        let which = match target {
            "gate_proj" => 0,
            "up_proj" => 1,
            "down_proj" => 2,
            other => unreachable!("`{other}` is not one of {LORA_TARGETS:?}"),
        };
        match &mut l.mlp {
            FeedForward::Dense(mlp) => vec![(format!("{prefix}.mlp.{target}"), pick(mlp, which))],
            FeedForward::Experts(experts) => {
                let (block, names) = crate::config::MoeConfig::names(architecture);
                experts
                    .experts
                    .iter_mut()
                    .enumerate()
                    .map(|(e, mlp)| (format!("{prefix}.{block}.experts.{e}.{}", names[which]), pick(mlp, which)))
                    .collect()
            }
        }
    }

    /// Adds adapters to the targeted linears of every layer, in f32 whatever the model's
    /// dtype is (cast them with [`CausalLm::set_kind`]): A Kaiming-uniform as PEFT starts
    /// it (bounds ±1/√in, from torch's RNG), B zeros, so the model computes what it did.
    pub fn add_adapters(&mut self, config: &LoraConfig) -> Result<()> {
        if self.world_size() > 1 {
            return Err(Error::InvalidInput("LoRA trains on one rank: tensor_parallel_size must be 1".into()));
        }
        if self.adapters.is_some() {
            return Err(Error::InvalidInput("the model already has adapters".into()));
        }
        if !config.enabled || config.rank < 1 {
            return Err(Error::InvalidInput(format!("LoRA needs enabled: true and a rank ≥ 1, got {config:?}")));
        }
        fused::check_targets(config, &self.config().fused_weights())?;
        let device = self.device();
        let vs = nn::VarStore::new(device);
        let switch = Arc::new(Switch::default());
        let (rank, scale, dropout) = (config.rank, config.scale(), config.dropout);
        for layer in 0..self.layers.len() {
            for target in config.targets() {
                for (module, linear) in self.linears_mut(layer, target) {
                    let (outputs, inputs) = (linear.weight.size()[0], linear.weight.size()[1]);
                    let bound = 1.0 / (inputs as f64).sqrt();
                    let a = Tensor::f_rand([rank, inputs], (Kind::Float, device))?
                        .f_mul_scalar(2.0 * bound)?
                        .f_sub_scalar(bound)?;
                    let path = module.split('.').fold(vs.root(), |path, part| path / part);
                    let a = (&path / "lora_A").add("weight", a, true);
                    let b = (&path / "lora_B").add(
                        "weight",
                        Tensor::f_zeros([outputs, rank], (Kind::Float, device))?,
                        true,
                    );
                    let switch = switch.clone();
                    linear.adapter = Some(Adapter { a, b, scale, dropout, switch });
                }
            }
        }
        self.adapters = Some(Adapters { vs, config: config.clone(), switch });
        Ok(())
    }

    /// The adapters' settings, when the model has adapters.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.adapters.as_ref().map(|a| &a.config)
    }

    /// What an optimiser trains: the adapters where there are some, else every parameter
    /// ([`CausalLm::parameters`]).
    pub fn trainable_parameters(&self) -> Vec<(String, Tensor, crate::model::Layout)> {
        if self.adapters.is_none() {
            return self.parameters();
        }
        self.adapter_tensors().into_iter().map(|(n, t)| (n, t, crate::model::Layout::Replicated)).collect()
    }

    /// The adapters' tensors by name (`<module>.lora_A.weight`, `<module>.lora_B.weight`),
    /// sorted; none without adapters.
    pub fn adapter_tensors(&self) -> Vec<(String, Tensor)> {
        let mut tensors: Vec<(String, Tensor)> =
            self.adapters.as_ref().map(|a| a.vs.variables().into_iter().collect()).unwrap_or_default();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        tensors
    }

    /// Runs `f` on the base model: the adapters add nothing meanwhile (the reference policy
    /// of a LoRA run, with no second copy of the weights).
    pub fn with_base<R>(&self, f: impl FnOnce(&Self) -> R) -> R {
        let Some(adapters) = &self.adapters else { return f(self) };
        let was = adapters.switch.off.swap(true, Ordering::Relaxed);
        let result = f(self);
        adapters.switch.off.store(was, Ordering::Relaxed);
        result
    }

    /// Dropout on the adapters' inputs on (training passes) or off (scoring, generation).
    pub fn set_adapter_training(&self, training: bool) {
        if let Some(adapters) = &self.adapters {
            adapters.switch.training.store(training, Ordering::Relaxed);
        }
    }

    /// Folds the adapters into the weights (`W + s·B·A`, computed in f32) and drops them.
    pub fn merge_adapters(&mut self) -> Result<()> {
        let Some(adapters) = self.adapters.take() else { return Ok(()) };
        let _no_grad = tch::no_grad_guard();
        for layer in 0..self.layers.len() {
            for target in adapters.config.targets() {
                for (_, linear) in self.linears_mut(layer, target) {
                    if let Some(adapter) = linear.adapter.take() {
                        let merged = linear.weight.f_to_kind(Kind::Float)?.f_add(&adapter.delta()?)?;
                        linear.weight.shallow_clone().f_copy_(&merged)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Copies adapter tensors (by [`CausalLm::adapter_tensors`] names, any float dtype) into
    /// the adapters; every one must be there with its shape, or nothing changes.
    pub fn load_adapter_tensors(&self, tensors: &HashMap<String, Tensor>) -> Result<()> {
        let current = self.adapters.as_ref().map(|a| a.vs.variables()).unwrap_or_default();
        crate::pretrained::copy_all(&current, tensors)
    }

    /// Writes the adapters to `dir` in PEFT's layout, their base being the model directory
    /// `base` (written as an absolute path).
    pub fn save_adapters(&self, dir: &Path, base: &Path) -> Result<()> {
        let adapters =
            self.adapters.as_ref().ok_or_else(|| Error::InvalidInput("the model has no adapters to save".into()))?;
        std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
        let fused = self.config().fused_weights();
        let tensors = fused::join(self.adapter_tensors(), &fused)?
            .into_iter()
            .map(|(name, t)| {
                Ok((format!("{PEFT_PREFIX}{name}"), t.f_detach()?.f_to_device(Device::Cpu)?.f_contiguous()?))
            })
            .collect::<Result<Vec<_>>>()?;
        let path = dir.join(ADAPTER_WEIGHTS_FILE);
        Tensor::write_safetensors(&tensors, &path)
            .map_err(|e| Error::Safetensors { path: path.clone(), reason: e.to_string() })?;
        crate::weights::sync_file(&path)?;
        let base = std::path::absolute(base).map_err(Error::io(base))?;
        let config = AdapterConfig::of(&adapters.config, &base, &fused);
        let value = serde_json::to_value(&config).map_err(Error::json(dir.join(ADAPTER_CONFIG_FILE)))?;
        crate::pretrained::write_json(dir, ADAPTER_CONFIG_FILE, &value)
    }
}

/// `adapter_config.json` as PEFT writes and reads it (the keys Keel sets; others PEFT adds
/// are accepted when reading and must keep their plain defaults).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AdapterConfig {
    pub peft_type: String,
    #[serde(default)]
    pub task_type: Option<String>,
    pub base_model_name_or_path: Option<String>,
    pub r: i64,
    pub lora_alpha: f64,
    #[serde(default)]
    pub lora_dropout: f64,
    pub target_modules: TargetModules,
    #[serde(default)]
    pub use_rslora: bool,
    #[serde(default = "no_bias")]
    pub bias: String,
    #[serde(default)]
    pub fan_in_fan_out: bool,
    #[serde(default)]
    pub use_dora: bool,
    #[serde(default)]
    pub modules_to_save: Option<Vec<String>>,
    #[serde(default)]
    pub layers_to_transform: Option<serde_json::Value>,
    #[serde(default)]
    pub rank_pattern: BTreeMap<String, serde_json::Value>,
    #[serde(default)]
    pub alpha_pattern: BTreeMap<String, serde_json::Value>,
    #[serde(default = "yes")]
    pub inference_mode: bool,
    #[serde(default)]
    pub init_lora_weights: serde_json::Value,
}

fn no_bias() -> String {
    "none".into()
}

fn yes() -> bool {
    true
}

/// PEFT's `target_modules`: a list of module names, or a string (`all-linear`, or a regex
/// Keel does not read).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TargetModules {
    List(Vec<String>),
    Text(String),
}

impl AdapterConfig {
    fn of(config: &LoraConfig, base: &Path, fused: &[crate::config::FusedWeight]) -> Self {
        let (targets, rank_pattern, alpha_pattern) = fused::peft_targets(config, fused);
        Self {
            peft_type: "LORA".into(),
            task_type: Some("CAUSAL_LM".into()),
            base_model_name_or_path: Some(base.display().to_string()),
            r: config.rank,
            lora_alpha: config.alpha,
            lora_dropout: config.dropout,
            target_modules: TargetModules::List(targets),
            use_rslora: config.use_rslora,
            bias: no_bias(),
            fan_in_fan_out: false,
            use_dora: false,
            modules_to_save: None,
            layers_to_transform: None,
            rank_pattern,
            alpha_pattern,
            inference_mode: true,
            init_lora_weights: serde_json::Value::Bool(true),
        }
    }

    /// Whether the rank and alpha patterns are none, or the fused modules' that Keel writes.
    fn fused_patterns(&self) -> bool {
        fused::patterns_are_fused(&self.rank_pattern, &self.alpha_pattern, self.r, self.lora_alpha, self.use_rslora)
    }

    /// Keel's settings for these adapters; refuses what Keel cannot apply, naming the key.
    pub fn lora(&self, path: &Path) -> Result<LoraConfig> {
        let unsupported = |field: &str, value: String, reason: &str| Error::Unsupported {
            field: format!("{}: {field}", path.display()),
            value,
            reason: reason.into(),
        };
        if self.peft_type != "LORA" {
            return Err(unsupported("peft_type", self.peft_type.clone(), "only LORA adapters are read"));
        }
        let plain = [
            ("bias", self.bias != "none", self.bias.clone()),
            ("fan_in_fan_out", self.fan_in_fan_out, "true".into()),
            ("use_dora", self.use_dora, "true".into()),
            (
                "modules_to_save",
                self.modules_to_save.as_ref().is_some_and(|m| !m.is_empty()),
                format!("{:?}", self.modules_to_save),
            ),
            (
                "layers_to_transform",
                self.layers_to_transform.as_ref().is_some_and(|v| !v.is_null()),
                format!("{:?}", self.layers_to_transform),
            ),
            ("rank_pattern", !self.fused_patterns(), format!("{:?}", self.rank_pattern)),
            ("alpha_pattern", !self.fused_patterns(), format!("{:?}", self.alpha_pattern)),
        ];
        if let Some((field, _, value)) = plain.into_iter().find(|(_, set, _)| *set) {
            return Err(unsupported(field, value, "Keel reads plain LoRA adapters only"));
        }
        let target_modules = match &self.target_modules {
            TargetModules::Text(t) if t == "all-linear" => Vec::new(),
            TargetModules::Text(t) => {
                return Err(unsupported("target_modules", t.clone(), "name the modules in a list (or `all-linear`)"));
            }
            TargetModules::List(names) => names.clone(),
        };
        let config = LoraConfig {
            enabled: true,
            rank: self.r,
            alpha: self.lora_alpha,
            dropout: self.lora_dropout,
            target_modules,
            use_rslora: self.use_rslora,
        };
        if let Some(problem) = config.problems("lora").first() {
            return Err(unsupported(&problem.field, String::new(), &problem.message));
        }
        Ok(config)
    }
}

/// An adapter directory: its settings, its base model's directory and its tensors (their
/// module names without PEFT's prefix, a fused projection's as PEFT names it; on the CPU).
#[derive(Debug)]
pub struct AdapterDir {
    pub config: LoraConfig,
    pub base: PathBuf,
    pub tensors: HashMap<String, Tensor>,
}

/// Whether `dir` holds adapters rather than a whole model (an `adapter_config.json` and no
/// `config.json`).
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG_FILE).is_file() && !dir.join("config.json").is_file()
}

/// The adapter directory `dir`'s configuration and its base model's directory (a relative
/// base path is taken from `dir`).
fn read_config(dir: &Path) -> Result<(LoraConfig, PathBuf)> {
    let path = dir.join(ADAPTER_CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(Error::io(&path))?;
    let file: AdapterConfig = serde_json::from_str(&text).map_err(Error::json(&path))?;
    let config = file.lora(&path)?;
    let base = file.base_model_name_or_path.as_deref().filter(|b| !b.is_empty()).ok_or_else(|| {
        Error::InvalidInput(format!("{}: base_model_name_or_path names no base model directory", path.display()))
    })?;
    Ok((config, dir.join(base)))
}

/// The base model directory of `dir` when it is an adapter directory (what its
/// `base_model_name_or_path` names, a relative one taken from `dir`), else `None`: a service
/// checks it against its path roots as it checks `dir`.
pub fn adapter_base(dir: &Path) -> Result<Option<PathBuf>> {
    if is_adapter_dir(dir) { Ok(Some(read_config(dir)?.1)) } else { Ok(None) }
}

/// The directory whose `config.json` describes the model `dir` loads as: `dir` itself, or
/// the base model of an adapter directory.
pub fn model_config_dir(dir: &Path) -> Result<PathBuf> {
    if is_adapter_dir(dir) { Ok(read_config(dir)?.1) } else { Ok(dir.to_path_buf()) }
}

impl AdapterDir {
    /// Reads the adapter directory `dir`; a relative base path is taken from `dir`.
    pub fn read(dir: &Path) -> Result<Self> {
        let (config, base) = read_config(dir)?;
        let weights = dir.join(ADAPTER_WEIGHTS_FILE);
        let tensors = Tensor::read_safetensors(&weights)
            .map_err(|e| Error::Safetensors { path: weights.clone(), reason: e.to_string() })?
            .into_iter()
            .map(|(name, t)| match name.strip_prefix(PEFT_PREFIX) {
                Some(short) => Ok((short.to_string(), t)),
                None => Err(Error::Weights(vec![WeightProblem::Unexpected { name }])),
            })
            .collect::<Result<HashMap<_, _>>>()?;
        Ok(Self { config, base, tensors })
    }

    /// The base model with these adapters added (unmerged; dropout off).
    pub fn load(&self, device: Device, kind: Kind) -> Result<CausalLm> {
        let mut model = CausalLm::load(&self.base, device, Kind::Float)?;
        model.add_adapters(&self.config)?;
        let fused = model.config().fused_weights();
        model.load_adapter_tensors(&fused::split(&self.tensors, &fused, self.config.rank)?)?;
        model.set_kind(kind)?;
        Ok(model)
    }
}

/// Checks refit adapters against the base weights a generator keeps: every
/// `<module>.lora_A.weight` has its `lora_B` of the same rank and its base weight, and no other
/// name is there. All problems are listed at once.
pub fn check_adapters(base: &HashMap<String, Tensor>, adapters: &HashMap<String, Tensor>) -> Result<()> {
    let mut problems = Vec::new();
    for (name, tensor) in adapters {
        let (module, pair) = match (name.strip_suffix(".lora_A.weight"), name.strip_suffix(".lora_B.weight")) {
            (Some(module), _) => (module, format!("{module}.lora_B.weight")),
            (_, Some(module)) => (module, format!("{module}.lora_A.weight")),
            _ => {
                problems.push(WeightProblem::Unexpected { name: name.clone() });
                continue;
            }
        };
        match adapters.get(&pair) {
            None => problems.push(WeightProblem::Missing { name: pair }),
            Some(other) if name.ends_with(".lora_A.weight") && other.size().get(1) != tensor.size().first() => problems
                .push(WeightProblem::Shape {
                    name: pair,
                    expected: vec![other.size()[0], tensor.size()[0]],
                    found: other.size(),
                }),
            Some(_) => {}
        }
        if name.ends_with(".lora_A.weight") && !base.contains_key(&format!("{module}.weight")) {
            problems.push(WeightProblem::Unexpected { name: name.clone() });
        }
    }
    if problems.is_empty() { Ok(()) } else { Err(Error::Weights(problems)) }
}

/// For a generator refitting from adapters: the weights `base + cut(s·B·A)` of every
/// targeted linear, by HF weight name, in f32 on the device of `base`; `base` holds the
/// targeted weights ([`targeted_weights`]), whole or (under tensor parallelism) a rank's
/// slices, which `cut(name, delta)` cuts the whole delta to.
pub fn merged_weights(
    base: &HashMap<String, Tensor>,
    adapters: &HashMap<String, Tensor>,
    scale: f64,
    cut: impl Fn(&str, Tensor) -> Result<Tensor>,
) -> Result<HashMap<String, Tensor>> {
    check_adapters(base, adapters)?;
    let _no_grad = tch::no_grad_guard();
    let mut merged = HashMap::new();
    for (name, a) in adapters {
        let Some(module) = name.strip_suffix(".lora_A.weight") else { continue };
        let weight = format!("{module}.weight");
        let (w, b) = (&base[&weight], &adapters[&format!("{module}.lora_B.weight")]);
        let device = w.device();
        let d = cut(&weight, delta(&a.f_to_device(device)?, &b.f_to_device(device)?, scale)?)?;
        if d.size() != w.size() {
            return Err(Error::Weights(vec![WeightProblem::Shape {
                name: weight,
                expected: w.size(),
                found: d.size(),
            }]));
        }
        merged.insert(weight, w.f_to_kind(Kind::Float)?.f_add(&d)?);
    }
    Ok(merged)
}

/// The base weights of the linears `adapters` target (copies on `device`), by HF weight name:
/// what a generator keeps to merge each new version of the adapters into.
pub fn targeted_weights(
    params: &HashMap<String, Tensor>,
    adapters: &HashMap<String, Tensor>,
    device: Device,
) -> Result<HashMap<String, Tensor>> {
    adapters
        .keys()
        .filter_map(|name| name.strip_suffix(".lora_A.weight"))
        .map(|module| {
            let weight = format!("{module}.weight");
            match params.get(&weight) {
                Some(w) => Ok((weight, w.f_detach()?.f_to_device(device)?.copy())),
                None => {
                    Err(Error::Weights(vec![WeightProblem::Unexpected { name: format!("{module}.lora_A.weight") }]))
                }
            }
        })
        .collect()
}

/// Writes the model an adapter directory (or a whole model directory) stands for as a plain
/// Hugging Face model directory at `out`: the base (`base`, else the one its
/// `adapter_config.json` names) with the adapters merged, saved in the base's dtype, with the
/// tokenizer files of `dir`. `out` appears only when complete and is never overwritten.
pub fn export_merged(dir: &Path, base: Option<&Path>, out: &Path) -> Result<()> {
    if out.exists() {
        return Err(Error::InvalidInput(format!("{} already exists", out.display())));
    }
    let (model, base) = if is_adapter_dir(dir) {
        let mut adapters = AdapterDir::read(dir)?;
        if let Some(base) = base {
            adapters.base = base.to_path_buf();
        }
        let mut model = adapters.load(Device::Cpu, Kind::Float)?;
        model.merge_adapters()?;
        (model, adapters.base)
    } else {
        (CausalLm::load(dir, Device::Cpu, Kind::Float)?, dir.to_path_buf())
    };
    let mut model = model;
    // The base's dtype (f32 when it does not say, or is itself an adapter directory).
    let dtype = crate::config::ModelConfig::load(&base)
        .ok()
        .and_then(|c| c.dtype)
        .map_or(Ok(Kind::Float), |name| crate::device::parse_kind(&name))?;
    model.set_kind(dtype)?;
    let name = out.file_name().and_then(|n| n.to_str()).unwrap_or("merged");
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let partial = parent.join(format!(".{name}.partial"));
    let _ = std::fs::remove_dir_all(&partial);
    let written = model
        .save(&partial, crate::SaveOptions::default())
        .and_then(|()| crate::pretrained::copy_side_files(dir, &partial))
        .and_then(|()| std::fs::rename(&partial, out).map_err(Error::io(out)));
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&partial);
    }
    written
}
