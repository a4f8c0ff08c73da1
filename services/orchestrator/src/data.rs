//! Datasets and the dataloader. A dataset is a JSONL file or Parquet files (a Hugging Face
//! dataset's directory), their keys chosen in the spec and every other field kept as the
//! record's metadata, or the built-in arithmetic generator; all become [`Record`]s. A submit
//! only [`check`]s a dataset, a record at a time, keeping none; a run [`load`]s it. The
//! [`Dataloader`] walks the training set in a seeded order per epoch and its whole state is a
//! position ([`Position`]), saved with every checkpoint so a resumed run takes the next
//! prompts, not the same ones again.

use std::path::{Path, PathBuf};

use keel_protocol::FieldError;
use keel_protocol::reward::Message;
use keel_protocol::run::{Algorithm, ArithmeticSplit, DataKeys, DatasetSpec};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The longest JSONL line a dataset may have, in bytes (the orchestrator's
/// `max_jsonl_line_bytes`, set once at start; 8 MiB until then). A longer line is refused
/// naming it, having cost no more than this much memory.
static MAX_LINE_BYTES: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

/// The default of `max_jsonl_line_bytes`.
pub const DEFAULT_MAX_LINE_BYTES: u64 = 8 << 20;

/// Sets [`MAX_LINE_BYTES`] (the first call wins).
pub fn set_max_line_bytes(bytes: u64) {
    let _ = MAX_LINE_BYTES.set(bytes);
}

/// Reads one line (up to and with its `\n`) into `line`, refusing one longer than the limit;
/// returns the bytes read.
fn read_line(
    reader: &mut impl std::io::BufRead,
    line: &mut Vec<u8>,
    place: &str,
    at: &str,
) -> Result<usize, FieldError> {
    use std::io::{BufRead, Read};
    let limit = *MAX_LINE_BYTES.get().unwrap_or(&DEFAULT_MAX_LINE_BYTES);
    let read = reader
        .by_ref()
        .take(limit + 1)
        .read_until(b'\n', line)
        .map_err(|e| FieldError::new(at, format!("cannot read {place}: {e}")))?;
    if read as u64 > limit && line.last() != Some(&b'\n') {
        return Err(FieldError::new(
            at,
            format!("{place} is longer than {limit} bytes, the most a line may have (max_jsonl_line_bytes)"),
        ));
    }
    Ok(read)
}

/// One example, whatever the algorithm needs of it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Record {
    pub prompt: Option<String>,
    /// The ground truth an environment checks (`metadata.ground_truth`).
    pub answer: Option<String>,
    /// What SFT trains towards (the answer key's text, or the arithmetic solution written
    /// out as `\boxed{…}`).
    pub response: Option<String>,
    pub messages: Option<Vec<Message>>,
    pub chosen: Option<String>,
    pub rejected: Option<String>,
    pub task: Option<String>,
    /// Every field of the row that the keys did not consume (a `metadata` object's fields
    /// merged in), for the environment: `tests` for code, a `board` for the puzzle, whatever
    /// a reward plugin reads. The environment gets it as its `metadata`, with `ground_truth`
    /// and `task` set from their keys.
    pub metadata: serde_json::Map<String, Value>,
}

/// Where a record of a file dataset is: the byte offset of its JSONL line, or a Parquet row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Line(u64),
    Row,
}

/// A dataset as a run reads it: its records by number, without holding them. A file
/// dataset is read once through (every record checked) to find where each record is, 8
/// bytes a record, and the records a batch needs are read again from disk: a JSONL file's
/// lines where they are; a Parquet dataset's records from a JSONL copy of them written in
/// the run's scratch directory on that first pass (Parquet reads whole row groups, often the
/// whole file, so rows are not read one by one from it). The built-in generator's records
/// are made up front.
#[derive(Debug)]
pub struct Source {
    keys: DataKeys,
    field: String,
    kind: SourceKind,
}

#[derive(Debug)]
enum SourceKind {
    Memory(Vec<Record>),
    /// The dataset's own JSONL file and where each record's line starts.
    Jsonl {
        path: PathBuf,
        offsets: Vec<u64>,
    },
    /// Records as JSON lines in a file of the run's, and where each starts.
    Copied {
        path: PathBuf,
        offsets: Vec<u64>,
    },
}

