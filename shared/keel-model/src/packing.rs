//! Weights as buckets of raw bytes, for refits that travel in memory rather than through
//! files: a model's parameters (by Hugging Face name) packed in name order into buffers of
//! at most a bucket size (a tensor larger than that gets a bucket of its own), and back.
//! Bytes are the tensors' native little-endian layout in one dtype.

use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

/// Where one tensor is in its bucket: the wire type, so buckets travel as they are packed.
pub use keel_protocol::generator::PackedTensor as Entry;

/// One bucket: its bytes and the tensors in them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    pub bytes: Vec<u8>,
    pub entries: Vec<Entry>,
}

/// One bucket written as a file: its path, size and the tensors in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileBucket {
    pub path: PathBuf,
    pub bytes: u64,
    pub entries: Vec<Entry>,
}

/// Buckets in memory or in files.
#[derive(Debug)]
pub enum Packed {
    Memory(Vec<Bucket>),
    Files(Vec<FileBucket>),
    Device(DeviceBuckets),
}

/// Where an export packs its buckets: buffers in host memory, files written in place in a
/// directory (shared memory), one buffer on the weights' own GPU (for CUDA IPC), or one
/// buffer on the weights' own device, whichever it is (for the collective transfer).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PackTarget {
    #[default]
    Memory,
    Files(PathBuf),
    Device,
    Buffer,
}

/// Buckets as ranges of one flat byte buffer on a device (a GPU's memory, for CUDA IPC).
#[derive(Debug)]
pub struct DeviceBuckets {
    pub buffer: Tensor,
    /// Per bucket: its offset in `buffer`, its size and the tensors in it.
    pub buckets: Vec<(u64, u64, Vec<Entry>)>,
}

/// Where buckets start in a device buffer: at multiples of this, as CUDA allocations do.
const DEVICE_ALIGN: u64 = 256;

impl Default for Packed {
    fn default() -> Self {
        Self::Memory(Vec::new())
    }
}

/// The buckets `tensors` fill at `kind` and `bucket_bytes`: per bucket, its size and each
/// tensor's index with its entry. A tensor larger than a bucket gets one of its own.
fn layout(tensors: &[(String, Tensor)], kind: Kind, bucket_bytes: u64) -> Vec<(u64, Vec<(usize, Entry)>)> {
    let mut buckets: Vec<(u64, Vec<(usize, Entry)>)> = Vec::new();
    for (index, (name, tensor)) in tensors.iter().enumerate() {
        let size = (tensor.numel() * kind.elt_size_in_bytes()) as u64;
        let fits = buckets.last().is_some_and(|(used, _)| used + size <= bucket_bytes);
        if !fits {
            buckets.push((0, Vec::new()));
        }
        let Some((used, entries)) = buckets.last_mut() else { unreachable!("a bucket was just pushed") };
        entries.push((index, Entry { name: name.clone(), shape: tensor.size(), offset: *used, bytes: size }));
        *used += size;
    }
    buckets
}

/// Packs `tensors` (any float dtype and device) cast to `kind` into buckets of at most
/// `bucket_bytes` each.
pub fn pack(tensors: &[(String, Tensor)], kind: Kind, bucket_bytes: u64) -> Result<Vec<Bucket>> {
    layout(tensors, kind, bucket_bytes)
        .into_iter()
        .map(|(size, placed)| {
            let mut bytes = vec![0u8; size as usize];
            for (index, entry) in &placed {
                let host = tensors[*index].1.f_to_device(Device::Cpu)?.f_to_kind(kind)?.f_contiguous()?;
                let range = entry.offset as usize..(entry.offset + entry.bytes) as usize;
                host.f_copy_data_u8(&mut bytes[range], host.numel())?;
            }
            Ok(Bucket { bytes, entries: placed.into_iter().map(|(_, e)| e).collect() })
        })
        .collect()
}

