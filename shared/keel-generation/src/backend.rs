//! What the scheduler runs its forward passes on: one model with its paged KV cache, or a
//! tensor-parallel group of ranks, each with its slices of the model and a pool of its KV
//! heads, driven in lockstep ([`keel_collective::RankGroup`]). The scheduler is the same
//! for both: it owns the block tables and sees blocks, chunks and full logits.

use std::path::{Path, PathBuf};

use keel_collective::process::RankError;
use keel_collective::{RankGroup, SharedComm, rank_zero};
use keel_model::model::StagedWeights;
use keel_model::{
    BLOCK_SIZE, CausalLm, DecodeGraphs, Error, ModelConfig, PagedCache, PromptLogprobs, Result, SeqChunk,
};
use tch::{Device, Kind, Tensor};

use crate::group::Grouped;

// One per generator, made once and never moved on a hot path: its size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Backend {
    /// The ranks in this process; `graphs` replays a whole model's decode steps captured as
    /// CUDA graphs (for batches of up to `captured`'s sequences and tokens, kept to capture
    /// them again after a sleep).
    Local { ranks: Ranks, blocks: usize, graphs: Option<DecodeGraphs>, captured: Option<(usize, usize)> },
    /// The leader of ranks that are processes of their own (see [`crate::group`]).
    Group(Grouped),
}

/// The ranks of one process: the whole model held by the scheduler's own thread, or a
/// tensor-parallel model's ranks on threads of their own, driven in lockstep. Either way a
/// call runs on every rank ([`Ranks::run_all`]).
// One per generator, never moved on a hot path: its size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Ranks {
    Whole(Rank),
    Threads(RankGroup<Rank>),
}

impl Ranks {
    /// `f(rank, input)` on every rank, the results in rank order (`vec!` moves `input` to
    /// the last rank: the whole model's is never copied).
    fn run_all<I, T>(
        &mut self,
        input: I,
        f: impl Fn(&mut Rank, I) -> Result<T> + Send + Clone + 'static,
    ) -> Vec<keel_collective::Result<Result<T>>>
    where
        I: Clone + Send + 'static,
        T: Send + 'static,
    {
        let inputs = vec![input; self.world_size()];
        self.run(inputs, f)
    }

    /// `f(rank, inputs[r])` on every rank r, the results in rank order.
    fn run<I, T>(
        &mut self,
        inputs: Vec<I>,
        f: impl Fn(&mut Rank, I) -> Result<T> + Send + Clone + 'static,
    ) -> Vec<keel_collective::Result<Result<T>>>
    where
        I: Send + 'static,
        T: Send + 'static,
    {
        match self {
            Self::Whole(rank) => inputs.into_iter().map(|input| Ok(f(rank, input))).collect(),
            Self::Threads(group) => group.run(inputs, f),
        }
    }

    fn world_size(&self) -> usize {
        match self {
            Self::Whole(_) => 1,
            Self::Threads(group) => group.world_size(),
        }
    }
}

/// The model directory LoRA adapters sit on, and copies of its weights that they target (by
/// Hugging Face name; a rank's slices under tensor parallelism).
type LoraBase = (PathBuf, std::collections::HashMap<String, Tensor>);

/// New weights for a refit: a Hugging Face directory (or a LoRA adapter directory), whole
/// tensors by Hugging Face name (a weights-only export that came in memory), or a LoRA run's
/// adapters (`<module>.lora_A.weight`, `….lora_B.weight`, whole) with their scale.
#[derive(Debug)]
pub enum Weights {
    Dir(PathBuf),
    Tensors(std::collections::HashMap<String, Tensor>),
    Adapters { tensors: std::collections::HashMap<String, Tensor>, scale: f64, base: PathBuf },
}

impl Weights {
    /// A copy for one rank (the tensors shared, not copied).
    fn share(&self) -> Self {
        match self {
            Self::Dir(dir) => Self::Dir(dir.clone()),
            Self::Tensors(map) => Self::Tensors(shared(map)),
            Self::Adapters { tensors, scale, base } => {
                Self::Adapters { tensors: shared(tensors), scale: *scale, base: base.clone() }
            }
        }
    }
}

