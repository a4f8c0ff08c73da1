//! The families whose differences are configuration of Keel's one decoder (Gemma 2 and 3,
//! Phi-3, OLMo 2 and 3, GLM-4, Granite, SmolLM3) against transformers 5.23, in f32, on
//! right-padded batches: as checkpoints transformers wrote, at tensor-parallel sizes 1, 2 and
//! 4, and saved by Keel then loaded back by transformers (fused projections joined again) and
//! refitted into a blank model from that directory.
//! Every transformers computation of the file runs in two Python processes (one makes the
//! models, one scores every model), not one per variant.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use common::{keel_logprobs, load_f32};
use keel_model::{CausalLm, SaveOptions};
use keel_testkit::{max_abs_diff, reference, sequences};

const TOLERANCE: f64 = 1e-4;
/// Longer than every variant's window of 6, and a length-1 row.
const LENGTHS: [usize; 4] = [23, 14, 6, 1];

/// Each variant of `tests/reference/hf_reference.py` and what it exercises.
const VARIANTS: [&str; 9] = [
    "gemma2",              // (1 + w) sandwich norms, √hidden embeddings, both soft-caps, alternating windows
    "gemma3",              // per-head (1 + w) q/k norms, local rotary base, linear scaling on full layers, untied
    "phi3-longrope-short", // fused qkv/gate_up, partial rotary, LongRoPE short factors, a window on every layer
    "phi3-longrope-long",  // LongRoPE's long factors (sequences past the original context), tied
    "olmo2",               // post-norms only, q/k norms over the whole projection
    "olmo3",               // OLMo 2 with three windowed layers to one full
    "glm4",                // interleaved partial rotary, four norms, fused gate_up, q/k/v biases
    "granite",             // embedding, residual and attention multipliers, logits scaling, biases
    "smollm3",             // NoPE layers
];

/// Every rank of a `world`-rank CPU group loads its slices of `dir` and scores `seqs`.
fn tp_logprobs(dir: &Path, world: usize, seqs: &[Vec<i64>]) -> Result<Vec<Vec<Vec<f64>>>, String> {
    let comms = keel_collective::cpu::CpuGroup::new(world).unwrap();
    let ranks: Vec<_> = comms
        .into_iter()
        .map(|comm| {
            let (dir, seqs) = (dir.to_path_buf(), seqs.to_vec());
            std::thread::spawn(move || {
                let comm: keel_collective::SharedComm = std::sync::Arc::new(comm);
                let model =
                    CausalLm::load_shard(&dir, comm, tch::Device::Cpu, tch::Kind::Float).map_err(|e| e.to_string())?;
                Ok(keel_logprobs(&model, &seqs, 1.0))
            })
        })
        .collect();
    ranks.into_iter().map(|r| r.join().unwrap()).collect()
}

#[test]
fn every_family_scores_as_transformers_does_whole_sharded_and_saved() {
    let dir = tempfile::tempdir().unwrap();
    let made = dir.path().join("made");
    let mut args = vec!["make-models", made.to_str().unwrap()];
    args.extend(VARIANTS);
    reference(&args);

    let seqs = sequences(&LENGTHS, 211, 1);
    let mut dirs = Vec::new();
    let mut keel = Vec::new();
    let mut problems = Vec::new();
    for variant in VARIANTS {
        let source = made.join(variant);
        let model = load_f32(&source);
        assert_eq!(model.config().vocab_size, 211);
        keel.push((variant, keel_logprobs(&model, &seqs, 1.0)));
        dirs.push(source.clone());
        // Keel's save (sharded small, fused tensors joined) for transformers to load.
        let saved = dir.path().join(format!("{variant}-saved"));
        model.save(&saved, SaveOptions { max_shard_bytes: 60_000 }).unwrap();
        // A refit through that directory (fused tensors split again) gives a blank model the
        // same logprobs.
        let blank =
            CausalLm::new(model.config().clone(), tch::Device::Cpu, tch::Kind::Float, keel_model::Init::Zeros).unwrap();
        blank.commit_weights(blank.stage_weights(&saved).unwrap()).unwrap();
        let diff = max_abs_diff(&keel_logprobs(&blank, &seqs, 1.0), &keel.last().unwrap().1);
        if diff != 0.0 {
            problems.push(format!("{variant}: refit through a directory: {diff:e} from the loaded model"));
        }
        dirs.push(saved);

        for world in [2, 4] {
            match tp_logprobs(&source, world, &seqs) {
                Ok(ranks) => {
                    for (rank, got) in ranks.iter().enumerate() {
                        let diff = max_abs_diff(got, &keel.last().unwrap().1);
                        if diff > TOLERANCE {
                            problems.push(format!("{variant} at TP {world}, rank {rank}: {diff:e} from TP 1"));
                        }
                    }
                }
                Err(e) => problems.push(format!("{variant} at TP {world}: {e}")),
            }
        }
    }
    let models: Vec<_> = dirs.iter().map(|d| (d.as_path(), None)).collect();
    let expected = keel_testkit::reference_logprobs_many(&models, &seqs, dir.path());
    for (i, (variant, actual)) in keel.iter().enumerate() {
        for (which, reference) in [("its checkpoint", &expected[2 * i]), ("Keel's save", &expected[2 * i + 1])] {
            let diff = max_abs_diff(actual, reference);
            if diff > TOLERANCE {
                problems.push(format!("{variant}, {which} in transformers: max |keel - transformers| = {diff:e}"));
            }
        }
        assert!(actual.iter().all(|row| row[0] == 0.0), "{variant}: position 0 must be 0");
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The model-support page has one row per supported class, each of which loads at TP 2 and 4
/// (the test above).
#[test]
fn the_model_support_page_has_a_row_for_every_class() {
    let page =
        std::fs::read_to_string(keel_testkit::workspace_root().join("docs/src/reference/model-support.md")).unwrap();
    let rows: Vec<&str> = page.lines().filter(|l| l.starts_with("| `")).collect();
    assert_eq!(rows.len(), keel_model::Architecture::ALL.len(), "{rows:#?}");
    for arch in keel_model::Architecture::ALL {
        let start = format!("| `{}` (`{}`) |", arch.hf_class(), arch.short_name());
        let row = rows.iter().find(|r| r.starts_with(&start)).unwrap_or_else(|| panic!("no row {start}"));
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        assert_eq!(cells[7], "tested", "{arch:?}: the TP cell");
    }
}