impl Source {
    pub fn len(&self) -> usize {
        match &self.kind {
            SourceKind::Memory(records) => records.len(),
            SourceKind::Jsonl { offsets, .. } | SourceKind::Copied { offsets, .. } => offsets.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The records numbered `indices`, in that order (read from disk: blocking).
    pub fn records(&self, indices: &[usize]) -> Result<Vec<Record>, FieldError> {
        let at = format!("{}.path", self.field);
        let out_of_range = |i: usize| FieldError::new(&self.field, format!("record {i} is past the dataset's end"));
        let (path, offsets) = match &self.kind {
            SourceKind::Memory(records) => {
                return indices.iter().map(|&i| records.get(i).cloned().ok_or_else(|| out_of_range(i))).collect();
            }
            SourceKind::Jsonl { path, offsets } | SourceKind::Copied { path, offsets } => (path, offsets),
        };
        use std::io::Seek;
        let cannot_read = |e: std::io::Error| FieldError::new(&at, format!("cannot read {}: {e}", path.display()));
        let mut reader = std::io::BufReader::new(std::fs::File::open(path).map_err(cannot_read)?);
        let mut line = Vec::new();
        indices
            .iter()
            .map(|&i| {
                let offset = *offsets.get(i).ok_or_else(|| out_of_range(i))?;
                reader.seek(std::io::SeekFrom::Start(offset)).map_err(cannot_read)?;
                line.clear();
                let place = format!("record {} (changed since the run started?)", i + 1);
                read_line(&mut reader, &mut line, &place, &at)?;
                match &self.kind {
                    SourceKind::Copied { .. } => serde_json::from_slice(&line)
                        .map_err(|e| FieldError::new(&at, format!("{place}: {e} in {}", path.display()))),
                    _ => jsonl_record(&line, &self.keys, &at, &place),
                }
            })
            .collect()
    }
}

/// Opens a dataset for a run: every record checked for what `algorithm` needs (as at
/// submit), and where each is found ([`Source`]); a Parquet dataset's records are copied
/// into `scratch` (the run's directory). Errors name `field` (`data.train`) and the line or
/// row.
pub fn open(spec: &DatasetSpec, algorithm: Algorithm, field: &str, scratch: &Path) -> Result<Source, FieldError> {
    let (keys, kind) = match spec {
        // The built-in generator's records have every field.
        DatasetSpec::Arithmetic { size, max_operand, operations, seed, split } => {
            check_split(*max_operand, operations, *split, field)?;
            (DataKeys::default(), SourceKind::Memory(arithmetic(*size, *max_operand, operations, *seed, *split)))
        }
        DatasetSpec::Jsonl { path, keys } => {
            let mut offsets = Vec::new();
            check_each(spec, algorithm, field, |_, place| {
                if let Place::Line(offset) = place {
                    offsets.push(offset);
                }
                Ok(())
            })?;
            (keys.clone(), SourceKind::Jsonl { path: PathBuf::from(path), offsets })
        }
        DatasetSpec::Parquet { keys, .. } => {
            use std::io::Write;
            let path = scratch.join(format!("{field}.records.jsonl"));
            let cannot_write = |e: &dyn std::fmt::Display| {
                FieldError::new(field, format!("cannot copy the records to {}: {e}", path.display()))
            };
            std::fs::create_dir_all(scratch).map_err(|e| cannot_write(&e))?;
            let mut out = std::io::BufWriter::new(std::fs::File::create(&path).map_err(|e| cannot_write(&e))?);
            let (mut offsets, mut written) = (Vec::new(), 0u64);
            check_each(spec, algorithm, field, |record, _| {
                let mut line = serde_json::to_vec(&record).map_err(|e| cannot_write(&e))?;
                line.push(b'\n');
                out.write_all(&line).map_err(|e| cannot_write(&e))?;
                offsets.push(written);
                written += line.len() as u64;
                Ok(())
            })?;
            out.flush().map_err(|e| cannot_write(&e))?;
            (keys.clone(), SourceKind::Copied { path, offsets })
        }
    };
    Ok(Source { keys, field: field.to_string(), kind })
}

/// Loads a dataset whole, checking that every record has what `algorithm` needs (validation
/// sets, which are read through every time). Errors name `field` (`data.train`) and the line.
pub fn load(spec: &DatasetSpec, algorithm: Algorithm, field: &str) -> Result<Vec<Record>, FieldError> {
    match spec {
        // The built-in generator's records have every field.
        DatasetSpec::Arithmetic { size, max_operand, operations, seed, split } => {
            check_split(*max_operand, operations, *split, field)?;
            Ok(arithmetic(*size, *max_operand, operations, *seed, *split))
        }
        DatasetSpec::Jsonl { .. } | DatasetSpec::Parquet { .. } => {
            let mut records = Vec::new();
            check_each(spec, algorithm, field, |record, _| {
                records.push(record);
                Ok(())
            })?;
            Ok(records)
        }
    }
}

/// Checks a dataset as [`load`] would, record by record, keeping none: what a submit does, so
/// that checking a dataset costs no memory however many records it has.
pub fn check(spec: &DatasetSpec, algorithm: Algorithm, field: &str) -> Result<(), FieldError> {
    match spec {
        DatasetSpec::Arithmetic { max_operand, operations, split, .. } => {
            check_split(*max_operand, operations, *split, field)
        }
        DatasetSpec::Jsonl { .. } | DatasetSpec::Parquet { .. } => check_each(spec, algorithm, field, |_, _| Ok(())),
    }
}

/// Every record of a file dataset, in order, checked for what `algorithm` needs and handed
/// to `keep` with its place (which may stop the read with a problem); an empty dataset is a
/// problem.
fn check_each(
    spec: &DatasetSpec,
    algorithm: Algorithm,
    field: &str,
    mut keep: impl FnMut(Record, Place) -> Result<(), FieldError>,
) -> Result<(), FieldError> {
    let mut count = 0;
    let mut each = |record: Record, place: Place| {
        count += 1;
        lacks(algorithm, &record, count, field)?;
        keep(record, place)
    };
    match spec {
        DatasetSpec::Jsonl { path, keys } => for_each_jsonl(Path::new(path), keys, field, &mut each)?,
        DatasetSpec::Parquet { path, split, keys } => {
            for_each_parquet(Path::new(path), split.as_deref(), keys, field, &mut each)?
        }
        DatasetSpec::Arithmetic { .. } => {}
    }
    if count == 0 {
        return Err(FieldError::new(field, "the dataset has no records"));
    }
    Ok(())
}

/// The problem when record number `n` (from 1) lacks what `algorithm` needs.
fn lacks(algorithm: Algorithm, r: &Record, n: usize, field: &str) -> Result<(), FieldError> {
    let missing = match algorithm {
        Algorithm::Grpo | Algorithm::Eval => {
            (r.prompt.is_none() && r.messages.is_none()).then_some("prompt (or messages)")
        }
        Algorithm::Sft => match &r.messages {
            Some(messages) => {
                (!messages.iter().any(|m| m.role == "assistant")).then_some("an assistant turn in its messages")
            }
            None => (r.prompt.is_none() || r.response.is_none()).then_some("prompt and answer (or messages)"),
        },
        Algorithm::Dpo | Algorithm::Rm => {
            (r.prompt.is_none() || r.chosen.is_none() || r.rejected.is_none()).then_some("prompt, chosen and rejected")
        }
    };
    match missing {
        Some(missing) => Err(FieldError::new(field, format!("record {n} lacks {missing}"))),
        None => Ok(()),
    }
}

/// That some problem of the space falls in `split`.
fn check_split(max_operand: u32, operations: &str, split: ArithmeticSplit, field: &str) -> Result<(), FieldError> {
    if problems(i64::from(max_operand), operations).any(|(a, op, b)| in_split(a, op, b, split)) {
        Ok(())
    } else {
        Err(FieldError::new(format!("{field}.split"), "no problem falls in this split: raise max_operand"))
    }
}

/// What a run's validation records must hold, as the algorithm their rows are made for:
/// generation validation (GRPO, eval, SFT with environments) needs prompts only; loss
/// validation (DPO, reward models, SFT without environments) the same rows as training.
pub fn validation_algorithm(spec: &keel_protocol::run::RunSpec) -> Algorithm {
    match spec.algorithm {
        Algorithm::Dpo | Algorithm::Rm => spec.algorithm,
        Algorithm::Sft if spec.environments.is_none() => Algorithm::Sft,
        _ => Algorithm::Eval,
    }
}

/// [`open`] on a blocking thread.
pub async fn open_async(
    spec: &DatasetSpec,
    algorithm: Algorithm,
    field: &str,
    scratch: &Path,
) -> Result<Source, FieldError> {
    let (spec, field, scratch) = (spec.clone(), field.to_string(), scratch.to_path_buf());
    tokio::task::spawn_blocking(move || open(&spec, algorithm, &field, &scratch))
        .await
        .map_err(|e| FieldError::new("data", format!("reading the dataset stopped: {e}")))?
}

/// [`Source::records`] on a blocking thread.
pub async fn records_async(source: &std::sync::Arc<Source>, indices: Vec<usize>) -> Result<Vec<Record>, FieldError> {
    let source = source.clone();
    tokio::task::spawn_blocking(move || source.records(&indices))
        .await
        .map_err(|e| FieldError::new("data", format!("reading the dataset stopped: {e}")))?
}

/// [`load`] on a blocking thread (files are read and records made off the async workers).
pub async fn load_async(spec: &DatasetSpec, algorithm: Algorithm, field: &str) -> Result<Vec<Record>, FieldError> {
    off_the_workers(spec, algorithm, field, load).await
}

/// [`check`] on a blocking thread.
pub async fn check_async(spec: &DatasetSpec, algorithm: Algorithm, field: &str) -> Result<(), FieldError> {
    off_the_workers(spec, algorithm, field, check).await
}

async fn off_the_workers<T: Send + 'static>(
    spec: &DatasetSpec,
    algorithm: Algorithm,
    field: &str,
    read: fn(&DatasetSpec, Algorithm, &str) -> Result<T, FieldError>,
) -> Result<T, FieldError> {
    let (spec, field) = (spec.clone(), field.to_string());
    tokio::task::spawn_blocking(move || read(&spec, algorithm, &field))
        .await
        .map_err(|e| FieldError::new("data", format!("reading the dataset stopped: {e}")))?
}

/// Reads a JSONL file line by line, handing each record and where its line starts to `each`
/// (which may stop the read with a problem); only one line is held at a time.
fn for_each_jsonl(
    path: &Path,
    keys: &DataKeys,
    field: &str,
    mut each: impl FnMut(Record, Place) -> Result<(), FieldError>,
) -> Result<(), FieldError> {
    let at = format!("{field}.path");
    let cannot_read = |e: std::io::Error| FieldError::new(&at, format!("cannot read {}: {e}", path.display()));
    let file = std::fs::File::open(path).map_err(cannot_read)?;
    let mut reader = std::io::BufReader::new(file);
    let (mut line, mut offset) = (Vec::new(), 0u64);
    for n in 1.. {
        line.clear();
        let read = read_line(&mut reader, &mut line, &format!("line {n} of {}", path.display()), &at)?;
        if read == 0 {
            break;
        }
        let start = offset;
        offset += read as u64;
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let record = jsonl_record(&line, keys, &at, &format!("line {n}"))?;
        each(record, Place::Line(start))?;
    }
    Ok(())
}

/// A line of a JSONL file as a record; `place` names it in a problem (`line 7`).
fn jsonl_record(line: &[u8], keys: &DataKeys, at: &str, place: &str) -> Result<Record, FieldError> {
    let value: Value =
        serde_json::from_slice(line).map_err(|e| FieldError::new(at, format!("{place} is not JSON: {e}")))?;
    record_of(&value, keys, at, place)
}

/// Reads Parquet files row by row (a row group at a time), handing each record to `each`:
/// `path` itself, or the files of `split` under it ([`parquet_files`]).
fn for_each_parquet(
    path: &Path,
    split: Option<&str>,
    keys: &DataKeys,
    field: &str,
    mut each: impl FnMut(Record, Place) -> Result<(), FieldError>,
) -> Result<(), FieldError> {
    let at = format!("{field}.path");
    for file in parquet_files(path, split, field)? {
        let reader = parquet_reader(&file, &at)?;
        let groups = parquet::file::reader::FileReader::num_row_groups(&reader);
        for group in 0..groups {
            for record in parquet_group(&reader, &file, group, keys, &at)? {
                each(record?, Place::Row)?;
            }
        }
    }
    Ok(())
}

fn parquet_reader(
    file: &Path,
    at: &str,
) -> Result<parquet::file::serialized_reader::SerializedFileReader<std::fs::File>, FieldError> {
    let name = file.display();
    let opened = std::fs::File::open(file).map_err(|e| FieldError::new(at, format!("{name}: cannot read it: {e}")))?;
    parquet::file::serialized_reader::SerializedFileReader::new(opened)
        .map_err(|e| FieldError::new(at, format!("{name}: not a Parquet file: {e}")))
}

/// The records of row group `group` of `file`, in order (a problem names the row's number in
/// the file). One row group is held at a time.
fn parquet_group(
    reader: &parquet::file::serialized_reader::SerializedFileReader<std::fs::File>,
    file: &Path,
    group: usize,
    keys: &DataKeys,
    at: &str,
) -> Result<Vec<Result<Record, FieldError>>, FieldError> {
    use parquet::file::reader::FileReader;
    let bad = |e: &dyn std::fmt::Display| FieldError::new(at, format!("{}: {e}", file.display()));
    let before: usize = (0..group).map(|g| reader.metadata().row_group(g).num_rows() as usize).sum();
    let row_group = reader.get_row_group(group).map_err(|e| bad(&e))?;
    let rows = row_group.get_row_iter(None).map_err(|e| bad(&e))?;
    Ok(rows
        .enumerate()
        .map(|(n, row)| {
            let n = before + n + 1;
            let row = row.map_err(|e| bad(&format!("row {n}: {e}")))?;
            record_of(&row.to_json_value(), keys, at, &format!("{}: row {n}", file.display()))
        })
        .collect())
}

/// The Parquet files a dataset reads: `path` when it is a file; under a directory (searched
/// recursively, in name order) those of `split`, named `<split>-*.parquet` or
/// `<split>.parquet` or lying in a directory named `<split>`, as Hugging Face lays datasets
/// out. With no split, a directory must hold one split only.
fn parquet_files(path: &Path, split: Option<&str>, field: &str) -> Result<Vec<std::path::PathBuf>, FieldError> {
    let at = format!("{field}.path");
    let metadata =
        std::fs::metadata(path).map_err(|e| FieldError::new(&at, format!("cannot read {}: {e}", path.display())))?;
    if metadata.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    // A dataset's directory is small; a walk that finds more (a path such as /tmp) stops
    // with a problem rather than reading a whole disk. Linked directories are not followed.
    const MAX_DEPTH: usize = 8;
    const MAX_ENTRIES: usize = 100_000;
    let (mut all, mut seen) = (Vec::new(), 0usize);
    let mut dirs = vec![(path.to_path_buf(), 0usize)];
    while let Some((dir, depth)) = dirs.pop() {
        let entries =
            std::fs::read_dir(&dir).map_err(|e| FieldError::new(&at, format!("cannot list {}: {e}", dir.display())))?;
        for entry in entries.flatten() {
            seen += 1;
            if seen > MAX_ENTRIES {
                return Err(FieldError::new(
                    &at,
                    format!(
                        "{} holds more than {MAX_ENTRIES} entries: name the dataset's own directory",
                        path.display()
                    ),
                ));
            }
            let found = entry.path();
            match entry.file_type() {
                Ok(kind) if kind.is_dir() && depth < MAX_DEPTH => dirs.push((found, depth + 1)),
                Ok(kind) if !kind.is_dir() && found.extension().is_some_and(|e| e == "parquet") => all.push(found),
                _ => {}
            }
        }
    }
    all.sort();
    // A file's split: its name before `-` (or the whole stem), or its directory's name when
    // that is not `data` and the stem does not name one (`test/0000.parquet`).
    let split_of = |file: &Path| -> String {
        let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
        let named = stem.split('-').next().unwrap_or(stem);
        let numbered = named.chars().all(|c| c.is_ascii_digit());
        match file.parent().and_then(|p| p.file_name()).and_then(|n| n.to_str()) {
            Some(dir) if numbered && dir != "data" => dir.to_string(),
            _ => named.to_string(),
        }
    };
    let mut splits: Vec<String> = all.iter().map(|f| split_of(f)).collect();
    splits.sort();
    splits.dedup();
    let wanted = match split {
        Some(split) => split.to_string(),
        None if splits.len() == 1 => splits[0].clone(),
        None if splits.is_empty() => String::new(),
        None => {
            return Err(FieldError::new(
                format!("{field}.split"),
                format!("{} holds the splits {}: name one", path.display(), splits.join(", ")),
            ));
        }
    };
    let files: Vec<_> = all.into_iter().filter(|f| split_of(f) == wanted).collect();
    if files.is_empty() {
        let found = if splits.is_empty() {
            "no .parquet file".to_string()
        } else {
            format!("the splits {}", splits.join(", "))
        };
        return Err(FieldError::new(
            format!("{field}.split"),
            format!("{} has no Parquet files of split `{wanted}` (it holds {found})", path.display()),
        ));
    }
    Ok(files)
}

/// A record from one row (a JSON object) by `keys`: every field the keys do not consume goes
/// to its metadata (a `metadata` object's fields merged in, nulls left out). `place` names the row in errors
/// (`line 3`), `at` the spec field.
fn record_of(value: &Value, keys: &DataKeys, at: &str, place: &str) -> Result<Record, FieldError> {
    let text_of = |key: &str| -> Result<Option<String>, FieldError> {
        match value.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Number(x)) => Ok(Some(x.to_string())),
            Some(other) => Err(FieldError::new(at, format!("{place}: `{key}` must be a string, got {other}"))),
        }
    };
    let messages = match value.get(&keys.messages) {
        None | Some(Value::Null) => None,
        Some(list) => Some(serde_json::from_value::<Vec<Message>>(list.clone()).map_err(|e| {
            FieldError::new(at, format!("{place}: `{}` must be [{{role, content}}]: {e}", keys.messages))
        })?),
    };
    let answer = text_of(&keys.answer)?;
    let consumed = [&keys.prompt, &keys.answer, &keys.messages, &keys.chosen, &keys.rejected, &keys.task];
    let mut metadata = serde_json::Map::new();
    if let Value::Object(fields) = value {
        for (key, field) in fields {
            match field {
                // A null is an absent field (a Parquet column this row has no value in).
                Value::Null => {}
                _ if consumed.contains(&key) => {}
                Value::Object(inner) if key == "metadata" => {
                    metadata.extend(inner.iter().map(|(k, v)| (k.clone(), v.clone())));
                }
                _ => {
                    metadata.insert(key.clone(), field.clone());
                }
            }
        }
    }
    Ok(Record {
        prompt: text_of(&keys.prompt)?,
        response: answer.clone(),
        answer,
        messages,
        chosen: text_of(&keys.chosen)?,
        rejected: text_of(&keys.rejected)?,
        task: text_of(&keys.task)?,
        metadata,
    })
}