/// Moves the kept LoRA base weights to `device` in place (with the model's weights, while a
/// colocated generator sleeps); returns the bytes moved.
fn move_base(base: &Option<LoraBase>, device: Device) -> Result<u64> {
    let tensors = base.iter().flat_map(|(_, weights)| weights.values());
    keel_model::device::move_in_place(tensors, device)
}

fn shared(map: &std::collections::HashMap<String, Tensor>) -> std::collections::HashMap<String, Tensor> {
    map.iter().map(|(k, t)| (k.clone(), t.shallow_clone())).collect()
}

/// One rank: its slices of the model (the whole model at tensor_parallel_size 1), its pool
/// of its KV heads, and its refit state: held by a whole backend, on a thread of a sharded
/// one ([`Ranks`]), or in a process of a generator group.
#[derive(Debug)]
pub struct Rank {
    model: CausalLm,
    cache: PagedCache,
    refit: RankRefit,
}

/// A rank's weights staged for a refit, and its slices of the LoRA base weights (kept from
/// a LoRA run's first adapter refit to merge every later version into).
#[derive(Debug, Default)]
struct RankRefit {
    staged: Option<StagedWeights>,
    lora_base: Option<LoraBase>,
}

impl Rank {
    /// This rank's slices of `dir` (talking to the other ranks over `comm`) on `device`, and
    /// a pool of `blocks` blocks of its KV heads.
    pub fn load(dir: &Path, comm: SharedComm, device: Device, kind: Kind, blocks: usize) -> Result<Self> {
        Self::of(CausalLm::load_shard(dir, comm, device, kind)?, blocks)
    }

    /// `model` (whole, or a rank's slices) with a pool of `blocks` blocks of its KV heads.
    pub fn of(model: CausalLm, blocks: usize) -> Result<Self> {
        let cache = model.paged_cache(blocks)?;
        Ok(Self { model, cache, refit: RankRefit::default() })
    }

    pub fn rank(&self) -> usize {
        self.model.rank()
    }

    pub fn world_size(&self) -> usize {
        self.model.world_size()
    }

    pub fn device(&self) -> Device {
        self.model.device()
    }

    /// The rank's tensor-parallel communicator (`None` for a whole model).
    pub fn comm(&self) -> Option<&SharedComm> {
        self.model.comm()
    }

    /// The logits of the pass (every rank has the same).
    pub fn forward(&mut self, chunks: &[SeqChunk]) -> Result<Tensor> {
        self.model.forward_paged(chunks, &mut self.cache)
    }

    pub fn copy_block(&mut self, from: usize, to: usize) -> Result<()> {
        self.cache.copy_block(from, to)
    }

    /// Scores `prompt`'s tokens (every rank has the same result).
    pub fn prompt_logprobs(&mut self, prompt: &[i64], top: usize) -> Result<PromptLogprobs> {
        self.model.prompt_logprobs(prompt, top)
    }

    /// Frees the pool (and, with `offload`, moves the weights to host memory); the bytes freed.
    pub fn sleep(&mut self, offload: bool) -> Result<u64> {
        let host = Device::Cpu;
        let weights =
            if offload { self.model.move_weights(host)? + move_base(&self.refit.lora_base, host)? } else { 0 };
        let freed = weights + self.cache.release();
        keel_model::device::return_cached_memory(self.model.device())?;
        Ok(freed)
    }

    /// Weights back on the device and the pool allocated again; the bytes taken back.
    pub fn wake(&mut self) -> Result<u64> {
        let device = self.model.device();
        Ok(self.model.move_weights(device)? + move_base(&self.refit.lora_base, device)? + self.cache.restore()?)
    }

