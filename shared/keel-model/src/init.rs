//! `keel model init`: a complete HF model directory from nothing — a byte-level BPE tokenizer
//! trained on the given text (digits split one per token) with the special tokens of the
//! family's chat format, its chat template ([`crate::chat_format`]), a config for the chosen
//! architecture and size, and randomly initialised weights.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use tch::{Device, Kind};
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::models::{ModelWrapper, TrainerWrapper};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper, TokenizerImpl,
};

use crate::chat_format::ChatFormat;
use crate::config::{Architecture, ModelConfig};
use crate::error::{Error, Result};
use crate::model::{CausalLm, Init};
use crate::pretrained::write_json;
use crate::tokenizer::{GENERATION_CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE};
use crate::weights::SaveOptions;

pub const END_OF_TEXT: &str = "<|endoftext|>";
pub const IM_START: &str = "<|im_start|>";
pub const IM_END: &str = "<|im_end|>";

/// ChatML, the format of the models `keel model init` makes for Llama, Qwen, Mistral and the
/// mixtures of experts ([`ChatFormat`] gives every family's).
pub const CHAT_TEMPLATE: &str = crate::chat_format::CHATML;

/// Model sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// 2 layers, hidden 64: for tests.
    Tiny,
    /// 4 layers, hidden 256: for the demo.
    Small,
    /// 6 layers, hidden 384, small's tokenizer: a larger model of the same family (a teacher
    /// for a small student).
    Medium,
}

impl std::str::FromStr for Preset {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "tiny" => Ok(Self::Tiny),
            "small" => Ok(Self::Small),
            "medium" => Ok(Self::Medium),
            other => Err(Error::InvalidInput(format!("unknown preset `{other}` (use tiny, small or medium)"))),
        }
    }
}

struct Dims {
    hidden: i64,
    intermediate: i64,
    layers: i64,
    heads: i64,
    kv_heads: i64,
    vocab_target: usize,
    max_positions: i64,
}

impl Preset {
    fn dims(self) -> Dims {
        match self {
            Self::Tiny => Dims {
                hidden: 64,
                intermediate: 192,
                layers: 2,
                heads: 4,
                kv_heads: 2,
                vocab_target: 512,
                max_positions: 1024,
            },
            Self::Small => Dims {
                hidden: 256,
                intermediate: 768,
                layers: 4,
                heads: 8,
                kv_heads: 4,
                vocab_target: 2048,
                max_positions: 2048,
            },
            Self::Medium => Dims {
                hidden: 384,
                intermediate: 1152,
                layers: 6,
                heads: 8,
                kv_heads: 4,
                vocab_target: 2048,
                max_positions: 2048,
            },
        }
    }
}

#[derive(Debug, Clone)]
pub struct InitSpec {
    pub architecture: Architecture,
    pub preset: Preset,
    pub tokenizer_corpus: Vec<PathBuf>,
    pub out: PathBuf,
    pub seed: i64,
}