/// The split problem (a, op, b) falls in: a quarter each `validation` and `test`, half
/// `train`, by the splitmix64 of the problem (a fixed, well-mixed partition).
fn split_of(a: i64, op: char, b: i64) -> ArithmeticSplit {
    let mut z = (a as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (b as u64).rotate_left(29) ^ u64::from(op);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    match (z ^ (z >> 31)) % 4 {
        0 => ArithmeticSplit::Validation,
        1 => ArithmeticSplit::Test,
        _ => ArithmeticSplit::Train,
    }
}

/// Whether problem (a, op, b) is in `split` (`held_out`: validation or test).
fn in_split(a: i64, op: char, b: i64, split: ArithmeticSplit) -> bool {
    match (split, split_of(a, op, b)) {
        (ArithmeticSplit::HeldOut, found) => found != ArithmeticSplit::Train,
        (wanted, found) => wanted == found,
    }
}

/// Every problem of the space: operands 0..=max, each operation.
fn problems(max: i64, operations: &str) -> impl Iterator<Item = (i64, char, i64)> + '_ {
    (0..=max).flat_map(move |a| (0..=max).flat_map(move |b| operations.chars().map(move |op| (a, op, b))))
}

/// `What is A op B?` with its exact answer, from the requested split of the problem space:
/// `size` drawn with replacement, or with `size` 0 every problem of the split once in a
/// seeded order. The response SFT learns is `\boxed{answer}`, and the rejected answer of a
/// preference pair is off by 1 to 3.
pub fn arithmetic(size: usize, max_operand: u32, operations: &str, seed: u64, split: ArithmeticSplit) -> Vec<Record> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let ops: Vec<char> = operations.chars().collect();
    let picked: Vec<(i64, char, i64)> = if size == 0 {
        let mut all: Vec<_> =
            problems(i64::from(max_operand), operations).filter(|&(a, op, b)| in_split(a, op, b, split)).collect();
        all.shuffle(&mut rng);
        all
    } else {
        (0..size)
            .map(|_| {
                loop {
                    let a = i64::from(rng.random_range(0..=max_operand));
                    let b = i64::from(rng.random_range(0..=max_operand));
                    let op = ops[rng.random_range(0..ops.len())];
                    if in_split(a, op, b, split) {
                        break (a, op, b);
                    }
                }
            })
            .collect()
    };
    picked
        .into_iter()
        .map(|(a, op, b)| {
            let value = match op {
                '+' => a + b,
                '-' => a - b,
                _ => a * b,
            };
            let off = rng.random_range(1..=3) * if rng.random_bool(0.5) { 1 } else { -1 };
            let boxed = |v: i64| format!("\\boxed{{{v}}}");
            Record {
                prompt: Some(format!("What is {a} {op} {b}?")),
                answer: Some(value.to_string()),
                response: Some(boxed(value)),
                chosen: Some(boxed(value)),
                rejected: Some(boxed(value + off)),
                ..Record::default()
            }
        })
        .collect()
}