    /// Reads and checks this rank's slices of `weights`, keeping them for [`Rank::commit`].
    pub fn stage(&mut self, weights: Weights) -> Result<()> {
        let model = &self.model;
        let refit = &mut self.refit;
        // Whatever an earlier, unfinished refit staged goes first, so a failure leaves none.
        refit.staged = None;
        refit.staged = Some(match weights {
            Weights::Dir(dir) => model.stage_weights(&dir)?,
            Weights::Tensors(map) => model.stage_weights_from(map)?,
            Weights::Adapters { tensors, scale, base } => {
                let kept = match refit.lora_base.take() {
                    Some((dir, weights)) if dir == base => weights,
                    _ => {
                        // The whole base, on the CPU, once per run: each rank cuts its slices.
                        let full = CausalLm::load(&base, Device::Cpu, model.kind())?;
                        model.targeted_weights(&full.var_store().variables(), &tensors)?
                    }
                };
                let staged = model.stage_adapters(&kept, &tensors, scale);
                refit.lora_base = Some((base, kept));
                staged?
            }
        });
        Ok(())
    }

    /// Swaps in the staged weights when `commit` (every rank staged its own), else drops them.
    pub fn commit(&mut self, commit: bool) -> Result<()> {
        match self.refit.staged.take() {
            Some(weights) if commit => self.model.commit_weights(weights),
            _ => Ok(()),
        }
    }
}

/// Rank 0's value, or the error that started a failure (not a peer's timeout after it).
fn first<T>(results: Vec<keel_collective::Result<Result<T>>>) -> Result<T> {
    rank_zero(results, Error::is_consequence)
}

/// The sum over every rank, or the error that started a failure.
fn sum(results: Vec<keel_collective::Result<Result<u64>>>) -> Result<u64> {
    let total = results.iter().map(|r| r.as_ref().ok().and_then(|r| r.as_ref().ok()).copied().unwrap_or(0)).sum();
    first(results).map(|_| total)
}

/// Blocks of `cfg`'s KV cache (`kv_heads` of them per device, in `kind`) that fit in `bytes`.
pub fn blocks_in(cfg: &ModelConfig, kv_heads: i64, kind: Kind, bytes: u64) -> usize {
    (bytes / PagedCache::block_bytes(cfg, kv_heads, kind).max(1) as u64) as usize
}

impl Backend {
    /// One model with a pool of `blocks` blocks.
    pub fn whole(model: CausalLm, blocks: usize) -> Result<Self> {
        let ranks = Ranks::Whole(Rank::of(model, blocks)?);
        Ok(Self::Local { ranks, blocks, graphs: None, captured: None })
    }

    /// Captures the model's decode step as CUDA graphs for batches of up to
    /// `max_num_seqs` sequences of up to `max_model_len` tokens (see [`DecodeGraphs`]).
    /// Returns the batch sizes captured; on an error the backend stays eager.
    pub fn capture_graphs(&mut self, max_num_seqs: usize, max_model_len: usize) -> Result<Vec<usize>> {
        match self {
            Self::Local { ranks: Ranks::Whole(rank), graphs, captured, .. } => {
                let max_blocks = max_model_len.div_ceil(BLOCK_SIZE);
                let made = DecodeGraphs::capture(&rank.model, &mut rank.cache, max_num_seqs, max_blocks)?;
                let buckets = made.buckets();
                *graphs = Some(made);
                *captured = Some((max_num_seqs, max_model_len));
                Ok(buckets)
            }
            Self::Local { .. } | Self::Group(_) => {
                Err(Error::Device("CUDA graphs are not captured under tensor parallelism".into()))
            }
        }
    }

    /// [`Self::capture_graphs`] as a server starts: the batch sizes captured are logged and
    /// counted, and on an error the backend runs eagerly (logged); returns how many were.
    pub fn capture_graphs_or_run_eagerly(&mut self, max_num_seqs: usize, max_model_len: usize) -> usize {
        let started = std::time::Instant::now();
        match self.capture_graphs(max_num_seqs, max_model_len) {
            Ok(buckets) => {
                let seconds = started.elapsed().as_secs_f64();
                tracing::info!(?buckets, seconds, "decode steps captured as CUDA graphs");
                buckets.len()
            }
            Err(e) => {
                tracing::warn!("CUDA graphs off, every step runs eagerly: {e}");
                0
            }
        }
    }

