//! Tensor parallelism, Megatron style: one [`TpCausalLm`] per rank of a
//! [`keel_collective::Collective`], holding that rank's slices of the parameters.
//!
//! - q/k/v and gate/up are column-parallel (each rank computes its heads and its share of
//!   the intermediate size); o and down are row-parallel, their partial outputs summed with
//!   an all-reduce (biases added once, after it).
//! - Attention heads are split across ranks. KV heads are split too when there are at least
//!   as many as ranks; with fewer (GQA), each rank keeps the one KV head its query heads read
//!   (replication).
//! - The embedding and the LM head are vocab-parallel: a rank embeds only the ids in its
//!   vocabulary range (an all-reduce adds the rows up) and computes only its vocabulary's
//!   logits. Token logprobs use a vocab-parallel log-softmax (all-reduced max, sum of
//!   exponentials and target logit), so the full logits are never gathered.
//!
//! This first form serves inference and scoring (no gradients). Ranks must call the same
//! methods with the same inputs, in the same order.

use keel_collective::{Collective, ReduceOp};
use tch::{Device, Kind, Tensor};

use super::{
    Attention, CausalLm, Linear, Mask, Mlp, Positions, RmsNorm, check_temperature, chunked_token_logprobs, masks_for,
    padded_ids,
};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::rope::Rotary;
use crate::weights::SliceReader;

/// The half-open range of `total` items that `rank` of `world` holds (as even as possible).
fn share(total: i64, rank: usize, world: usize) -> (i64, i64) {
    let (rank, world) = (rank as i64, world as i64);
    (total * rank / world, total * (rank + 1) / world)
}

/// Where a rank's parameters come from, by Hugging Face name: the whole tensor, or rows /
/// columns `start..end` of a tensor whose full shape is `shape`.
trait Source {
    fn slice(&self, name: &str, shape: &[i64], dim: usize, start: i64, end: i64) -> Result<Tensor>;

    fn whole(&self, name: &str, shape: &[i64]) -> Result<Tensor> {
        self.slice(name, shape, 0, 0, shape[0])
    }
}

/// Slices copied out of a model in memory.
struct FromModel(std::collections::HashMap<String, Tensor>);

impl Source for SliceReader {
    fn slice(&self, name: &str, shape: &[i64], dim: usize, start: i64, end: i64) -> Result<Tensor> {
        self.read(name, shape, dim, start, end)
    }
}

impl Source for FromModel {
    fn slice(&self, name: &str, shape: &[i64], dim: usize, start: i64, end: i64) -> Result<Tensor> {
        let tensor = self.0.get(name).ok_or_else(|| Error::InvalidInput(format!("the model has no `{name}`")))?;
        check_shape(name, shape, &tensor.size())?;
        Ok(tensor.f_narrow(dim as i64, start, end - start)?.detach().copy())
    }
}

fn check_shape(name: &str, expected: &[i64], found: &[i64]) -> Result<()> {
    if expected == found {
        return Ok(());
    }
    let problem =
        crate::error::WeightProblem::Shape { name: name.into(), expected: expected.to_vec(), found: found.to_vec() };
    Err(Error::Weights(vec![problem]))
}

#[derive(Debug)]
struct TpLayer {
    input_layernorm: RmsNorm,
    attention: Attention,
    o_bias: Option<Tensor>,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
    down_bias: Option<Tensor>,
    window: Option<i64>,
}

/// One rank's share of a [`CausalLm`].
#[derive(Debug)]
pub struct TpCausalLm<C: Collective> {
    cfg: ModelConfig,
    comm: C,
    /// Whether each rank holds a copy of one KV head (fewer KV heads than ranks).
    kv_replicated: bool,
    embed_tokens: Tensor,
    /// This rank's vocabulary range.
    vocab: (i64, i64),
    layers: Vec<TpLayer>,
    norm: RmsNorm,
    lm_head: Tensor,
    rotary: Rotary,
    kind: Kind,
    device: Device,
}