/// Where the dataloader is: the epoch and how many records of it were taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Position {
    pub epoch: u64,
    pub index: usize,
}

/// Seeded epochs over a dataset.
#[derive(Debug)]
pub struct Dataloader {
    len: usize,
    seed: u64,
    shuffle: bool,
    max_epochs: u64,
    position: Position,
    order: Vec<usize>,
}

impl Dataloader {
    pub fn new(len: usize, seed: u64, shuffle: bool, max_epochs: u64, position: Position) -> Self {
        let mut loader = Self { len, seed, shuffle, max_epochs, position, order: Vec::new() };
        loader.order = loader.epoch_order(position.epoch);
        loader
    }

    fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            order.shuffle(&mut ChaCha8Rng::seed_from_u64(self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        }
        order
    }

    pub fn position(&self) -> Position {
        self.position
    }

    /// The next `n` indices, crossing into the next epoch when needed; None when the
    /// epochs are used up before `n` are found (the last partial batch is dropped).
    pub fn next_batch(&mut self, n: usize) -> Option<Vec<usize>> {
        let mut out = Vec::with_capacity(n);
        let mut position = self.position;
        let mut order = None;
        while out.len() < n {
            if position.index == self.len {
                position = Position { epoch: position.epoch + 1, index: 0 };
                order = Some(self.epoch_order(position.epoch));
            }
            if position.epoch >= self.max_epochs {
                return None;
            }
            let current = order.as_ref().unwrap_or(&self.order);
            out.push(current[position.index]);
            position.index += 1;
        }
        self.position = position;
        if let Some(order) = order {
            self.order = order;
        }
        Some(out)
    }