/// [`pack`] into files `bucket-NNNNN.bin` in `dir` (on a RAM-backed file system for a
/// refit through shared memory): each file is mapped and every tensor cast and copied into
/// it in one pass, with no buffer between. Files already there are written over in place
/// (their pages are reused: on tmpfs, allocating fresh ones costs as much as the copy).
pub fn pack_to_files(
    tensors: &[(String, Tensor)],
    kind: Kind,
    bucket_bytes: u64,
    dir: &Path,
) -> Result<Vec<FileBucket>> {
    let elt = kind.elt_size_in_bytes() as i64;
    layout(tensors, kind, bucket_bytes)
        .into_iter()
        .enumerate()
        .map(|(i, (size, placed))| {
            let path = dir.join(format!("bucket-{i:05}.bin"));
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(Error::io(&path))?;
            file.set_len(size).map_err(Error::io(&path))?;
            drop(file);
            let mapped = map_file(&path, true, size, kind)?;
            for (index, entry) in &placed {
                let numel = entry.bytes as i64 / elt;
                let mut slot = mapped.f_narrow(0, entry.offset as i64 / elt, numel)?.f_view(entry.shape.as_slice())?;
                slot.f_copy_(&tensors[*index].1)?;
            }
            Ok(FileBucket { path, bytes: size, entries: placed.into_iter().map(|(_, e)| e).collect() })
        })
        .collect()
}

/// [`pack`] into one flat byte buffer on `device`, bucket after bucket (each starting at a
/// multiple of 256 bytes): every tensor cast and copied on the device, nothing through host
/// memory.
pub fn pack_on_device(
    tensors: &[(String, Tensor)],
    kind: Kind,
    bucket_bytes: u64,
    device: Device,
) -> Result<DeviceBuckets> {
    let laid = layout(tensors, kind, bucket_bytes);
    let mut starts = Vec::with_capacity(laid.len());
    let mut total = 0u64;
    for (size, _) in &laid {
        starts.push(total);
        total += size.div_ceil(DEVICE_ALIGN) * DEVICE_ALIGN;
    }
    let buffer = Tensor::f_empty([total as i64], (Kind::Uint8, device))?;
    let elt = kind.elt_size_in_bytes() as i64;
    let mut buckets = Vec::with_capacity(laid.len());
    for ((size, placed), start) in laid.into_iter().zip(starts) {
        for (index, entry) in &placed {
            let bytes = buffer.f_narrow(0, (start + entry.offset) as i64, entry.bytes as i64)?;
            let mut slot = bytes.f_view_dtype(kind)?.f_view(entry.shape.as_slice())?;
            debug_assert_eq!(slot.numel() as i64 * elt, entry.bytes as i64);
            slot.f_copy_(&tensors[*index].1)?;
        }
        buckets.push((start, size, placed.into_iter().map(|(_, e)| e).collect()));
    }
    Ok(DeviceBuckets { buffer, buckets })
}

/// A file's bytes as a flat tensor of `kind` mapped from it (`shared`: writes reach the
/// file; else the mapping is private and the file only read).
fn map_file(path: &Path, shared: bool, bytes: u64, kind: Kind) -> Result<Tensor> {
    let name = path.to_str().ok_or_else(|| Error::InvalidInput(format!("{} is not UTF-8", path.display())))?;
    let numel = (bytes / kind.elt_size_in_bytes() as u64) as i64;
    if numel == 0 {
        return Ok(Tensor::f_empty([0], (kind, Device::Cpu))?);
    }
    Ok(Tensor::f_from_file(name, shared, numel, (kind, Device::Cpu))?)
}

/// Checks that `e` lies inside a bucket of `total` bytes and holds a whole tensor of
/// `kind` at an offset aligned to it; its element count.
fn check(e: &Entry, total: u64, kind: Kind) -> Result<i64> {
    let numel: i64 = e.shape.iter().product();
    let elt = kind.elt_size_in_bytes() as u64;
    let expected = numel as u64 * elt;
    let end = e.offset.checked_add(e.bytes).filter(|&end| end <= total);
    match end {
        Some(_) if e.bytes == expected && e.offset.is_multiple_of(elt) => Ok(numel),
        _ => Err(Error::InvalidInput(format!(
            "`{}`: {} bytes at {} do not hold a {:?} tensor of shape {:?} in a bucket of {} bytes",
            e.name, e.bytes, e.offset, kind, e.shape, total
        ))),
    }
}

