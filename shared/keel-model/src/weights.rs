//! Hugging Face weight files: `model.safetensors` or shards listed in
//! `model.safetensors.index.json`, memory-mapped on load and matched tensor by tensor against
//! the model's parameters; on save, the same layout (sharded above a size limit) written to
//! temporary names and renamed into place.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors, View};
use serde_json::json;
use tch::{Device, Kind, Tensor};

use crate::config::FusedWeight;
use crate::error::{Error, Result, WeightProblem};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// A memory-mapped weight file.
struct Mapped {
    path: PathBuf,
    map: memmap2::Mmap,
}

impl Mapped {
    fn open(path: PathBuf) -> Result<Self> {
        let file = std::fs::File::open(&path).map_err(Error::io(&path))?;
        // SAFETY: the map is read-only and lives only while the tensors are copied out; Keel
        // never writes a weight file in place (saves go to a temporary name and are renamed),
        // so the mapped bytes do not change under us.
        #[allow(unsafe_code)]
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(Error::io(&path))?;
        Ok(Self { path, map })
    }

    fn parse(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.map)
            .map_err(|e| Error::Safetensors { path: self.path.clone(), reason: e.to_string() })
    }
}

/// The weight files of a model directory.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join(INDEX_FILE);
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(Error::io(&index))?;
        let value: serde_json::Value = serde_json::from_str(&text).map_err(Error::json(&index))?;
        let map = value
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::Safetensors { path: index.clone(), reason: "no `weight_map` object".into() })?;
        let mut files: Vec<String> = Vec::new();
        for (name, file) in map {
            let file = file.as_str().filter(|f| is_plain_file_name(f)).ok_or_else(|| Error::Safetensors {
                path: index.clone(),
                reason: format!("weight_map entry for `{name}` is not a file name in the directory: {file}"),
            })?;
            if !files.iter().any(|f| f == file) {
                files.push(file.to_string());
            }
        }
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join(SINGLE_FILE);
    if single.is_file() { Ok(vec![single]) } else { Err(Error::NoWeights(dir.to_path_buf())) }
}

fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty() && !name.contains('/') && !name.contains('\\') && name != "." && name != ".."
}

fn kind_of(dtype: Dtype) -> Option<Kind> {
    match dtype {
        Dtype::F32 => Some(Kind::Float),
        Dtype::BF16 => Some(Kind::BFloat16),
        Dtype::F16 => Some(Kind::Half),
        _ => None,
    }
}

fn dtype_of(kind: Kind) -> Result<Dtype> {
    match kind {
        Kind::Float => Ok(Dtype::F32),
        Kind::BFloat16 => Ok(Dtype::BF16),
        Kind::Half => Ok(Dtype::F16),
        other => Err(Error::InvalidInput(format!("cannot save dtype {other:?}"))),
    }
}

/// The `torch_dtype` name of a parameter kind.
pub fn dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    }
}

/// Tensors a checkpoint may hold that the model does not use.
fn ignorable(name: &str, tied: bool) -> bool {
    name.ends_with(".rotary_emb.inv_freq") || (tied && name == "lm_head.weight")
}

/// The full shape of fused tensor `fused` whose parts are `params`' tensors.
fn fused_shape(fused: &FusedWeight, params: &HashMap<String, Tensor>) -> Option<Vec<i64>> {
    let first = params.get(&fused.parts.first()?.0)?.size();
    let rows: i64 = fused.parts.iter().map(|(_, rows)| rows).sum();
    Some(std::iter::once(rows).chain(first[1..].iter().copied()).collect())
}

/// Copies every tensor of the model directory into `params` (HF name → parameter),
/// converting dtypes; a tensor of `fused` (Phi-3's `qkv_proj`, …) is split by rows into its
/// parts. Every missing, unexpected, misshapen or wrongly typed tensor is reported, all at
/// once.
pub fn load_into(dir: &Path, params: &HashMap<String, Tensor>, tied: bool, fused: &[FusedWeight]) -> Result<()> {
    let _no_grad = tch::no_grad_guard();
    let mut problems = Vec::new();
    let mut seen = HashSet::new();
    for path in weight_files(dir)? {
        let mapped = Mapped::open(path)?;
        for (name, view) in mapped.parse()?.tensors() {
            if ignorable(&name, tied) {
                continue;
            }
            let found: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            let parts = fused.iter().find(|f| f.name == name);
            let expected = match (parts, params.get(&name)) {
                (Some(f), _) => fused_shape(f, params),
                (None, Some(param)) => Some(param.size()),
                (None, None) => None,
            };
            let Some(expected) = expected else {
                problems.push(WeightProblem::Unexpected { name });
                continue;
            };
            if found != expected {
                problems.push(WeightProblem::Shape { name, expected, found });
                continue;
            }
            let Some(kind) = kind_of(view.dtype()) else {
                problems.push(WeightProblem::Dtype { name, dtype: format!("{:?}", view.dtype()) });
                continue;
            };
            let source = Tensor::f_from_data_size(view.data(), &found, kind)?;
            match parts {
                Some(f) => {
                    let mut start = 0;
                    for (part, rows) in &f.parts {
                        params[part].shallow_clone().f_copy_(&source.f_narrow(0, start, *rows)?)?;
                        seen.insert(part.clone());
                        start += rows;
                    }
                }
                None => {
                    params[&name].shallow_clone().f_copy_(&source)?;
                    seen.insert(name);
                }
            }
        }
    }
    let mut missing: Vec<&String> = params.keys().filter(|name| !seen.contains(*name)).collect();
    missing.sort();
    problems.extend(missing.into_iter().map(|name| WeightProblem::Missing { name: name.clone() }));
    if problems.is_empty() { Ok(()) } else { Err(Error::Weights(problems)) }
}