    /// Batches of `n` the remaining epochs hold.
    pub fn batches_left(&self, n: usize) -> u64 {
        let remaining = (self.max_epochs.saturating_sub(self.position.epoch) as usize * self.len)
            .saturating_sub(self.position.index);
        (remaining / n.max(1)) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes `rows` (JSON objects) to `path` as Parquet with pyarrow, as Hugging Face's
    /// `datasets` does (snappy, nested lists and structs as Parquet lists and groups).
    fn write_parquet(path: &Path, rows: &Value) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let script = "import json, sys, pyarrow as pa, pyarrow.parquet as pq\n\
                      rows = json.loads(sys.argv[2]); keys = sorted({k for r in rows for k in r})\n\
                      pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), sys.argv[1], row_group_size=2)";
        let status = std::process::Command::new(keel_testkit::python())
            .args(["-c", script, path.to_str().unwrap(), &rows.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "pyarrow could not write {}", path.display());
    }

    #[test]
    fn parquet_files_and_hugging_face_directories_are_read_by_split() {
        let dir = tempfile::tempdir().unwrap();
        let train = serde_json::json!([
            {"question": "Q1", "answer": "1", "tests": [{"stdin": "1", "stdout": "2"}], "level": 3},
            {"question": "Q2", "answer": "2", "tests": [], "level": 1},
            {"question": "Q3", "answer": "3", "tests": [{"stdin": "", "stdout": "x"}], "level": 2},
        ]);
        write_parquet(&dir.path().join("data/train-00000-of-00002.parquet"), &train);
        let nested = serde_json::json!([
            {"question": "Q4", "answer": "4", "tests": [{"stdin": "", "stdout": "4"}]},
            {"question": "Q5", "metadata": {"tests": [{"stdin": "", "stdout": "5"}], "source": "x"}},
        ]);
        write_parquet(&dir.path().join("data/train-00001-of-00002.parquet"), &nested);
        write_parquet(
            &dir.path().join("data/test-00000-of-00001.parquet"),
            &serde_json::json!([{"question": "T1", "answer": "9"}]),
        );
        let keys = DataKeys { prompt: "question".into(), ..DataKeys::default() };
        let spec = |path: &Path, split: Option<&str>| DatasetSpec::Parquet {
            path: path.display().to_string(),
            split: split.map(str::to_string),
            keys: keys.clone(),
        };

        let records = load(&spec(dir.path(), Some("train")), Algorithm::Grpo, "data.train").unwrap();
        let prompts: Vec<_> = records.iter().map(|r| r.prompt.clone().unwrap()).collect();
        assert_eq!(prompts, ["Q1", "Q2", "Q3", "Q4", "Q5"], "every file of the split, in name order, every row group");
        // A run reads the same records by number, from their row groups.
        let source =
            open(&spec(dir.path(), Some("train")), Algorithm::Grpo, "data.train", &dir.path().join("run")).unwrap();
        assert_eq!(source.len(), 5);
        let picked = source.records(&[4, 0, 2, 3, 2]).unwrap();
        assert_eq!(picked, [&records[4], &records[0], &records[2], &records[3], &records[2]].map(Clone::clone));
        assert_eq!(
            Value::Object(records[4].metadata.clone()),
            serde_json::json!({"tests": [{"stdin": "", "stdout": "5"}], "source": "x"}),
            "a `metadata` struct's fields are merged in; a row's null columns are left out"
        );
        assert_eq!(records[1].answer.as_deref(), Some("2"));
        assert_eq!(
            Value::Object(records[0].metadata.clone()),
            serde_json::json!({"tests": [{"stdin": "1", "stdout": "2"}], "level": 3}),
            "columns the keys do not take are the metadata, lists of structs as JSON"
        );
        let test = load(&spec(dir.path(), Some("test")), Algorithm::Eval, "data.validation").unwrap();
        assert_eq!(test.len(), 1);
        let file = dir.path().join("data/test-00000-of-00001.parquet");
        assert_eq!(load(&spec(&file, None), Algorithm::Eval, "data.train").unwrap().len(), 1, "one file");
        check(&spec(dir.path(), Some("train")), Algorithm::Grpo, "data.train").unwrap();

        let problem = load(&spec(dir.path(), None), Algorithm::Grpo, "data.train").unwrap_err();
        assert_eq!(problem.field, "data.train.split");
        assert!(problem.message.contains("holds the splits test, train: name one"), "{problem}");
        let problem = check(&spec(dir.path(), Some("validation")), Algorithm::Grpo, "data.train").unwrap_err();
        assert!(problem.message.contains("no Parquet files of split `validation`"), "{problem}");
        let problem = check(&spec(dir.path(), Some("train")), Algorithm::Dpo, "data.train").unwrap_err();
        assert_eq!(problem.message, "record 1 lacks prompt, chosen and rejected");
        let not_parquet = dir.path().join("data/bad.parquet");
        std::fs::write(&not_parquet, "{}").unwrap();
        let problem = check(&spec(&not_parquet, None), Algorithm::Grpo, "data.train").unwrap_err();
        assert!(problem.field == "data.train.path" && problem.message.contains("not a Parquet file"), "{problem}");
    }

    #[test]
    fn fields_the_keys_do_not_consume_become_the_records_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("code.jsonl");
        let rows = [
            r#"{"question": "Print 2.", "solution": "print(2)", "tests": [{"stdin": "", "stdout": "2"}], "difficulty": 1}"#,
            r#"{"question": "Q", "kind": "code", "metadata": {"tests": [{"assert": "assert f()"}], "source": "x"}}"#,
        ];
        std::fs::write(&path, rows.join("\n")).unwrap();
        let keys = DataKeys {
            prompt: "question".into(),
            answer: "solution".into(),
            task: "kind".into(),
            ..DataKeys::default()
        };
        let spec = DatasetSpec::Jsonl { path: path.display().to_string(), keys };
        let records = load(&spec, Algorithm::Grpo, "data.train").unwrap();
        assert_eq!(
            Value::Object(records[0].metadata.clone()),
            serde_json::json!({"tests": [{"stdin": "", "stdout": "2"}], "difficulty": 1})
        );
        assert_eq!(records[0].answer.as_deref(), Some("print(2)"));
        assert_eq!(
            Value::Object(records[1].metadata.clone()),
            serde_json::json!({"tests": [{"assert": "assert f()"}], "source": "x"}),
            "a `metadata` object's fields are merged in"
        );
        assert_eq!(records[1].task.as_deref(), Some("code"));
    }

