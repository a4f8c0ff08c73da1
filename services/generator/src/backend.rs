//! What the scheduler runs its forward passes on: one model with its slot cache, or a
//! tensor-parallel group of ranks, each with its slices of the model and a cache of its KV
//! heads, driven in lockstep ([`keel_collective::RankGroup`]). The scheduler is the same
//! for both: it sees slots, their lengths, and full logits.

use std::path::{Path, PathBuf};

use keel_collective::{RankGroup, SharedComm, rank_zero};
use keel_model::model::tp::{StagedWeights, TpCausalLm};
use keel_model::{CausalLm, Error, Result, SlotCache};
use tch::{Device, Kind, Tensor};

// One per generator, made once and never moved on a hot path: its size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Backend {
    Whole { model: CausalLm, cache: SlotCache },
    Sharded(Sharded),
}

/// One rank: its slices of the model, its cache, and weights staged for a refit.
type Rank = (TpCausalLm<SharedComm>, SlotCache, Option<StagedWeights>);

/// The ranks of a tensor-parallel model and the slot lengths their caches share.
#[derive(Debug)]
pub struct Sharded {
    group: RankGroup<Rank>,
    lens: Vec<i64>,
    capacity: i64,
}

/// Rank 0's value, or the error that started a failure (not a peer's timeout after it).
fn first<T>(results: Vec<keel_collective::Result<Result<T>>>) -> Result<T> {
    rank_zero(results, |e| matches!(e, Error::Collective(c) if keel_collective::is_consequence(c)))
}

impl Backend {
    /// One model with a cache of `slots` sequences of up to `capacity` tokens.
    pub fn whole(model: CausalLm, slots: usize, capacity: i64) -> Result<Self> {
        let cache = SlotCache::new(model.config(), slots, capacity, model.kind(), model.device())?;
        Ok(Self::Whole { model, cache })
    }

    /// `dir` split over `world` ranks on `device` (rank r on `cuda:N+r` for CUDA), each
    /// loading only its slices and holding a cache of its KV heads.
    pub fn sharded(dir: &Path, world: usize, device: Device, kind: Kind, slots: usize, capacity: i64) -> Result<Self> {
        let comms =
            keel_collective::new_group(world, device).map_err(|e| Error::Device(format!("tensor parallelism: {e}")))?;
        let dir = dir.to_path_buf();
        let group = RankGroup::spawn("keel-generator", comms, move |rank, comm: SharedComm| {
            let device = keel_collective::rank_device(device, rank);
            let model = TpCausalLm::load(&dir, comm, device, kind)?;
            let cache = model.slot_cache(slots, capacity)?;
            Ok::<_, Error>((model, cache, None))
        })?;
        Ok(Self::Sharded(Sharded { group, lens: vec![0; slots], capacity }))
    }

    pub fn tensor_parallel_size(&self) -> usize {
        match self {
            Self::Whole { .. } => 1,
            Self::Sharded(s) => s.group.world_size(),
        }
    }

    pub fn slots(&self) -> usize {
        match self {
            Self::Whole { cache, .. } => cache.slots(),
            Self::Sharded(s) => s.lens.len(),
        }
    }

    pub fn capacity(&self) -> i64 {
        match self {
            Self::Whole { cache, .. } => cache.capacity(),
            Self::Sharded(s) => s.capacity,
        }
    }

    /// Tokens held by `slot`.
    pub fn len(&self, slot: usize) -> i64 {
        match self {
            Self::Whole { cache, .. } => cache.len(slot),
            Self::Sharded(s) => s.lens[slot],
        }
    }

    /// Logits [B, S, vocab] for `ids` [B, S] continuing `slots` (see
    /// [`CausalLm::forward_slots`]); each slot grows by S.
    pub fn forward(&mut self, ids: &Tensor, slots: &[usize]) -> Result<Tensor> {
        match self {
            Self::Whole { model, cache } => model.forward_slots(ids, cache, slots),
            Self::Sharded(s) => {
                let shape = ids.size();
                let new_tokens = shape.get(1).copied().unwrap_or(0);
                let values = Vec::<i64>::try_from(ids.f_flatten(0, -1)?)?;
                let input = (values, shape, slots.to_vec());
                let logits = first(s.group.run_all(input, |(model, cache, _), (values, shape, slots)| {
                    let ids = Tensor::from_slice(&values).f_view(shape.as_slice())?;
                    let logits = model.forward_slots(&ids, cache, &slots)?;
                    // Every rank has the same logits; only rank 0's travel back.
                    Ok((model.rank() == 0).then_some(logits))
                }))?;
                for &slot in slots {
                    s.lens[slot] += new_tokens;
                }
                logits.ok_or_else(|| Error::InvalidInput("rank 0 returned no logits".into()))
            }
        }
    }