/// Trains a byte-level BPE tokenizer on the corpus files, with `special` as single tokens.
pub fn train_tokenizer(files: &[PathBuf], vocab_size: usize, special: &[&str]) -> Result<tokenizers::Tokenizer> {
    for file in files {
        if !file.is_file() {
            return Err(Error::InvalidInput(format!("tokenizer corpus {} does not exist", file.display())));
        }
    }
    if files.is_empty() {
        return Err(Error::InvalidInput("at least one tokenizer corpus file is needed".into()));
    }
    let tokenizer_error = |e: tokenizers::Error| Error::Tokenizer(e.to_string());
    let special: Vec<AddedToken> = special.iter().map(|t| AddedToken::from(*t, true)).collect();
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(special)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect::<HashSet<char>>())
        .build()
        .into();
    let pre_tokenizer = Sequence::new(vec![Digits::new(true).into(), ByteLevel::new(false, false, true).into()]);
    let mut tokenizer: TokenizerImpl<
        ModelWrapper,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    > = TokenizerImpl::new(BPE::default().into());
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
    tokenizer.with_post_processor(Some(ByteLevel::new(false, false, true)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    let files = files.iter().map(|f| f.to_string_lossy().into_owned()).collect();
    tokenizer.train_from_files(&mut trainer, files).map_err(tokenizer_error)?;
    Ok(tokenizers::Tokenizer::from(tokenizer))
}

fn config_json(arch: Architecture, dims: &Dims, vocab_size: i64, ids: &Ids) -> Value {
    let mut config = json!({
        "architectures": [arch.hf_class()],
        "model_type": arch.model_type(),
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.hidden / dims.heads,
        "hidden_act": "silu",
        "max_position_embeddings": dims.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": null,
        "tie_word_embeddings": true,
        "vocab_size": vocab_size,
        "bos_token_id": ids.bos.unwrap_or(ids.pad),
        "eos_token_id": ids.eos[0],
        "pad_token_id": ids.pad,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": true,
        "torch_dtype": "float32",
    });
    let head_dim = dims.hidden / dims.heads;
    // A window an eighth of the context, so that windowed layers matter at lengths the demo uses.
    let window = dims.max_positions / 8;
    let layer_types = |full: &dyn Fn(i64) -> bool| -> Value {
        (0..dims.layers).map(|i| if full(i) { "full_attention" } else { "sliding_attention" }).collect()
    };
    let extra = match arch {
        Architecture::Llama => json!({"attention_bias": false, "mlp_bias": false, "pretraining_tp": 1}),
        Architecture::Qwen2 | Architecture::Qwen3 => {
            json!({"attention_bias": false, "use_sliding_window": false, "sliding_window": null, "max_window_layers": dims.layers})
        }
        Architecture::Mistral => json!({"sliding_window": null}),
        // 8 experts of a quarter of the dense MLP's width, 2 per token: about the dense
        // model's compute per token.
        Architecture::Qwen3Moe => json!({
            "attention_bias": false, "use_sliding_window": false, "sliding_window": null,
            "max_window_layers": dims.layers, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": dims.intermediate / 4, "norm_topk_prob": true,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": true,
            "router_aux_loss_coef": 0.001,
        }),
        Architecture::Mixtral => json!({
            "sliding_window": null, "num_local_experts": 8, "num_experts_per_tok": 2,
            "intermediate_size": dims.intermediate / 4, "output_router_logits": true,
            "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
        }),
        // Gemma 2: windowed and full layers alternate; both soft-caps at Gemma 2's values.
        Architecture::Gemma2 => json!({
            "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": head_dim,
            "sliding_window": window, "layer_types": layer_types(&|i| i % 2 == 1),
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "attention_bias": false,
        }),
        // Gemma 3: five windowed layers to a full one (the last layer full at every size here),
        // local layers at their own rotary base.
        Architecture::Gemma3 => json!({
            "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": head_dim,
            "sliding_window": window, "layer_types": layer_types(&|i| (i + 1) % 6 == 0 || i == dims.layers - 1),
            "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "attention_bias": false,
            "attn_logit_softcapping": null, "final_logit_softcapping": null,
        }),
        // Phi-4-mini's layout: three quarters of each head rotate.
        Architecture::Phi3 => json!({
            "partial_rotary_factor": 0.75, "original_max_position_embeddings": dims.max_positions,
            "sliding_window": null,
        }),
        Architecture::Olmo2 => json!({"attention_bias": false}),
        // Three windowed layers to a full one (the last layer full at every size here), with
        // per-layer-type rotary parameters (the layout transformers 5 writes for OLMo 3).
        Architecture::Olmo3 => json!({
            "attention_bias": false, "sliding_window": window,
            "layer_types": layer_types(&|i| (i + 1) % 4 == 0 || i == dims.layers - 1),
            "rope_theta": null, "rope_scaling": null,
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 500_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 500_000.0}},
        }),
        Architecture::Glm4 => json!({"partial_rotary_factor": 0.5, "attention_bias": true}),
        // Granite 3.3's multipliers.
        Architecture::Granite => json!({
            "attention_bias": false, "mlp_bias": false, "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22, "attention_multiplier": 1.0 / head_dim as f64, "logits_scaling": 8.0,
        }),
        // SmolLM3: every fourth layer without a rotary embedding (every second in the
        // two-layer `tiny`, so that it has one).
        Architecture::SmolLm3 => {
            let interval = 4.min(dims.layers);
            json!({
                "attention_bias": false, "mlp_bias": false, "use_sliding_window": false, "sliding_window": null,
                "no_rope_layer_interval": interval,
                "no_rope_layers": (0..dims.layers).map(|i| i64::from((i + 1) % interval != 0)).collect::<Vec<_>>(),
            })
        }
    };
    if let (Value::Object(config), Value::Object(extra)) = (&mut config, extra) {
        config.extend(extra);
    }
    config
}

/// Writes a new model directory. Refuses to write into a non-empty directory.
pub fn init_model(spec: &InitSpec) -> Result<()> {
    let out = &spec.out;
    if out.exists() && std::fs::read_dir(out).map_err(Error::io(out))?.next().is_some() {
        return Err(Error::InvalidInput(format!("output directory {} exists and is not empty", out.display())));
    }
    let dims = spec.preset.dims();
    let format = ChatFormat::of(spec.architecture);
    let tokenizer = train_tokenizer(&spec.tokenizer_corpus, dims.vocab_target, format.special)?;
    let id = |token: &str| -> Result<i64> {
        tokenizer
            .token_to_id(token)
            .map(i64::from)
            .ok_or_else(|| Error::Tokenizer(format!("trained tokenizer lacks {token}")))
    };
    let ids = Ids {
        bos: format.bos.map(id).transpose()?,
        eos: std::iter::once(format.end_of_turn)
            .chain(format.also_end.iter().copied())
            .map(id)
            .collect::<Result<_>>()?,
        pad: id(format.pad)?,
    };
    let vocab_size = tokenizer.get_vocab_size(true) as i64;
    let config = ModelConfig::from_json(config_json(spec.architecture, &dims, vocab_size, &ids))?;

    tch::manual_seed(spec.seed);
    let model = CausalLm::new(config, Device::Cpu, Kind::Float, Init::Random { std: 0.02 })?;
    std::fs::create_dir_all(out).map_err(Error::io(out))?;
    model.save(out, SaveOptions::default())?;
    save_tokenizer_files(out, &tokenizer, dims.max_positions, &format, &ids)
}

/// The ids of a new model's special tokens.
struct Ids {
    bos: Option<i64>,
    /// The end of a turn first.
    eos: Vec<i64>,
    pad: i64,
}

fn save_tokenizer_files(
    out: &Path,
    tokenizer: &tokenizers::Tokenizer,
    max_length: i64,
    format: &ChatFormat,
    ids: &Ids,
) -> Result<()> {
    let path = out.join(TOKENIZER_FILE);
    tokenizer.save(&path, false).map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
    write_json(
        out,
        TOKENIZER_CONFIG_FILE,
        &json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": format.bos,
            "eos_token": format.end_of_turn,
            "pad_token": format.pad,
            "unk_token": null,
            "model_max_length": max_length,
            "clean_up_tokenization_spaces": false,
            "chat_template": format.template,
        }),
    )?;
    write_json(
        out,
        GENERATION_CONFIG_FILE,
        &json!({"bos_token_id": ids.bos.unwrap_or(ids.pad), "eos_token_id": ids.eos, "pad_token_id": ids.pad}),
    )
}