    /// A run reads a JSONL file's records by number from their lines (blank lines and
    /// lines without a final newline included), the same records a whole load gives.
    #[test]
    fn jsonl_records_are_read_by_number_from_their_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.jsonl");
        let lines =
            ["{\"prompt\": \"a\", \"x\": 1}", "", "  ", "{\"prompt\": \"b\"}", "{\"prompt\": \"c\", \"answer\": 3}"];
        std::fs::write(&path, lines.join("\n")).unwrap();
        let spec = DatasetSpec::Jsonl { path: path.display().to_string(), keys: DataKeys::default() };
        let whole = load(&spec, Algorithm::Grpo, "data.train").unwrap();
        let source = open(&spec, Algorithm::Grpo, "data.train", dir.path()).unwrap();
        assert_eq!(source.len(), 3);
        assert_eq!(source.records(&[2, 0, 1]).unwrap(), [whole[2].clone(), whole[0].clone(), whole[1].clone()]);
        assert_eq!(source.records(&[2]).unwrap()[0].answer.as_deref(), Some("3"));
        assert!(source.records(&[3]).is_err(), "past the end");
    }

    /// A line longer than the limit (one with no newline at all included) is refused naming
    /// it, without being read whole; the lines before it were fine.
    #[test]
    fn a_line_longer_than_the_limit_is_refused_by_number() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.jsonl");
        let long = format!("{{\"prompt\": \"{}\"}}", "x".repeat(DEFAULT_MAX_LINE_BYTES as usize));
        for tail in ["\n", ""] {
            std::fs::write(&path, format!("{{\"prompt\": \"a\"}}\n{long}{tail}")).unwrap();
            let spec = DatasetSpec::Jsonl { path: path.display().to_string(), keys: DataKeys::default() };
            let refused = load(&spec, Algorithm::Grpo, "data.train").unwrap_err();
            assert_eq!(refused.field, "data.train.path");
            assert!(
                refused.message.contains("line 2") && refused.message.contains("max_jsonl_line_bytes"),
                "{refused}"
            );
        }
        let fits = format!("{{\"prompt\": \"{}\"}}\n", "x".repeat(DEFAULT_MAX_LINE_BYTES as usize - 20));
        std::fs::write(&path, fits).unwrap();
        let spec = DatasetSpec::Jsonl { path: path.display().to_string(), keys: DataKeys::default() };
        assert_eq!(load(&spec, Algorithm::Grpo, "data.train").unwrap().len(), 1);
    }

    #[test]
    fn a_resumed_loader_continues_where_it_stopped() {
        let mut whole = Dataloader::new(10, 7, true, 3, Position::default());
        let first: Vec<Vec<usize>> = (0..4).map(|_| whole.next_batch(4).unwrap()).collect();
        let mut head = Dataloader::new(10, 7, true, 3, Position::default());
        head.next_batch(4).unwrap();
        head.next_batch(4).unwrap();
        let mut resumed = Dataloader::new(10, 7, true, 3, head.position());
        assert_eq!(resumed.next_batch(4).unwrap(), first[2]);
        assert_eq!(resumed.next_batch(4).unwrap(), first[3]);
    }

    #[test]
    fn every_epoch_visits_every_record_once() {
        let mut loader = Dataloader::new(6, 1, true, 2, Position::default());
        let mut seen: Vec<usize> = (0..3).flat_map(|_| loader.next_batch(4).unwrap()).collect();
        assert_eq!(loader.next_batch(4), None, "two epochs of 6 hold three batches of 4");
        let mut epoch0 = seen.drain(..6).collect::<Vec<_>>();
        epoch0.sort_unstable();
        assert_eq!(epoch0, (0..6).collect::<Vec<_>>());
        assert_ne!(seen[..4], loader.epoch_order(0)[..4], "epoch 1 is shuffled differently");
    }

    /// The splits never share a problem; `size: 0` lists each problem of its split once;
    /// validation and test are each about a quarter of the space.
    #[test]
    fn arithmetic_splits_are_disjoint_and_listed_whole() {
        let prompts = |split| -> Vec<String> {
            arithmetic(0, 20, "+-", 7, split).into_iter().map(|r| r.prompt.unwrap()).collect()
        };
        let (train, validation, test) =
            (prompts(ArithmeticSplit::Train), prompts(ArithmeticSplit::Validation), prompts(ArithmeticSplit::Test));
        let held_out = prompts(ArithmeticSplit::HeldOut);
        assert_eq!(train.len() + validation.len() + test.len(), 21 * 21 * 2, "every problem in one split");
        assert_eq!(held_out.len(), validation.len() + test.len());
        for (name, split) in [("validation", &validation), ("test", &test)] {
            assert!((180..=260).contains(&split.len()), "{name} has {} problems", split.len());
            let distinct: std::collections::HashSet<_> = split.iter().collect();
            assert_eq!(distinct.len(), split.len(), "{name} lists each problem once");
            assert!(split.iter().all(|p| !train.contains(p)), "{name} shares nothing with train");
        }
        assert!(validation.iter().all(|p| !test.contains(p)), "validation and test are disjoint");
        assert_ne!(
            prompts(ArithmeticSplit::Test),
            arithmetic(0, 20, "+-", 8, ArithmeticSplit::Test)
                .into_iter()
                .map(|r| r.prompt.unwrap())
                .collect::<Vec<_>>(),
            "the order follows the seed"
        );
    }

    #[test]
    fn arithmetic_answers_are_right() {
        let train = arithmetic(300, 30, "+-*", 3, ArithmeticSplit::Train);
        let held_out = arithmetic(100, 30, "+-*", 3, ArithmeticSplit::HeldOut);
        let prompts: std::collections::HashSet<_> = train.iter().map(|r| r.prompt.clone()).collect();
        assert!(held_out.iter().all(|r| !prompts.contains(&r.prompt)), "held-out problems never appear in train");
        for r in train.into_iter().chain(held_out) {
            let prompt = r.prompt.unwrap();
            let parts: Vec<&str> = prompt.trim_start_matches("What is ").trim_end_matches('?').split(' ').collect();
            let (a, b): (i64, i64) = (parts[0].parse().unwrap(), parts[2].parse().unwrap());
            let want = match parts[1] {
                "+" => a + b,
                "-" => a - b,
                _ => a * b,
            };
            assert_eq!(r.answer.unwrap(), want.to_string());
            assert_ne!(r.chosen, r.rejected);
        }
    }
}
