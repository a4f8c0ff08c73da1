//! TensorBoard: event files of scalars.

use std::collections::BTreeMap;

use super::MetricsLogger;
use std::io::Write;
use std::path::{Path, PathBuf};

use prost::Message as _;

/// A TensorBoard event file: TFRecord framing (length, masked CRC-32C of the length, the
/// record, masked CRC-32C of the record) around `tensorflow.Event` protobufs, the first
/// saying the file version, then one per step with a scalar per metric.
#[derive(Debug)]
pub struct TensorBoard {
    path: PathBuf,
    file: std::fs::File,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    /// Always written (a scalar of 0 included): it says which of the value kinds this is.
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

pub(super) fn wall_time() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// TFRecord's masked CRC-32C.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

impl TensorBoard {
    /// A new event file in `dir` (created), named as TensorBoard's writers name theirs.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string());
        let name = format!(
            "events.out.tfevents.{}.{}.{}.keel",
            wall_time() as u64,
            host.unwrap_or_else(|_| "host".into()),
            std::process::id()
        );
        let path = dir.join(name);
        let file = std::fs::OpenOptions::new().create_new(true).append(true).open(&path)?;
        let mut writer = Self { path, file };
        let version = Event { wall_time: wall_time(), file_version: Some("brain.Event:2".into()), ..Event::default() };
        writer.append(&version)?;
        Ok(writer)
    }

    /// One event at `step` with a scalar per metric; flushed to the file.
    pub fn write(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> std::io::Result<()> {
        let value = metrics
            .iter()
            .map(|(tag, value)| SummaryValue { tag: tag.clone(), simple_value: Some(*value as f32) })
            .collect();
        let event =
            Event { wall_time: wall_time(), step: step as i64, file_version: None, summary: Some(Summary { value }) };
        self.append(&event)
    }

    fn append(&mut self, event: &Event) -> std::io::Result<()> {
        let data = event.encode_to_vec();
        let length = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&length);
        record.extend_from_slice(&masked_crc(&length).to_le_bytes());
        record.extend_from_slice(&data);
        record.extend_from_slice(&masked_crc(&data).to_le_bytes());
        self.file.write_all(&record)?;
        self.file.flush()
    }
}

impl MetricsLogger for TensorBoard {
    fn describe(&self) -> String {
        format!("TensorBoard ({})", self.path.display())
    }

    fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> std::io::Result<()> {
        self.write(step, metrics)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The records of an event file, checked against their CRCs, decoded.
    fn read(path: &Path) -> Vec<Event> {
        let bytes = std::fs::read(path).expect("the event file");
        let mut events = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let length = &bytes[at..at + 8];
            assert_eq!(masked_crc(length), u32::from_le_bytes(bytes[at + 8..at + 12].try_into().expect("4 bytes")));
            let n = u64::from_le_bytes(length.try_into().expect("8 bytes")) as usize;
            let data = &bytes[at + 12..at + 12 + n];
            let crc = u32::from_le_bytes(bytes[at + 12 + n..at + 16 + n].try_into().expect("4 bytes"));
            assert_eq!(masked_crc(data), crc);
            events.push(Event::decode(data).expect("an event"));
            at += 16 + n;
        }
        events
    }

    #[test]
    fn an_event_file_holds_the_version_then_a_scalar_per_metric_and_step() {
        // CRC-32C's check value, and TFRecord's masking of it.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        let dir = tempfile::tempdir().expect("a directory");
        let mut writer = TensorBoard::create(dir.path()).expect("a writer");
        writer.write(0, &BTreeMap::from([("validation/accuracy".to_string(), 0.25)])).expect("written");
        writer
            .write(1, &BTreeMap::from([("train/loss".to_string(), 0.0), ("train/reward".to_string(), 1.5)]))
            .expect("written");
        let events = read(&writer.path);
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        let scalars: Vec<(i64, String, Option<f32>)> = events[1..]
            .iter()
            .flat_map(|e| {
                e.summary.iter().flat_map(move |s| s.value.iter().map(move |v| (e.step, v.tag.clone(), v.simple_value)))
            })
            .collect();
        assert_eq!(
            scalars,
            [
                (0, "validation/accuracy".into(), Some(0.25)),
                (1, "train/loss".into(), Some(0.0)),
                (1, "train/reward".into(), Some(1.5)),
            ]
        );
    }
}