/// The tensors of one bucket, as `kind` on the CPU; an entry outside the bytes, or whose
/// size does not match its shape, is an error naming it.
pub fn unpack(bytes: &[u8], entries: &[Entry], kind: Kind) -> Result<Vec<(String, Tensor)>> {
    entries
        .iter()
        .map(|e| {
            check(e, bytes.len() as u64, kind)?;
            let data = &bytes[e.offset as usize..(e.offset + e.bytes) as usize];
            Ok((e.name.clone(), Tensor::f_from_data_size(data, &e.shape, kind)?))
        })
        .collect()
}

/// The tensors of a bucket file of `bytes` bytes, mapped from it (nothing is copied until
/// they are copied into a model); the file must have that size. Errors as [`unpack`].
pub fn unpack_file(path: &Path, bytes: u64, entries: &[Entry], kind: Kind) -> Result<Vec<(String, Tensor)>> {
    let found = std::fs::metadata(path).map_err(Error::io(path))?.len();
    if found != bytes {
        return Err(Error::InvalidInput(format!("weight bucket {} has {found} bytes, not {bytes}", path.display())));
    }
    let numels = entries.iter().map(|e| check(e, bytes, kind)).collect::<Result<Vec<_>>>()?;
    views(&map_file(path, false, bytes, kind)?, entries, numels, kind)
}

/// The tensors of a bucket held as a flat byte tensor (on any device), as views of it. Errors
/// as [`unpack`].
pub fn unpack_tensor(flat: &Tensor, entries: &[Entry], kind: Kind) -> Result<Vec<(String, Tensor)>> {
    let bytes = flat.numel() as u64;
    let numels = entries.iter().map(|e| check(e, bytes, kind)).collect::<Result<Vec<_>>>()?;
    if flat.kind() != Kind::Uint8 || !bytes.is_multiple_of(kind.elt_size_in_bytes() as u64) {
        return Err(Error::InvalidInput(format!(
            "a bucket of {bytes} bytes ({:?}) does not hold whole {kind:?} values",
            flat.kind()
        )));
    }
    views(&flat.f_view_dtype(kind)?, entries, numels, kind)
}

