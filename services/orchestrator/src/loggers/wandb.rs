//! W&B: offline run files, as `wandb offline` writes them for `wandb sync`.

use std::collections::BTreeMap;

use keel_protocol::run::RunStatus;

use super::MetricsLogger;
use std::io::Write;
use std::path::{Path, PathBuf};

use keel_protocol::run::WandbSpec;
use prost::Message as _;
use serde_json::{Value, json};

use super::tensorboard::wall_time;

/// W&B's offline run files (`wandb_enabled`), as `wandb offline` writes them for `wandb
/// sync` to upload later: `<log_dir>/<run id>/wandb/offline-run-<time>-<id>/run-<id>.wandb`,
/// W&B's record log (LevelDB's block framing, 32 KiB blocks, CRC-32 over each chunk's type
/// and bytes) of `wandb_internal.Record` protobufs: a header, the run (project, name, tags,
/// the run spec as its config), a history row and a summary per step, the exit.
#[derive(Debug)]
pub struct Wandb {
    path: PathBuf,
    file: std::fs::File,
    /// Bytes written so far (where the next chunk starts in its block).
    offset: u64,
    /// The next record's number.
    num: i64,
    id: String,
    started: std::time::Instant,
    /// The step being gathered (W&B keeps one row per step) and its metrics.
    pending: Option<(u64, BTreeMap<String, f64>)>,
    summary: BTreeMap<String, f64>,
}

