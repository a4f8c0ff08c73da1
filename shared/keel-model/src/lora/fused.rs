//! LoRA adapters of fused projections in PEFT's layout. Keel holds Phi-3's `qkv_proj` and
//! Phi-3's and GLM-4's `gate_up_proj` as their parts (q, k, v; gate, up), each with an adapter
//! of rank r; PEFT adapts the fused module. The parts' adapters are one adapter of the fused
//! module exactly: A is the parts' A stacked ([k·r, in]), B is block-diagonal (part i's rows
//! hold its B in columns i·r..(i+1)·r), so `B·A` is each part's `Bᵢ·Aᵢ` in its rows. Its rank
//! k·r and alpha (k·alpha, or √k·alpha with rsLoRA, so the scale stays the parts') go to PEFT's
//! `rank_pattern` and `alpha_pattern`. Reading splits the blocks back and refuses an adapter
//! whose off-diagonal blocks are not zero (one not written this way).

use std::collections::{BTreeMap, HashMap};

use keel_protocol::training::LoraConfig;
use tch::Tensor;

use crate::config::FusedWeight;
use crate::error::{Error, Result, WeightProblem};

/// A fused module's name (`qkv_proj`, `gate_up_proj`) and its parts' (`q_proj`, ...), the
/// last component of each module path.
fn short_names(fused: &FusedWeight) -> (String, Vec<String>) {
    let short = |name: &str| {
        let module = name.strip_suffix(".weight").unwrap_or(name);
        module.rsplit('.').next().unwrap_or(module).to_string()
    };
    (short(&fused.name), fused.parts.iter().map(|(name, _)| short(name)).collect())
}

/// Each kind of fused projection once (every layer has the same ones).
fn kinds(fused: &[FusedWeight]) -> Vec<(String, Vec<String>)> {
    let mut kinds: Vec<(String, Vec<String>)> = Vec::new();
    for kind in fused.iter().map(short_names) {
        if !kinds.iter().any(|(name, _)| *name == kind.0) {
            kinds.push(kind);
        }
    }
    kinds
}

fn module(weight: &str) -> &str {
    weight.strip_suffix(".weight").unwrap_or(weight)
}

/// Refuses targets that adapt some parts of a fused projection but not all (PEFT can only
/// adapt the fused module as a whole).
pub(crate) fn check_targets(config: &LoraConfig, fused: &[FusedWeight]) -> Result<()> {
    let targets = config.targets();
    for (name, parts) in kinds(fused) {
        let adapted = parts.iter().filter(|p| targets.contains(&p.as_str())).count();
        if adapted != 0 && adapted != parts.len() {
            return Err(Error::InvalidInput(format!(
                "lora.target_modules: the checkpoint stores {} as one `{name}`, so LoRA adapts all of them or none",
                parts.join(", ")
            )));
        }
    }
    Ok(())
}

/// The fused modules' PEFT names in `target_modules`, and their `rank_pattern` and
/// `alpha_pattern`, for adapters of `config`'s targets.
pub(crate) fn peft_targets(
    config: &LoraConfig,
    fused: &[FusedWeight],
) -> (Vec<String>, BTreeMap<String, serde_json::Value>, BTreeMap<String, serde_json::Value>) {
    let mut targets: Vec<String> = config.targets().into_iter().map(String::from).collect();
    let (mut ranks, mut alphas) = (BTreeMap::new(), BTreeMap::new());
    for (name, parts) in kinds(fused) {
        if !targets.contains(&parts[0]) {
            continue;
        }
        let k = parts.len() as f64;
        targets.retain(|t| !parts.contains(t));
        targets.push(name.clone());
        let alpha = if config.use_rslora { config.alpha * k.sqrt() } else { config.alpha * k };
        ranks.insert(name.clone(), serde_json::json!(config.rank * parts.len() as i64));
        alphas.insert(name, serde_json::json!(alpha));
    }
    (targets, ranks, alphas)
}

