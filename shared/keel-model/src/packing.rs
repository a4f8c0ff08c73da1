//! Weights as buckets of raw bytes, for refits that travel in memory rather than through
//! files: a model's parameters (by Hugging Face name) packed in name order into buffers of
//! at most a bucket size (a tensor larger than that gets a bucket of its own), and back.
//! Bytes are the tensors' native little-endian layout in one dtype.

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

/// Where one tensor is in its bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub shape: Vec<i64>,
    pub offset: u64,
    pub bytes: u64,
}

/// One bucket: its bytes and the tensors in them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    pub bytes: Vec<u8>,
    pub entries: Vec<Entry>,
}

/// Packs `tensors` (any float dtype and device) cast to `kind` into buckets of at most
/// `bucket_bytes` each.
pub fn pack(tensors: &[(String, Tensor)], kind: Kind, bucket_bytes: u64) -> Result<Vec<Bucket>> {
    let mut buckets: Vec<Bucket> = Vec::new();
    for (name, tensor) in tensors {
        let host = tensor.f_to_device(Device::Cpu)?.f_to_kind(kind)?.f_contiguous()?;
        let numel = host.numel();
        let size = (numel * kind.elt_size_in_bytes()) as u64;
        let fits = buckets.last().is_some_and(|b| b.bytes.len() as u64 + size <= bucket_bytes);
        if !fits {
            buckets.push(Bucket { bytes: Vec::new(), entries: Vec::new() });
        }
        let Some(bucket) = buckets.last_mut() else { unreachable!("a bucket was just pushed") };
        let offset = bucket.bytes.len();
        bucket.bytes.resize(offset + size as usize, 0);
        host.f_copy_data_u8(&mut bucket.bytes[offset..], numel)?;
        bucket.entries.push(Entry { name: name.clone(), shape: host.size(), offset: offset as u64, bytes: size });
    }
    Ok(buckets)
}

/// The tensors of one bucket, as `kind` on the CPU; an entry outside the bytes, or whose
/// size does not match its shape, is an error naming it.
pub fn unpack(bytes: &[u8], entries: &[Entry], kind: Kind) -> Result<Vec<(String, Tensor)>> {
    entries
        .iter()
        .map(|e| {
            let numel: i64 = e.shape.iter().product();
            let expected = numel as u64 * kind.elt_size_in_bytes() as u64;
            let end = e.offset.checked_add(e.bytes).filter(|&end| end <= bytes.len() as u64);
            match end {
                Some(end) if e.bytes == expected => {
                    let data = &bytes[e.offset as usize..end as usize];
                    Ok((e.name.clone(), Tensor::f_from_data_size(data, &e.shape, kind)?))
                }
                _ => Err(Error::InvalidInput(format!(
                    "`{}`: {} bytes at {} do not hold a {:?} tensor of shape {:?} in a bucket of {} bytes",
                    e.name,
                    e.bytes,
                    e.offset,
                    kind,
                    e.shape,
                    bytes.len()
                ))),
            }
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
}