impl<C: Collective> TpCausalLm<C> {
    /// The slices of `full` that rank `comm.rank()` of `comm.world_size()` holds (copied, so
    /// `full` may be dropped). Fails when the heads or the intermediate size do not divide.
    pub fn shard(full: &CausalLm, comm: C) -> Result<Self> {
        let source = FromModel(full.var_store().variables());
        Self::build(full.cfg.clone(), comm, full.device(), full.kind, &source)
    }

    /// Loads this rank's slices from a Hugging Face model directory, reading only the bytes
    /// of its slices from the (memory-mapped) safetensors files.
    pub fn load(dir: &std::path::Path, comm: C, device: Device, kind: Kind) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::MissingDirectory(dir.to_path_buf()));
        }
        let cfg = ModelConfig::load(dir)?;
        let files = SliceReader::open(dir)?;
        Self::build(cfg, comm, device, kind, &files)
    }

    fn build(cfg: ModelConfig, comm: C, device: Device, kind: Kind, source: &dyn Source) -> Result<Self> {
        if !matches!(kind, Kind::Float | Kind::BFloat16 | Kind::Half) {
            return Err(Error::InvalidInput(format!("parameter dtype {kind:?} is not supported (f32, bf16, f16)")));
        }
        let (rank, world) = (comm.rank(), comm.world_size());
        let w = world as i64;
        let (heads, kv_heads, d) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let (hidden, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let problem = |field: &str, value: i64, reason: String| Error::Unsupported {
            field: field.into(),
            value: value.to_string(),
            reason,
        };
        if heads % w != 0 {
            return Err(problem("num_attention_heads", heads, format!("does not split across {world} ranks")));
        }
        if kv_heads % w != 0 && w % kv_heads != 0 {
            let reason = format!("neither splits across nor replicates over {world} ranks");
            return Err(problem("num_key_value_heads", kv_heads, reason));
        }
        if cfg.vocab_size < w {
            return Err(problem("vocab_size", cfg.vocab_size, format!("is smaller than {world} ranks")));
        }
        if inter % w != 0 {
            return Err(problem("intermediate_size", inter, format!("does not split across {world} ranks")));
        }
        let (q_start, q_end) = share(heads, rank, world);
        // KV heads: split when there are enough, else the one this rank's query heads read.
        let (kv_start, kv_end) = if kv_heads % w == 0 {
            share(kv_heads, rank, world)
        } else {
            let kv = q_start / (heads / kv_heads);
            (kv, kv + 1)
        };
        let (i_start, i_end) = share(inter, rank, world);
        let to = |t: Tensor| -> Result<Tensor> { Ok(t.f_to_kind(kind)?.f_to_device(device)?) };
        let norm = |name: String, size: i64| -> Result<RmsNorm> {
            Ok(RmsNorm { weight: to(source.whole(&name, &[size])?)?, eps: cfg.rms_norm_eps })
        };
        // Output rows start..end of `name` ([outputs, inputs]), with its bias when it has one.
        let column = |name: String, outputs: i64, inputs: i64, start: i64, end: i64, bias: bool| -> Result<Linear> {
            let weight = to(source.slice(&format!("{name}.weight"), &[outputs, inputs], 0, start, end)?)?;
            let bias = bias.then(|| source.slice(&format!("{name}.bias"), &[outputs], 0, start, end).and_then(to));
            Ok(Linear { weight, bias: bias.transpose()? })
        };
        // Input columns start..end of `name`; its bias comes back apart (added after the all-reduce).
        let row = |name: String, outputs: i64, inputs: i64, start: i64, end: i64, bias: bool| {
            let weight = to(source.slice(&format!("{name}.weight"), &[outputs, inputs], 1, start, end)?)?;
            let bias = bias.then(|| source.whole(&format!("{name}.bias"), &[outputs]).and_then(to)).transpose()?;
            Ok::<_, Error>((Linear { weight, bias: None }, bias))
        };
        let layers = (0..cfg.num_hidden_layers as usize)
            .map(|i| {
                let p = |name: &str| format!("model.layers.{i}.{name}");
                let (o_proj, o_bias) =
                    row(p("self_attn.o_proj"), hidden, heads * d, q_start * d, q_end * d, cfg.o_bias)?;
                let qk_norm = |name: &str| cfg.qk_norm.then(|| norm(p(name), d)).transpose();
                let attention = Attention {
                    q_proj: column(p("self_attn.q_proj"), heads * d, hidden, q_start * d, q_end * d, cfg.qkv_bias)?,
                    k_proj: column(
                        p("self_attn.k_proj"),
                        kv_heads * d,
                        hidden,
                        kv_start * d,
                        kv_end * d,
                        cfg.qkv_bias,
                    )?,
                    v_proj: column(
                        p("self_attn.v_proj"),
                        kv_heads * d,
                        hidden,
                        kv_start * d,
                        kv_end * d,
                        cfg.qkv_bias,
                    )?,
                    o_proj,
                    q_norm: qk_norm("self_attn.q_norm.weight")?,
                    k_norm: qk_norm("self_attn.k_norm.weight")?,
                    heads: heads / w,
                    kv_heads: kv_end - kv_start,
                    head_dim: d,
                };
                let (down_proj, down_bias) = row(p("mlp.down_proj"), hidden, inter, i_start, i_end, cfg.mlp_bias)?;
                let mlp = Mlp {
                    gate_proj: column(p("mlp.gate_proj"), inter, hidden, i_start, i_end, cfg.mlp_bias)?,
                    up_proj: column(p("mlp.up_proj"), inter, hidden, i_start, i_end, cfg.mlp_bias)?,
                    down_proj,
                };
                Ok(TpLayer {
                    input_layernorm: norm(p("input_layernorm.weight"), hidden)?,
                    attention,
                    o_bias,
                    post_attention_layernorm: norm(p("post_attention_layernorm.weight"), hidden)?,
                    mlp,
                    down_bias,
                    window: cfg.sliding_windows[i],
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let vocab = share(cfg.vocab_size, rank, world);
        let embedding = [cfg.vocab_size, hidden];
        let embed_tokens = to(source.slice("model.embed_tokens.weight", &embedding, 0, vocab.0, vocab.1)?)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens.shallow_clone()
        } else {
            to(source.slice("lm_head.weight", &embedding, 0, vocab.0, vocab.1)?)?
        };
        Ok(Self {
            kv_replicated: kv_heads % w != 0,
            embed_tokens,
            lm_head,
            vocab,
            layers,
            norm: norm("model.norm.weight".into(), hidden)?,
            rotary: Rotary::new(&cfg.rope, cfg.head_dim, device)?,
            kind,
            device,
            cfg,
            comm,
        })
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn all_reduce(&self, mut x: Tensor, op: ReduceOp) -> Result<Tensor> {
        self.comm.all_reduce(&mut x, op).map_err(|e| Error::InvalidInput(format!("tensor parallel: {e}")))?;
        Ok(x)
    }

    /// The vocab-parallel embedding: this rank's rows for ids in its range, zeros elsewhere,
    /// summed over the ranks.
    fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let (start, end) = self.vocab;
        let outside = ids.f_lt(start)?.f_logical_or(&ids.f_ge(end)?)?;
        let local = ids.f_sub_scalar(start)?.f_masked_fill(&outside, 0)?;
        let rows = Tensor::f_embedding(&self.embed_tokens, &local, -1, false, false)?;
        let rows = rows.f_masked_fill(&outside.f_unsqueeze(-1)?, 0.0)?;
        self.all_reduce(rows, ReduceOp::Sum)
    }

    /// Final hidden states [B, S, hidden] (replicated on every rank) of fresh sequences.
    fn hidden_states(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, s) = (ids.size()[0], ids.size()[1]);
        let device = self.device;
        let positions = Tensor::f_arange(s, (Kind::Int64, device))?.f_unsqueeze(0)?.f_expand([b, s], false)?;
        let (cos, sin) = self.rotary.cos_sin(&positions, self.kind)?;
        let windows: Vec<Option<i64>> = self.layers.iter().map(|l| l.window).collect();
        let masks = masks_for(&windows, s, &vec![0; b as usize], s, device)?;
        let mut x = self.embed(ids)?;
        for layer in &self.layers {
            let mask: &Mask =
                masks.iter().find(|(w, _)| *w == layer.window).map(|(_, m)| m).expect("a mask for every window");
            let at = Positions { cos: &cos, sin: &sin, mask };
            let attn = layer.attention.forward(&layer.input_layernorm.forward(&x)?, &at, None)?;
            let attn = add_bias(self.all_reduce(attn, ReduceOp::Sum)?, layer.o_bias.as_ref())?;
            let h = x.f_add(&attn)?;
            let mlp = layer.mlp.forward(&layer.post_attention_layernorm.forward(&h)?)?;
            let mlp = add_bias(self.all_reduce(mlp, ReduceOp::Sum)?, layer.down_bias.as_ref())?;
            x = h.f_add(&mlp)?;
        }
        self.norm.forward(&x)
    }

    /// Token logprobs [B, S] (f32) of right-padded sequences, as
    /// [`CausalLm::token_logprobs`] computes them, on every rank. No gradients.
    pub fn token_logprobs(&self, input_ids: &Tensor, lengths: &[i64], temperature: f64) -> Result<Tensor> {
        check_temperature(temperature)?;
        let _no_grad = tch::no_grad_guard();
        let (ids, invalid) = padded_ids(self.cfg.vocab_size, self.device, input_ids, lengths)?;
        let hidden = self.hidden_states(&ids)?;
        // The same chunk length on every rank (each must make the same collective calls):
        // from the largest vocabulary share, not this rank's.
        let world = self.world_size() as i64;
        let share = (self.cfg.vocab_size + world - 1) / world;
        let logprobs = |logits: &Tensor, targets: &Tensor| self.vocab_parallel_logprobs(logits, targets);
        chunked_token_logprobs(&hidden, &ids, &invalid, &self.lm_head, share, temperature, logprobs)
    }

    /// log softmax(logits)[target] over the whole vocabulary from this rank's `logits`
    /// [B, L, local vocab] and the `targets` [B, L]: the maximum, the sum of exponentials
    /// and the target's logit are all-reduced, never the logits themselves.
    fn vocab_parallel_logprobs(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let (start, end) = self.vocab;
        let local_max = logits.f_amax(&[-1][..], false)?;
        let max = self.all_reduce(local_max, ReduceOp::Max)?;
        let shifted = logits.f_sub(&max.f_unsqueeze(-1)?)?;
        let sum_exp =
            self.all_reduce(shifted.f_exp()?.f_sum_dim_intlist(&[-1][..], false, Kind::Float)?, ReduceOp::Sum)?;
        let outside = targets.f_lt(start)?.f_logical_or(&targets.f_ge(end)?)?;
        let local = targets.f_sub_scalar(start)?.f_masked_fill(&outside, 0)?;
        let picked = shifted.f_gather(-1, &local.f_unsqueeze(-1)?, false)?.f_squeeze_dim(-1)?;
        let picked = self.all_reduce(picked.f_masked_fill(&outside, 0.0)?, ReduceOp::Sum)?;
        Ok(picked.f_sub(&sum_exp.f_log()?)?)
    }
}

impl<C: Collective> TpCausalLm<C> {
    fn gather(&self, tensor: &Tensor, dim: i64) -> Result<Tensor> {
        self.comm.all_gather(tensor, dim).map_err(|e| Error::InvalidInput(format!("tensor parallel: {e}")))
    }

    /// KV projection rows gathered from every rank: when KV heads are replicated, the copy
    /// of the first rank holding each head.
    fn gather_kv(&self, rows: &Tensor) -> Result<Tensor> {
        let gathered = self.gather(rows, 0)?;
        if !self.kv_replicated {
            return Ok(gathered);
        }
        let per_head = self.world_size() as i64 / self.cfg.num_key_value_heads;
        let chunk = rows.size()[0];
        let firsts: Vec<Tensor> = (0..self.cfg.num_key_value_heads)
            .map(|k| gathered.f_narrow(0, k * per_head * chunk, chunk))
            .collect::<std::result::Result<_, _>>()?;
        Ok(Tensor::f_cat(&firsts, 0)?)
    }

    /// The whole model, gathered from every rank's slices (every rank must call it; every
    /// rank gets the same model). Saving a tensor-parallel model goes through this, so its
    /// checkpoint is the Hugging Face layout a TP = 1 model (or transformers) loads.
    pub fn gather_full(&self) -> Result<CausalLm> {
        let _no_grad = tch::no_grad_guard();
        let mut params: Vec<(String, Tensor)> = Vec::new();
        params.push(("model.embed_tokens.weight".into(), self.gather(&self.embed_tokens, 0)?));
        if !self.cfg.tie_word_embeddings {
            params.push(("lm_head.weight".into(), self.gather(&self.lm_head, 0)?));
        }
        params.push(("model.norm.weight".into(), self.norm.weight.shallow_clone()));
        for (i, layer) in self.layers.iter().enumerate() {
            let p = |name: &str| format!("model.layers.{i}.{name}");
            let a = &layer.attention;
            params.push((p("input_layernorm.weight"), layer.input_layernorm.weight.shallow_clone()));
            params.push((p("post_attention_layernorm.weight"), layer.post_attention_layernorm.weight.shallow_clone()));
            params.push((p("self_attn.q_proj.weight"), self.gather(&a.q_proj.weight, 0)?));
            params.push((p("self_attn.k_proj.weight"), self.gather_kv(&a.k_proj.weight)?));
            params.push((p("self_attn.v_proj.weight"), self.gather_kv(&a.v_proj.weight)?));
            params.push((p("self_attn.o_proj.weight"), self.gather(&a.o_proj.weight, 1)?));
            if let (Some(q), Some(k), Some(v)) = (&a.q_proj.bias, &a.k_proj.bias, &a.v_proj.bias) {
                params.push((p("self_attn.q_proj.bias"), self.gather(q, 0)?));
                params.push((p("self_attn.k_proj.bias"), self.gather_kv(k)?));
                params.push((p("self_attn.v_proj.bias"), self.gather_kv(v)?));
            }
            if let Some(bias) = &layer.o_bias {
                params.push((p("self_attn.o_proj.bias"), bias.shallow_clone()));
            }
            if let (Some(q), Some(k)) = (&a.q_norm, &a.k_norm) {
                params.push((p("self_attn.q_norm.weight"), q.weight.shallow_clone()));
                params.push((p("self_attn.k_norm.weight"), k.weight.shallow_clone()));
            }
            let m = &layer.mlp;
            params.push((p("mlp.gate_proj.weight"), self.gather(&m.gate_proj.weight, 0)?));
            params.push((p("mlp.up_proj.weight"), self.gather(&m.up_proj.weight, 0)?));
            params.push((p("mlp.down_proj.weight"), self.gather(&m.down_proj.weight, 1)?));
            if let (Some(gate), Some(up)) = (&m.gate_proj.bias, &m.up_proj.bias) {
                params.push((p("mlp.gate_proj.bias"), self.gather(gate, 0)?));
                params.push((p("mlp.up_proj.bias"), self.gather(up, 0)?));
            }
            if let Some(bias) = &layer.down_bias {
                params.push((p("mlp.down_proj.bias"), bias.shallow_clone()));
            }
        }
        let full = CausalLm::new(self.cfg.clone(), self.device, self.kind, crate::Init::Zeros)?;
        let mut variables = full.var_store().variables();
        if variables.len() != params.len() {
            return Err(Error::InvalidInput(format!(
                "tensor parallel: gathered {} tensors for a model of {}",
                params.len(),
                variables.len()
            )));
        }
        for (name, value) in params {
            let target = variables
                .get_mut(&name)
                .ok_or_else(|| Error::InvalidInput(format!("tensor parallel: no parameter `{name}` to gather into")))?;
            target.f_copy_(&value)?;
        }
        Ok(full)
    }
}

fn add_bias(x: Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    Ok(match bias {
        Some(bias) => x.f_add(bias)?,
        None => x,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Init;
    use keel_collective::cpu::CpuGroup;
    use serde_json::json;

    fn config(arch: &str, heads: i64, kv_heads: i64, extra: serde_json::Value) -> ModelConfig {
        let mut value = json!({
            "architectures": [arch], "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "vocab_size": 101, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
        });
        if let (Some(value), Some(extra)) = (value.as_object_mut(), extra.as_object()) {
            value.extend(extra.clone());
        }
        ModelConfig::from_json(value).expect("a valid config")
    }

    /// Random biases and norm weights too (the initialisation makes them 0 and 1), so a bias
    /// added twice or not at all shows.
    fn randomize_biases_and_norms(full: &CausalLm) {
        let _no_grad = tch::no_grad_guard();
        for (name, mut value) in full.var_store().variables() {
            if name.ends_with("bias") || name.contains("norm") {
                let noise = Tensor::randn(value.size(), (Kind::Float, Device::Cpu)) * 0.3;
                value.copy_(&(value.shallow_clone() + noise));
            }
        }
    }

    /// `f(rank's shard of full)` on `world` threads, the results in rank order.
    fn on_shards<T: Send + 'static>(
        full: &CausalLm,
        world: usize,
        f: impl Fn(TpCausalLm<keel_collective::cpu::CpuCollective>) -> T + Send + Clone + 'static,
    ) -> Vec<T> {
        let shards: Vec<_> = CpuGroup::new(world)
            .expect("a group")
            .into_iter()
            .map(|comm| TpCausalLm::shard(full, comm).expect("a shard"))
            .collect();
        let threads: Vec<_> = shards
            .into_iter()
            .map(|model| {
                let f = f.clone();
                std::thread::spawn(move || f(model))
            })
            .collect();
        threads.into_iter().map(|t| t.join().expect("a rank")).collect()
    }

    /// Max |TP logprobs − TP=1 logprobs| over every rank, for each world size.
    fn compare(cfg: ModelConfig, worlds: &[usize]) -> Vec<(usize, f64)> {
        tch::manual_seed(11);
        let full = CausalLm::new(cfg, Device::Cpu, Kind::Float, Init::Random { std: 0.2 }).expect("a model");
        randomize_biases_and_norms(&full);
        let _no_grad = tch::no_grad_guard();
        let rows: Vec<i64> = (0..2 * 13).map(|i| (i * 37 + 5) % 101).collect();
        let ids = Tensor::from_slice(&rows).view([2, 13]);
        let lengths = [13, 9];
        let expected = full.token_logprobs(&ids, &lengths, 0.7).expect("TP=1 logprobs").detach();
        worlds
            .iter()
            .map(|&world| {
                let rows = rows.clone();
                let results = on_shards(&full, world, move |model| {
                    let ids = Tensor::from_slice(&rows).view([2, 13]);
                    model.token_logprobs(&ids, &lengths, 0.7).expect("TP logprobs")
                });
                let diff = results
                    .into_iter()
                    .map(|got| got.f_sub(&expected).expect("same shape").abs().max().double_value(&[]))
                    .fold(0.0, f64::max);
                (world, diff)
            })
            .collect()
    }

    #[test]
    fn logprobs_at_tp_2_and_4_equal_tp_1() {
        // Qwen3: q/k norms; 4 KV heads split over 2 and 4 ranks.
        for (world, diff) in compare(config("Qwen3ForCausalLM", 8, 4, json!({"head_dim": 16})), &[2, 4]) {
            assert!(diff <= 1e-5, "qwen3 TP={world}: max diff {diff:e}");
        }
        // Qwen2: q/k/v biases; 2 KV heads replicated over 4 ranks (GQA), tied embeddings.
        let qwen2 = config("Qwen2ForCausalLM", 4, 2, json!({"tie_word_embeddings": true}));
        for (world, diff) in compare(qwen2, &[2, 4]) {
            assert!(diff <= 1e-5, "qwen2 TP={world}: max diff {diff:e}");
        }
        // Llama with biases on o and the MLP, a vocabulary that does not divide by 4.
        let llama = config("LlamaForCausalLM", 4, 4, json!({"attention_bias": true, "mlp_bias": true}));
        for (world, diff) in compare(llama, &[2, 4]) {
            assert!(diff <= 1e-5, "llama TP={world}: max diff {diff:e}");
        }
    }

    #[test]
    fn ranks_loading_their_slices_from_a_checkpoint_match_the_model() {
        let dir = tempfile::tempdir().expect("a directory");
        for cfg in [
            config("LlamaForCausalLM", 4, 4, json!({"attention_bias": true, "mlp_bias": true})),
            config("Qwen2ForCausalLM", 4, 2, json!({"tie_word_embeddings": true})),
        ] {
            tch::manual_seed(5);
            let full = CausalLm::new(cfg, Device::Cpu, Kind::Float, Init::Random { std: 0.2 }).expect("a model");
            randomize_biases_and_norms(&full);
            full.save(dir.path(), crate::SaveOptions { max_shard_bytes: 60_000 }).expect("saved in several shards");
            let ids = Tensor::from_slice(&[3i64, 17, 99, 42, 7, 64, 100, 0]).view([1, 8]);
            let expected = full.token_logprobs(&ids, &[8], 1.0).expect("logprobs").detach();
            for world in [2, 4] {
                let threads: Vec<_> = CpuGroup::new(world)
                    .expect("a group")
                    .into_iter()
                    .map(|comm| {
                        let (path, ids) = (dir.path().to_path_buf(), ids.copy());
                        std::thread::spawn(move || {
                            let model = TpCausalLm::load(&path, comm, Device::Cpu, Kind::Float).expect("loaded");
                            model.token_logprobs(&ids, &[8], 1.0).expect("TP logprobs")
                        })
                    })
                    .collect();
                for thread in threads {
                    let diff = (thread.join().expect("a rank") - &expected).abs().max().double_value(&[]);
                    assert!(diff <= 1e-5, "TP={world} from the checkpoint: max diff {diff:e}");
                }
            }
        }
        let comm = CpuGroup::new(1).expect("a group").into_iter().next().expect("rank 0");
        let missing = TpCausalLm::load(&dir.path().join("nope"), comm, Device::Cpu, Kind::Float);
        assert!(missing.expect_err("no directory").to_string().contains("does not exist"));
    }

    #[test]
    fn gathered_shards_are_the_model_again() {
        for cfg in [
            config("Qwen2ForCausalLM", 4, 2, json!({})),
            config("LlamaForCausalLM", 4, 4, json!({"attention_bias": true, "mlp_bias": true})),
            config("Qwen3ForCausalLM", 8, 4, json!({"head_dim": 16, "tie_word_embeddings": true})),
        ] {
            tch::manual_seed(3);
            let full = CausalLm::new(cfg, Device::Cpu, Kind::Float, Init::Random { std: 0.2 }).expect("a model");
            randomize_biases_and_norms(&full);
            let original = full.var_store().variables();
            for world in [2, 4] {
                let results = on_shards(&full, world, |model| {
                    let gathered = model.gather_full().expect("gathered");
                    gathered.var_store().variables().into_iter().map(|(k, v)| (k, v.detach())).collect::<Vec<_>>()
                });
                for gathered in results {
                    assert_eq!(gathered.len(), original.len());
                    for (name, value) in gathered {
                        assert!(value.equal(&original[&name]), "TP={world}: `{name}` differs after the round trip");
                    }
                }
            }
        }
    }

    #[test]
    fn shapes_that_do_not_split_are_refused() {
        let full = CausalLm::new(config("Qwen3ForCausalLM", 6, 3, json!({})), Device::Cpu, Kind::Float, Init::Zeros)
            .expect("a model");
        let comm = CpuGroup::new(4).expect("a group").into_iter().next().expect("rank 0");
        let error = TpCausalLm::shard(&full, comm).expect_err("6 heads over 4 ranks").to_string();
        assert!(error.contains("num_attention_heads"), "{error}");
    }
}