/// Each entry's tensor as a view of `flat`, a bucket's values as a flat tensor of `kind`.
fn views(flat: &Tensor, entries: &[Entry], numels: Vec<i64>, kind: Kind) -> Result<Vec<(String, Tensor)>> {
    let elt = kind.elt_size_in_bytes() as i64;
    entries
        .iter()
        .zip(numels)
        .map(|(e, numel)| {
            let tensor = flat.f_narrow(0, e.offset as i64 / elt, numel)?.f_view(e.shape.as_slice())?;
            Ok((e.name.clone(), tensor))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn packed_tensors_come_back_equal_in_buckets_of_the_limit() {
        let tensors: Vec<(String, Tensor)> =
            (0..5).map(|i| (format!("t{i}"), Tensor::randn([3, 4 + i], (Kind::Float, Device::Cpu)))).collect();
        for kind in [Kind::Float, Kind::BFloat16] {
            let buckets = pack(&tensors, kind, 100).unwrap();
            assert!(buckets.len() > 1, "a limit of 100 bytes splits them");
            let mut back = Vec::new();
            for bucket in &buckets {
                back.extend(unpack(&bucket.bytes, &bucket.entries, kind).unwrap());
            }
            assert_eq!(back.len(), tensors.len());
            for ((name, original), (got_name, got)) in tensors.iter().zip(&back) {
                assert_eq!(name, got_name);
                assert!(got.equal(&original.to_kind(kind)), "{name} at {kind:?}");
            }
        }
        let buckets = pack(&tensors, Kind::Float, 1 << 20).unwrap();
        assert_eq!(buckets.len(), 1);
        let mut entries = buckets[0].entries.clone();
        entries[1].bytes += 4;
        let error = unpack(&buckets[0].bytes, &entries, Kind::Float).unwrap_err().to_string();
        assert!(error.contains("`t1`"), "{error}");
        entries[1].bytes -= 4;
        entries[4].offset = u64::MAX;
        assert!(unpack(&buckets[0].bytes, &entries, Kind::Float).is_err(), "no overflow past the end");
    }

    /// Buckets packed into one device buffer hold the bytes in-memory buckets hold, at
    /// aligned offsets, and come back equal (on the CPU here; the CUDA IPC test in
    /// `tests/cuda_ipc.rs` does the same on a GPU).
    #[test]
    fn device_buffers_hold_what_memory_buckets_hold() {
        let tensors: Vec<(String, Tensor)> =
            (0..5).map(|i| (format!("t{i}"), Tensor::randn([3, 4 + i], (Kind::Float, Device::Cpu)))).collect();
        for kind in [Kind::Float, Kind::BFloat16] {
            let device = pack_on_device(&tensors, kind, 100, Device::Cpu).unwrap();
            let memory = pack(&tensors, kind, 100).unwrap();
            assert_eq!(device.buckets.len(), memory.len());
            for ((start, size, entries), bucket) in device.buckets.iter().zip(&memory) {
                assert_eq!(start % DEVICE_ALIGN, 0);
                assert_eq!(*size, bucket.bytes.len() as u64);
                assert_eq!(entries, &bucket.entries);
                let flat = device.buffer.narrow(0, *start as i64, *size as i64);
                let mut bytes = vec![0u8; *size as usize];
                flat.copy_data_u8(&mut bytes, *size as usize);
                assert_eq!(bytes, bucket.bytes);
                for ((name, got), (_, want)) in unpack_tensor(&flat, entries, kind)
                    .unwrap()
                    .iter()
                    .zip(unpack(&bucket.bytes, &bucket.entries, kind).unwrap().iter())
                {
                    assert!(got.equal(want), "{name} at {kind:?}");
                }
            }
            let flat = device.buffer.narrow(0, 0, device.buckets[0].1 as i64 - 1);
            assert!(unpack_tensor(&flat, &device.buckets[0].2, kind).is_err(), "a short bucket is refused");
        }
    }

    /// Buckets written to files hold the bytes in-memory buckets hold, and come back equal.
    #[test]
    fn files_hold_what_memory_buckets_hold() {
        let dir = tempfile::tempdir().unwrap();
        let tensors: Vec<(String, Tensor)> =
            (0..5).map(|i| (format!("t{i}"), Tensor::randn([3, 4 + i], (Kind::Float, Device::Cpu)))).collect();
        for kind in [Kind::Float, Kind::BFloat16] {
            let out = dir.path().join(format!("{kind:?}"));
            std::fs::create_dir(&out).unwrap();
            let files = pack_to_files(&tensors, kind, 100, &out).unwrap();
            let memory = pack(&tensors, kind, 100).unwrap();
            assert_eq!(files.len(), memory.len());
            for (file, bucket) in files.iter().zip(&memory) {
                assert_eq!(std::fs::read(&file.path).unwrap(), bucket.bytes, "{}", file.path.display());
                assert_eq!(file.entries, bucket.entries);
                for ((name, got), (_, want)) in unpack_file(&file.path, file.bytes, &file.entries, kind)
                    .unwrap()
                    .iter()
                    .zip(unpack(&bucket.bytes, &bucket.entries, kind).unwrap().iter())
                {
                    assert!(got.equal(want), "{name} at {kind:?}");
                }
            }
            let error = unpack_file(&files[0].path, files[0].bytes + 1, &files[0].entries, kind).unwrap_err();
            assert!(error.to_string().contains("bytes, not"), "{error}");
        }
    }
}