/// Joins the parts of each of `fused` in `params` into the checkpoint's one tensor (rows in
/// order), as the Hub's files hold them.
pub(crate) fn fuse(params: &mut BTreeMap<String, Tensor>, fused: &[FusedWeight]) -> Result<()> {
    for f in fused {
        let parts = f
            .parts
            .iter()
            .map(|(name, _)| {
                params.remove(name).ok_or_else(|| Error::InvalidInput(format!("the model has no `{name}` to save")))
            })
            .collect::<Result<Vec<_>>>()?;
        params.insert(f.name.clone(), Tensor::f_cat(&parts, 0)?);
    }
    Ok(())
}

/// The weight files of a model directory, memory-mapped, for reading parts of tensors: a
/// tensor-parallel rank reads only the bytes of its rows or columns.
pub struct SliceReader {
    files: Vec<Mapped>,
    /// HF name → index of the file holding it.
    index: HashMap<String, usize>,
    /// Parameter name → (the fused tensor holding it, its first row there, that tensor's rows).
    fused: HashMap<String, (String, i64, i64)>,
}

impl std::fmt::Debug for SliceReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SliceReader").field("tensors", &self.index.len()).finish()
    }
}

impl SliceReader {
    pub fn open(dir: &Path) -> Result<Self> {
        let files = weight_files(dir)?.into_iter().map(Mapped::open).collect::<Result<Vec<_>>>()?;
        let mut index = HashMap::new();
        for (i, file) in files.iter().enumerate() {
            for name in file.parse()?.names() {
                index.insert(name.to_string(), i);
            }
        }
        Ok(Self { files, index, fused: HashMap::new() })
    }

    /// Reads the parts of `fused` tensors as tensors of their own.
    pub fn with_fused(mut self, fused: &[FusedWeight]) -> Self {
        for f in fused {
            let total = f.parts.iter().map(|(_, rows)| rows).sum();
            let mut start = 0;
            for (part, rows) in &f.parts {
                self.fused.insert(part.clone(), (f.name.clone(), start, total));
                start += rows;
            }
        }
        self
    }

    /// Rows (`dim` 0) or columns (`dim` 1, of a 2-D tensor) `start..end` of tensor `name`,
    /// whose shape must be `shape`, in its stored dtype.
    pub fn read(&self, name: &str, shape: &[i64], dim: usize, start: i64, end: i64) -> Result<Tensor> {
        if !self.index.contains_key(name)
            && let Some((fused, offset, total)) = self.fused.get(name)
            && dim == 0
            && start >= 0
            && end <= shape[0]
        {
            let full: Vec<i64> = std::iter::once(*total).chain(shape[1..].iter().copied()).collect();
            return self.read(fused, &full, 0, offset + start, offset + end);
        }
        let missing = || Error::Weights(vec![WeightProblem::Missing { name: name.into() }]);
        let file = self.files.get(*self.index.get(name).ok_or_else(missing)?).ok_or_else(missing)?;
        let tensors = file.parse()?;
        let view = tensors.tensor(name).map_err(|_| missing())?;
        let found: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        if found != shape {
            let problem = WeightProblem::Shape { name: name.into(), expected: shape.to_vec(), found };
            return Err(Error::Weights(vec![problem]));
        }
        let kind = kind_of(view.dtype()).ok_or_else(|| {
            Error::Weights(vec![WeightProblem::Dtype { name: name.into(), dtype: format!("{:?}", view.dtype()) }])
        })?;
        if dim > 1 || (dim == 1 && shape.len() != 2) || start < 0 || end > shape[dim] || start > end {
            return Err(Error::InvalidInput(format!(
                "`{name}` {shape:?}: no slice {start}..{end} along dimension {dim}"
            )));
        }
        let element = view.dtype().bitsize() / 8;
        let data = view.data();
        let mut local = shape.to_vec();
        local[dim] = end - start;
        let bytes: Vec<u8> = if dim == 0 {
            let row = shape[1..].iter().product::<i64>() as usize * element;
            data[start as usize * row..end as usize * row].to_vec()
        } else {
            let (columns, width) = (shape[1] as usize * element, (end - start) as usize * element);
            let offset = start as usize * element;
            (0..shape[0] as usize)
                .flat_map(|r| &data[r * columns + offset..r * columns + offset + width])
                .copied()
                .collect()
        };
        Ok(Tensor::f_from_data_size(&bytes, &local, kind)?)
    }
}