    /// `dir` split over `world` ranks on `device` (rank r on `cuda:N+r` for CUDA), each
    /// loading only its slices and holding a pool of `blocks` blocks of its KV heads.
    pub fn sharded(dir: &Path, world: usize, device: Device, kind: Kind, blocks: usize) -> Result<Self> {
        let comms =
            keel_collective::new_group(world, device).map_err(|e| Error::Device(format!("tensor parallelism: {e}")))?;
        let dir = dir.to_path_buf();
        let group = RankGroup::spawn("keel-generator", comms, move |rank, comm: SharedComm| {
            Rank::load(&dir, comm, keel_collective::rank_device(device, rank), kind, blocks)
        })?;
        Ok(Self::Local { ranks: Ranks::Threads(group), blocks, graphs: None, captured: None })
    }

    pub fn tensor_parallel_size(&self) -> usize {
        match self {
            Self::Local { ranks, .. } => ranks.world_size(),
            Self::Group(g) => g.world_size(),
        }
    }

    /// Blocks in the pool.
    pub fn blocks(&self) -> usize {
        match self {
            Self::Local { blocks, .. } => *blocks,
            Self::Group(g) => g.blocks(),
        }
    }

    /// Logits [R, vocab] for the last token of every chunk that asks for them (see
    /// [`CausalLm::forward_paged`]), on the device of the model (rank 0's under TP).
    pub fn forward(&mut self, chunks: &[SeqChunk]) -> Result<Tensor> {
        match self {
            Self::Local { ranks: Ranks::Whole(rank), graphs, .. } => match graphs {
                Some(graphs) if graphs.fits(chunks) => graphs.run(&rank.model, chunks, &mut rank.cache),
                _ => rank.forward(chunks),
            },
            Self::Local { ranks, .. } => {
                let logits = first(ranks.run_all(chunks.to_vec(), |rank, chunks| {
                    let logits = rank.forward(&chunks)?;
                    // Every rank has the same logits; only rank 0's travel back.
                    Ok((rank.rank() == 0).then_some(logits))
                }))?;
                logits.ok_or_else(|| Error::InvalidInput("rank 0 returned no logits".into()))
            }
            Self::Group(g) => g.forward(chunks),
        }
    }

    /// Copies block `from` into block `to` (copy on write).
    pub fn copy_block(&mut self, from: usize, to: usize) -> Result<()> {
        match self {
            Self::Local { ranks, .. } => first(ranks.run_all((from, to), |rank, (from, to)| rank.copy_block(from, to))),
            Self::Group(g) => g.copy_block(from, to),
        }
    }

    /// The logprob, rank and most likely alternatives of each of `prompt`'s tokens after the
    /// first (see [`PromptLogprobs`]), by a pass of its own outside the KV pool.
    pub fn prompt_logprobs(&mut self, prompt: &[i64], top: usize) -> Result<PromptLogprobs> {
        match self {
            Self::Local { ranks, .. } => {
                first(ranks.run_all(prompt.to_vec(), move |rank, prompt| rank.prompt_logprobs(&prompt, top)))
            }
            Self::Group(g) => g.prompt_logprobs(prompt, top),
        }
    }

    /// Sleep of a colocated generator while the trainer trains: frees the KV pool (every
    /// rank's) and, with `offload_weights`, moves the weights to host memory (on a CPU
    /// device they stay where they are). CUDA graphs, which point into the pool, are
    /// dropped. Returns the bytes freed (the pool's, in host memory too on a CPU device).
    pub fn sleep(&mut self, offload_weights: bool) -> Result<u64> {
        match self {
            Self::Local { ranks, graphs, .. } => {
                *graphs = None;
                sum(ranks.run_all(offload_weights, |rank, offload| rank.sleep(offload)))
            }
            Self::Group(g) => g.sleep(offload_weights),
        }
    }