    /// Empties `slot`.
    pub fn reset(&mut self, slot: usize) -> Result<()> {
        match self {
            Self::Whole { cache, .. } => cache.reset(slot),
            Self::Sharded(s) => {
                first(s.group.run_all(slot, |(_, cache, _), slot| {
                    cache.reset(slot);
                    Ok(())
                }))?;
                s.lens[slot] = 0;
            }
        }
        Ok(())
    }

    /// Makes `to` hold a copy of `from`'s tokens.
    pub fn copy_slot(&mut self, from: usize, to: usize) -> Result<()> {
        match self {
            Self::Whole { cache, .. } => cache.copy_slot(from, to),
            Self::Sharded(s) => {
                first(s.group.run_all((from, to), |(_, cache, _), (from, to)| cache.copy_slot(from, to)))?;
                s.lens[to] = s.lens[from];
                Ok(())
            }
        }
    }

    /// Copies the weights in `dir` over the model's. Ranks first read and check their
    /// slices; only when every rank has them does any rank swap, so a refit that fails on
    /// one rank leaves all ranks on the old weights.
    pub fn reload_weights(&mut self, dir: &Path) -> Result<()> {
        match self {
            Self::Whole { model, .. } => model.reload_weights(dir),
            Self::Sharded(s) => {
                let dir: PathBuf = dir.to_path_buf();
                let staged = first(s.group.run_all(dir, |(model, _, staged), dir| {
                    *staged = Some(model.stage_weights(&dir)?);
                    Ok(())
                }));
                let commit = staged.is_ok();
                let committed = first(s.group.run_all(commit, |(model, _, staged), commit| match staged.take() {
                    Some(weights) if commit => model.commit_weights(weights),
                    _ => Ok(()),
                }));
                staged.and(committed)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_model::ModelConfig;
    use keel_model::{Init, SaveOptions};

    fn random_model(dir: &Path, seed: i64) {
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

    /// Prefill, n-sample copy, decode, reset and refit on two ranks give what one model gives.
    #[test]
    fn a_sharded_backend_serves_and_refits_like_a_whole_model() {
        let dir = tempfile::tempdir().expect("a directory");
        let (first, second) = (dir.path().join("first"), dir.path().join("second"));
        random_model(&first, 1);
        random_model(&second, 2);
        let mut sharded = Backend::sharded(&first, 2, Device::Cpu, Kind::Float, 3, 16).expect("two ranks");
        assert_eq!(sharded.tensor_parallel_size(), 2);
        let run = |backend: &mut Backend| -> Vec<Tensor> {
            let prompt = Tensor::from_slice(&[3i64, 50, 7, 96]).view([1, 4]);
            let mut out = vec![backend.forward(&prompt, &[1]).expect("prefill")];
            backend.copy_slot(1, 2).expect("copied");
            assert_eq!((backend.len(1), backend.len(2)), (4, 4));
            out.push(backend.forward(&Tensor::from_slice(&[11i64, 12]).view([2, 1]), &[1, 2]).expect("decode"));
            backend.reset(2).expect("reset");
            assert_eq!(backend.len(2), 0);
            out.push(backend.forward(&Tensor::from_slice(&[40i64, 41]).view([1, 2]), &[2]).expect("reuse"));
            backend.reset(1).expect("reset");
            backend.reset(2).expect("reset");
            out
        };
        let before = run(&mut sharded);
        sharded.reload_weights(&second).expect("refit");
        let after = run(&mut sharded);
        for (dir, got) in [(&first, before), (&second, after)] {
            let model = CausalLm::load(dir, Device::Cpu, Kind::Float).expect("loaded");
            let want = run(&mut Backend::whole(model, 3, 16).expect("a backend"));
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
        assert!(sharded.reload_weights(&other).is_err());
        let again = run(&mut sharded);
        let diff = (&again[0]
            - &run(&mut Backend::whole(CausalLm::load(&second, Device::Cpu, Kind::Float).expect("loaded"), 3, 16)
                .expect("a backend"))[0])
            .abs()
            .max()
            .double_value(&[]);
        assert!(diff <= 1e-5, "after a refused refit the previous weights serve: {diff:e}");
    }
}