/// Keel's adapter tensors (`<module>.lora_A.weight`, ...) with the parts of each fused
/// projection joined into the fused module's.
pub(crate) fn join(tensors: Vec<(String, Tensor)>, fused: &[FusedWeight]) -> Result<Vec<(String, Tensor)>> {
    let mut by_name: HashMap<String, Tensor> = tensors.into_iter().collect();
    let mut joined = Vec::new();
    for f in fused {
        let parts: Vec<&str> = f.parts.iter().map(|(name, _)| module(name)).collect();
        let a_name = |m: &str| format!("{m}.lora_A.weight");
        let b_name = |m: &str| format!("{m}.lora_B.weight");
        if !by_name.contains_key(&a_name(parts[0])) {
            continue;
        }
        let take = |name: String, by_name: &mut HashMap<String, Tensor>| {
            by_name.remove(&name).ok_or(Error::Weights(vec![WeightProblem::Missing { name }]))
        };
        let a: Vec<Tensor> = parts.iter().map(|p| take(a_name(p), &mut by_name)).collect::<Result<_>>()?;
        let b: Vec<Tensor> = parts.iter().map(|p| take(b_name(p), &mut by_name)).collect::<Result<_>>()?;
        let rank: i64 = a.iter().map(|a| a.size()[0]).sum();
        let mut rows = Vec::new();
        let mut column = 0;
        for part in &b {
            let r = part.size()[1];
            let row = Tensor::f_zeros([part.size()[0], rank], (part.kind(), part.device()))?;
            row.f_narrow(1, column, r)?.f_copy_(part)?;
            rows.push(row);
            column += r;
        }
        let fused_module = module(&f.name);
        joined.push((a_name(fused_module), Tensor::f_cat(&a, 0)?));
        joined.push((b_name(fused_module), Tensor::f_cat(&rows, 0)?));
    }
    joined.extend(by_name);
    Ok(joined)
}

/// The inverse of [`join`]: each fused module's adapter split into its parts' (rank `rank`
/// each), refusing one whose B is not block-diagonal.
pub(crate) fn split(
    tensors: &HashMap<String, Tensor>,
    fused: &[FusedWeight],
    rank: i64,
) -> Result<HashMap<String, Tensor>> {
    let mut tensors: HashMap<String, Tensor> = tensors.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    for f in fused {
        let m = module(&f.name);
        let (a_name, b_name) = (format!("{m}.lora_A.weight"), format!("{m}.lora_B.weight"));
        let (Some(a), Some(b)) = (tensors.remove(&a_name), tensors.remove(&b_name)) else { continue };
        let k = f.parts.len() as i64;
        if a.size()[0] != k * rank || b.size().get(1) != Some(&(k * rank)) {
            return Err(Error::Weights(vec![WeightProblem::Shape {
                name: a_name,
                expected: vec![k * rank, a.size().get(1).copied().unwrap_or(0)],
                found: a.size(),
            }]));
        }
        let mut row = 0;
        for (i, (part, rows)) in f.parts.iter().enumerate() {
            let i = i as i64;
            let block = b.f_narrow(0, row, *rows)?;
            let own = block.f_narrow(1, i * rank, rank)?;
            let (before, after) =
                (block.f_narrow(1, 0, i * rank)?, block.f_narrow(1, (i + 1) * rank, (k - i - 1) * rank)?);
            let nonzero = |t: &Tensor| -> Result<bool> {
                Ok(t.numel() > 0 && t.f_count_nonzero(None::<i64>)?.int64_value(&[]) > 0)
            };
            if nonzero(&before)? || nonzero(&after)? {
                return Err(Error::InvalidInput(format!(
                    "{b_name}: Keel reads a fused projection's adapter as one block per part \
                     (as Keel writes it); this one mixes the parts"
                )));
            }
            let p = module(part);
            tensors.insert(format!("{p}.lora_A.weight"), a.f_narrow(0, i * rank, rank)?.copy());
            tensors.insert(format!("{p}.lora_B.weight"), own.copy());
            row += rows;
        }
    }
    Ok(tensors)
}

/// Whether PEFT's `rank_pattern` and `alpha_pattern` are what [`peft_targets`] writes for rank
/// `rank` and alpha `alpha`: the fused modules only, k·r and k·alpha (√k·alpha).
pub(crate) fn patterns_are_fused(
    ranks: &BTreeMap<String, serde_json::Value>,
    alphas: &BTreeMap<String, serde_json::Value>,
    rank: i64,
    alpha: f64,
    rslora: bool,
) -> bool {
    let parts = |name: &str| match name {
        "qkv_proj" => Some(3.0),
        "gate_up_proj" => Some(2.0),
        _ => None,
    };
    let rank_ok = ranks.iter().all(|(name, r)| parts(name).is_some_and(|k| r.as_f64() == Some(k * rank as f64)));
    let alpha_ok = alphas.iter().all(|(name, a)| {
        parts(name).is_some_and(|k| {
            let want = if rslora { alpha * f64::sqrt(k) } else { alpha * k };
            a.as_f64().is_some_and(|a| (a - want).abs() <= 1e-9 * want.abs().max(1.0))
        })
    });
    rank_ok && alpha_ok && ranks.keys().eq(alphas.keys())
}