/// A record: one field of many is set.
#[derive(Clone, PartialEq, prost::Message)]
struct WandbRecord {
    #[prost(int64, tag = "1")]
    num: i64,
    #[prost(message, optional, tag = "2")]
    history: Option<WandbHistory>,
    #[prost(message, optional, tag = "3")]
    summary: Option<WandbItems>,
    #[prost(message, optional, tag = "17")]
    run: Option<WandbRun>,
    #[prost(message, optional, tag = "18")]
    exit: Option<WandbExit>,
    #[prost(message, optional, tag = "21")]
    header: Option<WandbHeader>,
    #[prost(message, optional, tag = "200")]
    info: Option<WandbInfo>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WandbInfo {
    #[prost(string, tag = "1")]
    stream_id: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WandbHeader {
    #[prost(message, optional, tag = "1")]
    version_info: Option<WandbVersion>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WandbVersion {
    #[prost(string, tag = "1")]
    producer: String,
    #[prost(string, tag = "2")]
    min_consumer: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WandbRun {
    #[prost(string, tag = "1")]
    run_id: String,
    #[prost(string, tag = "2")]
    entity: String,
    #[prost(string, tag = "3")]
    project: String,
    #[prost(message, optional, tag = "4")]
    config: Option<WandbItems>,
    #[prost(string, tag = "8")]
    display_name: String,
    #[prost(string, repeated, tag = "10")]
    tags: Vec<String>,
    #[prost(message, optional, tag = "17")]
    start_time: Option<WandbTimestamp>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WandbTimestamp {
    #[prost(int64, tag = "1")]
    seconds: i64,
    #[prost(int32, tag = "2")]
    nanos: i32,
}

/// History, summary and config items alike: a key and its value as JSON.
#[derive(Clone, PartialEq, prost::Message)]
struct WandbItem {
    #[prost(string, tag = "1")]
    key: String,
    #[prost(string, tag = "16")]
    value_json: String,
}

/// A summary's or a config's items (`update`, field 1).
#[derive(Clone, PartialEq, prost::Message)]
struct WandbItems {
    #[prost(message, repeated, tag = "1")]
    update: Vec<WandbItem>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WandbHistory {
    #[prost(message, repeated, tag = "1")]
    item: Vec<WandbItem>,
    #[prost(message, optional, tag = "2")]
    step: Option<WandbStep>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WandbStep {
    #[prost(int64, tag = "1")]
    num: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WandbExit {
    #[prost(int32, tag = "1")]
    exit_code: i32,
    #[prost(int32, tag = "2")]
    runtime: i32,
}

/// W&B's record log: blocks of this size; a chunk header (CRC, length, type) takes 7 bytes.
const WANDB_BLOCK: u64 = 32 << 10;
const WANDB_CHUNK_HEADER: u64 = 7;

/// `YYYYMMDD_HHMMSS` in UTC for `seconds` since the Unix epoch, as W&B names run folders.
fn utc_stamp(seconds: u64) -> String {
    keel_tokenizer::chat::format_utc(seconds as i64, "%Y%m%d_%H%M%S").unwrap_or_default()
}

/// A metric's value as JSON (non-finite values as W&B's own `NaN` / `Infinity`).
fn json_number(value: f64) -> String {
    match value {
        v if v.is_nan() => "NaN".into(),
        v if v.is_infinite() => if v > 0.0 { "Infinity" } else { "-Infinity" }.into(),
        v => serde_json::Number::from_f64(v).map_or_else(|| "null".into(), |n| n.to_string()),
    }
}

fn items<'a>(values: impl IntoIterator<Item = (&'a String, &'a f64)>) -> Vec<WandbItem> {
    values.into_iter().map(|(key, value)| WandbItem { key: key.clone(), value_json: json_number(*value) }).collect()
}

impl Wandb {
    /// A new offline run in `dir` (`<dir>/wandb/offline-run-…`) for Keel run `run_id`: its
    /// W&B id is the first 8 characters of Keel's; `config` is the run spec.
    pub fn create(dir: &Path, run_id: &str, spec: &WandbSpec, name: &str, config: &Value) -> std::io::Result<Self> {
        let id: String = run_id.chars().filter(char::is_ascii_alphanumeric).take(8).collect::<String>().to_lowercase();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let stamp = utc_stamp(now.as_secs());
        let run_dir = dir.join("wandb").join(format!("offline-run-{stamp}-{id}"));
        std::fs::create_dir_all(run_dir.join("files"))?;
        let path = run_dir.join(format!("run-{id}.wandb"));
        let mut file = std::fs::OpenOptions::new().create_new(true).write(true).open(&path)?;
        // ":W&B", the magic 0xBEE1 (little-endian) and version 0.
        file.write_all(&[0x3a, 0x57, 0x26, 0x42, 0xe1, 0xbe, 0x00])?;
        let mut writer = Self {
            path,
            file,
            offset: 7,
            num: 0,
            id: id.clone(),
            started: std::time::Instant::now(),
            pending: None,
            summary: BTreeMap::new(),
        };
        let version =
            WandbVersion { producer: format!("keel {}", env!("CARGO_PKG_VERSION")), min_consumer: String::new() };
        writer
            .append(WandbRecord { header: Some(WandbHeader { version_info: Some(version) }), ..Default::default() })?;
        let config = match config {
            Value::Object(fields) => fields
                .iter()
                .map(|(key, value)| WandbItem { key: key.clone(), value_json: json!({"value": value}).to_string() })
                .collect(),
            _ => Vec::new(),
        };
        let run = WandbRun {
            run_id: id,
            entity: spec.entity.clone().unwrap_or_default(),
            project: spec.project.clone().unwrap_or_else(|| "keel".into()),
            config: Some(WandbItems { update: config }),
            display_name: spec.name.clone().unwrap_or_else(|| name.to_string()),
            tags: spec.tags.clone(),
            start_time: Some(WandbTimestamp { seconds: now.as_secs() as i64, nanos: now.subsec_nanos() as i32 }),
        };
        writer.append(WandbRecord { run: Some(run), ..Default::default() })?;
        Ok(writer)
    }

    /// `metrics` of `step`: gathered into the step's row, written when a later step comes
    /// (W&B keeps one row per step) or at the end.
    pub fn write(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> std::io::Result<()> {
        match &mut self.pending {
            Some((pending, row)) if *pending == step => row.extend(metrics.iter().map(|(k, v)| (k.clone(), *v))),
            _ => {
                self.flush_row()?;
                self.pending = Some((step, metrics.clone()));
            }
        }
        Ok(())
    }

    /// The gathered row as a history record (with W&B's `_step`, `_runtime` and
    /// `_timestamp`), then the summary of every metric's latest value.
    fn flush_row(&mut self) -> std::io::Result<()> {
        let Some((step, row)) = self.pending.take() else { return Ok(()) };
        self.summary.extend(row.iter().map(|(k, v)| (k.clone(), *v)));
        let runtime = self.started.elapsed().as_secs_f64();
        let mut history = items(&row);
        history.push(WandbItem { key: "_step".into(), value_json: step.to_string() });
        for (key, value) in [("_runtime", runtime), ("_timestamp", wall_time())] {
            history.push(WandbItem { key: key.into(), value_json: json_number(value) });
        }
        let record = WandbHistory { item: history, step: Some(WandbStep { num: step as i64 }) };
        self.append(WandbRecord { history: Some(record), ..Default::default() })?;
        let mut summary = items(&self.summary);
        summary.push(WandbItem { key: "_step".into(), value_json: step.to_string() });
        summary.push(WandbItem { key: "_runtime".into(), value_json: json_number(runtime) });
        self.append(WandbRecord { summary: Some(WandbItems { update: summary }), ..Default::default() })
    }

    /// The last row and the exit record: code 0 when the run succeeded, 1 otherwise.
    pub fn finish(&mut self, succeeded: bool) -> std::io::Result<()> {
        self.flush_row()?;
        let exit =
            WandbExit { exit_code: if succeeded { 0 } else { 1 }, runtime: self.started.elapsed().as_secs() as i32 };
        self.append(WandbRecord { exit: Some(exit), ..Default::default() })
    }

    /// One record, numbered and stamped with the run's id, in as many chunks as the blocks
    /// it crosses need; flushed to the file.
    fn append(&mut self, mut record: WandbRecord) -> std::io::Result<()> {
        self.num += 1;
        record.num = self.num;
        record.info = Some(WandbInfo { stream_id: self.id.clone() });
        let data = record.encode_to_vec();
        let mut out = Vec::with_capacity(data.len() + 64);
        let mut rest: &[u8] = &data;
        let mut first = true;
        loop {
            let left = WANDB_BLOCK - self.offset % WANDB_BLOCK;
            if left < WANDB_CHUNK_HEADER {
                // Too little room for a chunk header: the block is padded with zeros.
                out.extend(std::iter::repeat_n(0u8, left as usize));
                self.offset += left;
                continue;
            }
            let room = (left - WANDB_CHUNK_HEADER) as usize;
            let (chunk, after) = rest.split_at(rest.len().min(room));
            let last = after.is_empty();
            // FULL, FIRST, MIDDLE, LAST.
            let kind: u8 = match (first, last) {
                (true, true) => 1,
                (true, false) => 2,
                (false, false) => 3,
                (false, true) => 4,
            };
            let mut crc = crc32fast::Hasher::new();
            crc.update(&[kind]);
            crc.update(chunk);
            out.extend_from_slice(&crc.finalize().to_le_bytes());
            out.extend_from_slice(&(chunk.len() as u16).to_le_bytes());
            out.push(kind);
            out.extend_from_slice(chunk);
            self.offset += WANDB_CHUNK_HEADER + chunk.len() as u64;
            rest = after;
            first = false;
            if last {
                break;
            }
        }
        self.file.write_all(&out)?;
        self.file.flush()
    }
}

impl MetricsLogger for Wandb {
    fn describe(&self) -> String {
        format!("W&B ({})", self.path.display())
    }

    fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> std::io::Result<()> {
        self.write(step, metrics)
    }

    /// The last row and the exit (code 0 for a run that succeeded).
    fn finish(&mut self, status: RunStatus) -> std::io::Result<()> {
        Wandb::finish(self, status == RunStatus::Succeeded)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// W&B folder names are the UTC time as `YYYYMMDD_HHMMSS`.
    #[test]
    fn wandb_stamps_are_utc_dates() {
        assert_eq!(utc_stamp(0), "19700101_000000");
        assert_eq!(utc_stamp(951_782_400), "20000229_000000");
        assert_eq!(utc_stamp(1_795_687_529), "20261126_100529");
        assert_eq!(utc_stamp(4_102_444_799), "20991231_235959");
    }

    /// The records of a W&B file, read back by the framing's rules: each chunk inside its
    /// block, its CRC-32 over type and bytes, FIRST/MIDDLE/LAST joined.
    fn wandb_records(path: &Path) -> Vec<WandbRecord> {
        let data = std::fs::read(path).unwrap();
        assert_eq!(&data[..7], &[0x3a, 0x57, 0x26, 0x42, 0xe1, 0xbe, 0x00]);
        let (mut at, mut joined, mut records) = (7usize, Vec::new(), Vec::new());
        while at < data.len() {
            let left = WANDB_BLOCK as usize - at % WANDB_BLOCK as usize;
            if left < 7 {
                assert!(data[at..at + left].iter().all(|b| *b == 0), "padding at {at}");
                at += left;
                continue;
            }
            let crc = u32::from_le_bytes(data[at..at + 4].try_into().unwrap());
            let length = u16::from_le_bytes(data[at + 4..at + 6].try_into().unwrap()) as usize;
            let kind = data[at + 6];
            assert!(7 + length <= left, "a chunk crosses a block boundary at {at}");
            let chunk = &data[at + 7..at + 7 + length];
            let mut hasher = crc32fast::Hasher::new();
            hasher.update(&[kind]);
            hasher.update(chunk);
            assert_eq!(hasher.finalize(), crc, "CRC at {at}");
            joined.extend_from_slice(chunk);
            if kind == 1 || kind == 4 {
                records.push(WandbRecord::decode(joined.as_slice()).unwrap());
                joined.clear();
            }
            at += 7 + length;
        }
        assert!(joined.is_empty(), "the file ends inside a record");
        records
    }

    #[test]
    fn wandb_files_frame_records_across_blocks_and_keep_a_row_per_step() {
        let dir = tempfile::tempdir().unwrap();
        // A config larger than two blocks: its record spans three.
        let config = json!({"name": "r", "notes": "x".repeat(70_000)});
        let spec = WandbSpec { project: Some("p".into()), tags: vec!["grpo".into()], ..WandbSpec::default() };
        let mut wandb = Wandb::create(dir.path(), "0a1b2c3d-4e5f-6789", &spec, "run-name", &config).unwrap();
        wandb.write(0, &BTreeMap::from([("validation/accuracy".to_string(), 0.25)])).unwrap();
        wandb.write(1, &BTreeMap::from([("train/loss".to_string(), 1.5)])).unwrap();
        wandb.write(1, &BTreeMap::from([("validation/accuracy".to_string(), f64::NAN)])).unwrap();
        wandb.finish(true).unwrap();
        let path = wandb.path.clone();
        assert!(path.parent().unwrap().file_name().unwrap().to_str().unwrap().starts_with("offline-run-"));
        assert!(path.parent().unwrap().file_name().unwrap().to_str().unwrap().ends_with("-0a1b2c3d"));
        assert_eq!(path.file_name().unwrap(), "run-0a1b2c3d.wandb");
        let records = wandb_records(&path);
        assert_eq!(records.iter().map(|r| r.num).collect::<Vec<_>>(), (1..=7).collect::<Vec<i64>>());
        assert!(records.iter().all(|r| r.info.as_ref().unwrap().stream_id == "0a1b2c3d"));
        assert!(records[0].header.is_some());
        let run = records[1].run.as_ref().unwrap();
        assert_eq!(
            (run.run_id.as_str(), run.project.as_str(), run.display_name.as_str()),
            ("0a1b2c3d", "p", "run-name")
        );
        assert_eq!(run.tags, ["grpo"]);
        let notes = run.config.as_ref().unwrap().update.iter().find(|i| i.key == "notes").unwrap();
        assert_eq!(serde_json::from_str::<Value>(&notes.value_json).unwrap()["value"].as_str().unwrap().len(), 70_000);
        let rows: Vec<(i64, BTreeMap<String, String>)> = records
            .iter()
            .filter_map(|r| r.history.as_ref())
            .map(|h| {
                let items = h.item.iter().map(|i| (i.key.clone(), i.value_json.clone())).collect();
                (h.step.as_ref().unwrap().num, items)
            })
            .collect();
        assert_eq!(rows.len(), 2, "one row per step");
        assert_eq!(rows[0].1["validation/accuracy"], "0.25");
        assert_eq!(rows[1].1["train/loss"], "1.5");
        assert_eq!(rows[1].1["validation/accuracy"], "NaN");
        assert_eq!(rows[1].1["_step"], "1");
        assert!(records[3].summary.is_some() && records[5].summary.is_some());
        assert_eq!(records[6].exit.as_ref().unwrap().exit_code, 0);
    }
}