    /// Wakes a sleeping backend: weights back on the device, the pool allocated again
    /// (empty), CUDA graphs captured again where they were. Returns the bytes it took back.
    pub fn wake(&mut self) -> Result<u64> {
        match self {
            Self::Local { ranks, graphs, captured, .. } => {
                let bytes = sum(ranks.run_all((), |rank, ()| rank.wake()))?;
                if let (Ranks::Whole(rank), None, Some((seqs, len))) = (ranks, &graphs, *captured) {
                    let max_blocks = len.div_ceil(BLOCK_SIZE);
                    *graphs = Some(DecodeGraphs::capture(&rank.model, &mut rank.cache, seqs, max_blocks)?);
                }
                Ok(bytes)
            }
            Self::Group(g) => g.wake(),
        }
    }

    /// Copies `weights` over the model's. Ranks first read and check their slices; only
    /// when every rank has them does any rank swap, so a refit that fails on one rank
    /// leaves all ranks on the old weights. (An adapter directory loads as its base with the
    /// adapters merged.)
    ///
    /// LoRA adapters merge into the weights of the model directory they sit on, read once
    /// (on a run's first adapter refit) and kept for every later version.
    pub fn reload_weights(&mut self, weights: &Weights) -> Result<()> {
        match self {
            Self::Local { ranks, .. } => {
                let inputs = (0..ranks.world_size()).map(|_| weights.share()).collect();
                let staged = first(ranks.run(inputs, |rank, weights| rank.stage(weights)));
                let commit = staged.is_ok();
                let committed = first(ranks.run_all(commit, |rank, commit| rank.commit(commit)));
                staged.and(committed)
            }
            Self::Group(g) => g.reload(weights),
        }
    }

    /// Called while the engine is idle: a group's leader checks now and then that every
    /// rank is still there.
    pub fn keep_alive(&mut self) {
        if let Self::Group(g) = self {
            g.keep_alive();
        }
    }
}