/// A host-resident, contiguous parameter viewed as safetensors data.
struct TensorView {
    host: Tensor,
    dtype: Dtype,
    shape: Vec<usize>,
}

impl View for TensorView {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let mut bytes = vec![0u8; self.data_len()];
        // Cannot fail: the tensor is contiguous on the host and `bytes` has exactly its size.
        let _ = self.host.f_copy_data_u8(&mut bytes, self.shape.iter().product());
        Cow::Owned(bytes)
    }

    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

/// What a save writes.
#[derive(Debug, Clone, Copy)]
pub struct SaveOptions {
    /// Shards are cut so that each holds at most this many bytes (one larger tensor gets a
    /// shard of its own).
    pub max_shard_bytes: u64,
}

impl Default for SaveOptions {
    fn default() -> Self {
        Self { max_shard_bytes: 5 << 30 }
    }
}

/// Writes `params` (HF name → tensor) as HF safetensors files in `dir` and returns the file
/// names written. Every file is written under a temporary name and synced first; then the
/// shards are renamed into place, the index last, and only then are weight files of an
/// earlier save that the new one does not use removed. A crash before the renames leaves
/// the old weights untouched. (Whole-checkpoint atomicity — a directory that appears only
/// when complete — is the checkpoint store's job.)
pub fn save(dir: &Path, params: &BTreeMap<String, Tensor>, options: SaveOptions) -> Result<Vec<String>> {
    let mut shards: Vec<Vec<(&String, &Tensor)>> = vec![Vec::new()];
    let mut shard_bytes = 0u64;
    let mut total_bytes = 0u64;
    for (name, tensor) in params {
        let bytes = tensor.numel() as u64 * tensor.kind().elt_size_in_bytes() as u64;
        let current = shards.last().map_or(0, Vec::len);
        if current > 0 && shard_bytes + bytes > options.max_shard_bytes {
            shards.push(Vec::new());
            shard_bytes = 0;
        }
        shard_bytes += bytes;
        total_bytes += bytes;
        if let Some(shard) = shards.last_mut() {
            shard.push((name, tensor));
        }
    }
    let count = shards.len();
    let file_name = |i: usize| {
        if count == 1 { SINGLE_FILE.to_string() } else { format!("model-{:05}-of-{count:05}.safetensors", i + 1) }
    };
    let mut written = Vec::new();
    let mut weight_map = serde_json::Map::new();
    for (i, shard) in shards.iter().enumerate() {
        let name = file_name(i);
        write_shard(&dir.join(format!("{name}.tmp")), shard)?;
        for (tensor, _) in shard {
            weight_map.insert((*tensor).clone(), json!(name));
        }
        written.push(name);
    }
    if count > 1 {
        let index = json!({"metadata": {"total_size": total_bytes}, "weight_map": weight_map});
        let path = dir.join(format!("{INDEX_FILE}.tmp"));
        let text = serde_json::to_string_pretty(&index).map_err(Error::json(&path))?;
        std::fs::write(&path, text).map_err(Error::io(&path))?;
        sync_file(&path)?;
        written.push(INDEX_FILE.to_string());
    }
    for name in &written {
        let (tmp, path) = (dir.join(format!("{name}.tmp")), dir.join(name));
        std::fs::rename(&tmp, &path).map_err(Error::io(&path))?;
    }
    remove_stale_weights(dir, &written)?;
    sync_dir(dir)?;
    Ok(written)
}

fn write_shard(path: &Path, shard: &[(&String, &Tensor)]) -> Result<()> {
    let views = shard
        .iter()
        .map(|(name, tensor)| {
            let shape = tensor.size().iter().map(|&d| d as usize).collect();
            let host = tensor.f_to_device(Device::Cpu)?.f_contiguous()?;
            Ok(((*name).clone(), TensorView { host, dtype: dtype_of(tensor.kind())?, shape }))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), path)
        .map_err(|e| Error::Safetensors { path: path.to_path_buf(), reason: e.to_string() })?;
    sync_file(path)
}

pub(crate) fn sync_file(path: &Path) -> Result<()> {
    std::fs::File::open(path).and_then(|f| f.sync_all()).map_err(Error::io(path))
}

pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(Error::io(dir))
}

/// Removes weight files of an earlier save that the new one does not overwrite.
fn remove_stale_weights(dir: &Path, keep: &[String]) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(Error::io(dir))?;
    for entry in entries {
        let entry = entry.map_err(Error::io(dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_weights = name == INDEX_FILE || (name.starts_with("model") && name.ends_with(".safetensors"));
        if is_weights && !keep.contains(&name) {
            std::fs::remove_file(entry.path()).map_err(Error::io(entry.path()))?;
        }
    }
    Ok(())
}
