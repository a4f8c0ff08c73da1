//! A refit's weights, wherever the export left them ([`BucketAt`]): objects of the object
//! store, files in shared memory, a range of the trainer's GPU memory (CUDA IPC), or what
//! the trainer sends over a communicator ([`collective`]); and the answer to the
//! orchestrator that announced them.

mod collective;

pub use collective::WeightLinks;

use keel_generation::backend::Weights;
use keel_protocol::generator::{BucketAt, WeightsLoaded, WeightsUpdated};
use tracing::warn;

use crate::error::Error;

/// Answers the orchestrator that published `update` with a reply subject: the version now
/// served, or why it is not.
pub async fn report_refit(
    client: &async_nats::Client,
    to: async_nats::Subject,
    update: &WeightsUpdated,
    arrived: std::time::Instant,
    refit: &crate::Result<f64>,
    dtype: &str,
) {
    let report = WeightsLoaded {
        run_id: update.run_id.clone(),
        version: update.version,
        seconds: arrived.elapsed().as_secs_f64(),
        dtype: Some(dtype.to_string()),
        error: refit.as_ref().err().map(ToString::to_string),
    };
    let body = serde_json::to_vec(&report).unwrap_or_default();
    if let Err(e) = client.publish(to, body.into()).await {
        warn!(version = update.version, "cannot report the refit: {e}");
    }
}

/// A weight bucket's bytes from the object store, the shared-memory file it is in, its
/// copy out of the trainer's GPU memory (CUDA IPC; made on the blocking pool), or what the
/// trainer sent over a communicator.
enum Fetched {
    Bytes(Vec<u8>),
    File(String),
    Device,
    Received(tch::Tensor),
}

/// The weights a refit names: fetched from the object store (all buckets, every tensor
/// checked) when it carries them in memory, else its directory inside the path roots.
/// Nothing reaches the model until every bucket is here. Objects are fetched here; making
/// tensors of them, mapping shared-memory files and copying buckets out of the trainer's GPU
/// memory run on the blocking pool. Buckets the trainer sends over a communicator (kept in
/// `links` for the next refit) arrive on `device`, all of them before any other is fetched.
pub async fn new_weights(
    client: &async_nats::Client,
    roots: &keel_service::paths::PathRoots,
    update: &WeightsUpdated,
    device: tch::Device,
    links: &WeightLinks,
) -> crate::Result<Weights> {
    let Some(weights) = &update.weights else {
        return Ok(Weights::Dir(roots.check("path", &update.path)?));
    };
    let kind = keel_model::device::parse_kind(&weights.dtype)?;
    let mut stores: std::collections::HashMap<String, keel_service::nats::Bulk> = std::collections::HashMap::new();
    let mut received = collective::receive(client, links, &weights.buckets, device).await?.into_iter();
    let mut fetched = Vec::with_capacity(weights.buckets.len());
    for bucket in &weights.buckets {
        fetched.push(match &bucket.at {
            BucketAt::Object(object) => {
                if !stores.contains_key(&object.bucket) {
                    let store = keel_service::nats::Bulk::open(client.clone(), &object.bucket).await?;
                    stores.insert(object.bucket.clone(), store);
                }
                let bytes = stores[&object.bucket].get(object).await?;
                if bytes.len() as u64 != bucket.bytes {
                    return Err(Error::BucketSize {
                        name: object.name.clone(),
                        got: bytes.len(),
                        expected: bucket.bytes,
                    });
                }
                Fetched::Bytes(bytes)
            }
            BucketAt::File(file) => Fetched::File(file.clone()),
            BucketAt::CudaIpc(_) => Fetched::Device,
            BucketAt::Collective(_) => Fetched::Received(received.next().ok_or(Error::BucketMissing)?),
        });
    }
    let lora = match &weights.lora {
        Some(lora) => Some((lora.scale, roots.check("lora.base", &lora.base)?)),
        None => None,
    };
    let (buckets, roots) = (weights.buckets.clone(), roots.clone());
    tokio::task::spawn_blocking(move || {
        // Every bucket in GPU memory copied at once: each allocation is mapped once.
        let shared: Vec<_> = buckets.iter().filter_map(|b| b.at.cuda_ipc().map(|ipc| (ipc, b.bytes))).collect();
        let mut copies = keel_model::cuda::ipc::fetch(&shared)?.into_iter();
        let mut tensors = std::collections::HashMap::new();
        for (bucket, bytes) in buckets.iter().zip(fetched) {
            let unpacked = match bytes {
                Fetched::Bytes(bytes) => keel_model::packing::unpack(&bytes, &bucket.tensors, kind),
                Fetched::Received(flat) => keel_model::packing::unpack_tensor(&flat, &bucket.tensors, kind),
                Fetched::Device => match copies.next() {
                    Some(copy) => keel_model::packing::unpack_tensor(&copy, &bucket.tensors, kind),
                    None => return Err(Error::BucketMissing),
                },
                // A file in shared memory is mapped, not read: its bytes are copied once,
                // into the model.
                Fetched::File(file) => {
                    let path = roots.check("file", &file)?;
                    keel_model::packing::unpack_file(&path, bucket.bytes, &bucket.tensors, kind)
                }
            };
            for (name, tensor) in unpacked? {
                if tensors.insert(name.clone(), tensor).is_some() {
                    return Err(Error::DuplicateTensor(name));
                }
            }
        }
        Ok(match lora {
            Some((scale, base)) => Weights::Adapters { tensors, scale, base },
            None => Weights::Tensors(tensors),
        })
    })
    .await
    .map_err(|e| Error::Task("unpacking the weights", e))?
}