/// Loads Keel's CUDA kernels for `model`'s device and dtype (see `keel_model::cuda`): a
/// kernel that does not compile or does not match its tch path is logged and left off, and
/// the model runs the tch path for it; so does a kernel the model's family cannot use (Gemma's
/// `1 + w` norms, a partial rotary embedding, ...), said once at start-up. Returns how many
/// kernels run and how many are off.
pub fn attach_kernels(model: &mut keel_model::CausalLm, device: tch::Device, kind: tch::Kind) -> (usize, usize) {
    use keel_model::cuda::{Kernel, Kernels};
    let all = Kernel::ALL.len();
    let class = model.config().architecture.hf_class();
    let unused = model.kernels_not_used();
    for (kernel, why) in &unused {
        tracing::warn!(kernel = kernel.name(), "CUDA kernel not used for {class}, using the tch path: {why}");
    }
    match Kernels::load(device, &[kind]) {
        Ok(kernels) => {
            for (kernel, why) in kernels.fallbacks() {
                tracing::warn!(kernel = kernel.name(), "CUDA kernel off, using the tch path: {why}");
            }
            let failed = kernels.fallbacks().iter().map(|(k, _)| *k);
            let off = Kernel::ALL
                .iter()
                .filter(|k| failed.clone().any(|f| f == **k) || unused.iter().any(|(u, _)| u == *k))
                .count();
            tracing::info!(on = all - off, off, "CUDA kernels loaded");
            model.use_kernels(std::sync::Arc::new(kernels));
            (all - off, off)
        }
        Err(e) => {
            tracing::warn!("CUDA kernels off, using the tch path: {e}");
            (0, all)
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use keel_model::{Init, SaveOptions};

    pub(crate) fn random_model(dir: &Path, seed: i64) {
        let cfg = ModelConfig::from_json(serde_json::json!({
            "architectures": ["Qwen2ForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 97, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        }))
        .expect("a config");
        tch::manual_seed(seed);
        let model = CausalLm::new(cfg, Device::Cpu, Kind::Float, Init::Random { std: 0.3 }).expect("a model");
        model.save(dir, SaveOptions::default()).expect("saved");
    }

    pub(crate) fn chunk(tokens: &[i64], context: usize, blocks: &[u32]) -> SeqChunk {
        SeqChunk { tokens: tokens.to_vec(), context, blocks: blocks.to_vec(), logits: true }
    }

    /// LoRA adapters (a LoRA run's refit) merge into their base on one rank and on two, each
    /// new version into the kept base (the serving weights are not the base any more after
    /// the first), and an adapter directory loads as base and adapters merged: the logits
    /// are those of the trained model with its adapters.
    #[test]
    fn backends_refit_from_lora_adapters_like_the_adapted_model() {
        let dir = tempfile::tempdir().expect("a directory");
        let base = dir.path().join("base");
        random_model(&base, 3);
        let lora = keel_protocol::training::LoraConfig {
            enabled: true,
            rank: 4,
            alpha: 8.0,
            target_modules: vec!["k_proj".into(), "o_proj".into(), "up_proj".into(), "down_proj".into()],
            ..Default::default()
        };
        let mut trained = CausalLm::load(&base, Device::Cpu, Kind::Float).expect("loaded");
        trained.add_adapters(&lora).expect("adapters");
        let version = |seed: i64| {
            tch::manual_seed(seed);
            let tensors: std::collections::HashMap<String, Tensor> =
                trained.adapter_tensors().into_iter().map(|(n, t)| (n, t.randn_like() * 0.2)).collect();
            trained.load_adapter_tensors(&tensors).expect("set");
            tensors
        };
        let prompt = [chunk(&[3, 50, 7, 96, 12], 0, &[1])];
        let mut whole =
            Backend::whole(CausalLm::load(&base, Device::Cpu, Kind::Float).expect("loaded"), 4).expect("a backend");
        let mut sharded = Backend::sharded(&base, 2, Device::Cpu, Kind::Float, 4).expect("two ranks");
        for seed in [1, 2] {
            let tensors = version(seed);
            let mut cache = PagedCache::new(trained.config(), 4, Kind::Float, Device::Cpu).expect("a pool");
            let want = trained.forward_paged(&prompt, &mut cache).expect("the adapted model's logits");
            for backend in [&mut whole, &mut sharded] {
                let adapters = Weights::Adapters { tensors: shared(&tensors), scale: lora.scale(), base: base.clone() };
                backend.reload_weights(&adapters).expect("refit from adapters");
                let diff = (backend.forward(&prompt).expect("logits") - &want).abs().max().double_value(&[]);
                assert!(diff <= 1e-5, "TP {}: version {seed} differs by {diff:e}", backend.tensor_parallel_size());
            }
        }
        let saved = dir.path().join("adapter");
        trained.save_adapters(&saved, &base).expect("saved");
        let mut cache = PagedCache::new(trained.config(), 4, Kind::Float, Device::Cpu).expect("a pool");
        let want = trained.forward_paged(&prompt, &mut cache).expect("logits");
        // Adapters that do not fit the base are refused; the last version keeps serving.
        let mut bad = shared(&trained.adapter_tensors().into_iter().collect());
        bad.remove("model.layers.0.mlp.up_proj.lora_B.weight");
        for backend in [&mut whole, &mut sharded] {
            let bad = Weights::Adapters { tensors: shared(&bad), scale: 2.0, base: base.clone() };
            let err = backend.reload_weights(&bad).unwrap_err();
            assert!(err.to_string().contains("up_proj.lora_B"), "{err}");
            let diff = (backend.forward(&prompt).expect("logits") - &want).abs().max().double_value(&[]);
            assert!(diff <= 1e-5, "after a refused refit: {diff:e}");
            backend.reload_weights(&Weights::Dir(saved.clone())).expect("an adapter directory");
            let diff = (backend.forward(&prompt).expect("logits") - &want).abs().max().double_value(&[]);
            assert!(diff <= 1e-5, "TP {}: from the adapter directory: {diff:e}", backend.tensor_parallel_size());
        }
    }

    /// Prefill, copy on write, decode, block reuse and refit on two ranks give what one
    /// model gives.
    #[test]
    fn a_sharded_backend_serves_and_refits_like_a_whole_model() {
        let dir = tempfile::tempdir().expect("a directory");
        let (first, second) = (dir.path().join("first"), dir.path().join("second"));
        random_model(&first, 1);
        random_model(&second, 2);
        let mut sharded = Backend::sharded(&first, 2, Device::Cpu, Kind::Float, 4).expect("two ranks");
        assert_eq!((sharded.tensor_parallel_size(), sharded.blocks()), (2, 4));
        let run = |backend: &mut Backend| -> Vec<Tensor> {
            let mut out = vec![backend.forward(&[chunk(&[3, 50, 7, 96], 0, &[1])]).expect("prefill")];
            backend.copy_block(1, 2).expect("copied");
            out.push(backend.forward(&[chunk(&[11], 4, &[1]), chunk(&[12], 4, &[2])]).expect("decode"));
            out.push(backend.forward(&[chunk(&[40, 41], 0, &[2])]).expect("reuse"));
            out
        };
        let before = run(&mut sharded);
        sharded.reload_weights(&Weights::Dir(second.clone())).expect("refit");
        let after = run(&mut sharded);
        for (dir, got) in [(&first, before), (&second, after)] {
            let model = CausalLm::load(dir, Device::Cpu, Kind::Float).expect("loaded");
            let want = run(&mut Backend::whole(model, 4).expect("a backend"));
            for (g, w) in got.iter().zip(&want) {
                let diff = (g - w).abs().max().double_value(&[]);
                assert!(diff <= 1e-5, "{}: TP=2 logits differ from TP=1 by {diff:e}", dir.display());
            }
        }
        // Weights of another shape are refused and the old ones keep serving.
        let other = dir.path().join("other");
        let cfg = ModelConfig::from_json(serde_json::json!({
            "architectures": ["Qwen2ForCausalLM"], "hidden_size": 32, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 97, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        }))
        .expect("a config");
        CausalLm::new(cfg, Device::Cpu, Kind::Float, Init::Zeros)
            .expect("a model")
            .save(&other, SaveOptions::default())
            .expect("saved");
        assert!(sharded.reload_weights(&Weights::Dir(other)).is_err());
        let again = run(&mut sharded);
        let whole = CausalLm::load(&second, Device::Cpu, Kind::Float).expect("loaded");
        let diff =
            (&again[0] - &run(&mut Backend::whole(whole, 4).expect("a backend"))[0]).abs().max().double_value(&[]);
        assert!(diff <= 1e-5, "after a refused refit the previous weights serve: {diff:e}");
        // A refit from tensors in memory (a weights-only export), back to the first model,
        // on two ranks and on one.
        let tensors = || {
            let model = CausalLm::load(&first, Device::Cpu, Kind::Float).expect("loaded");
            Weights::Tensors(model.var_store().variables())
        };
        sharded.reload_weights(&tensors()).expect("refit from memory");
        let mut whole =
            Backend::whole(CausalLm::load(&second, Device::Cpu, Kind::Float).expect("loaded"), 4).expect("a backend");
        whole.reload_weights(&tensors()).expect("refit from memory");
        let want = run(&mut Backend::whole(CausalLm::load(&first, Device::Cpu, Kind::Float).expect("loaded"), 4)
            .expect("a backend"));
        for got in [run(&mut sharded), run(&mut whole)] {
            for (g, w) in got.iter().zip(&want) {
                let diff = (g - w).abs().max().double_value(&[]);
                assert!(diff <= 1e-5, "after a refit from memory the logits differ by {diff:e}");
            }
        }
        // Asleep (colocated), the pools are freed and passes fail; awake, they serve again.
        for backend in [&mut sharded, &mut whole] {
            assert!(backend.sleep(true).expect("asleep") > 0, "the pool is freed");
            let error = backend.forward(&[chunk(&[3], 0, &[1])]).expect_err("no pool while asleep").to_string();
            assert!(error.contains("released"), "{error}");
            assert!(backend.wake().expect("awake") > 0, "the pool is back");
            for (g, w) in run(backend).iter().zip(&want) {
                let diff = (g - w).abs().max().double_value(&[]);
                assert!(diff <= 1e-5, "after a sleep and a wake the logits differ by {diff:e}");
            }
        }
    }
}
