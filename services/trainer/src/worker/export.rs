//! The `export` op: the policy's weights cast and packed into buckets, left where the
//! request's `to` says (the object store, files in shared memory, or one buffer in the
//! trainer's memory for CUDA IPC or the collective transfer).

use super::objects::store_objects;
use super::shared_memory::SharedExport;
use super::*;

/// Exports in GPU memory kept (the newest, and the one before for generators still copying
/// it): each is a copy of the weights in the serving dtype on the trainer's GPU.
pub(super) const KEPT_DEVICE_EXPORTS: usize = 2;

/// Exports the policy's weights into the bulk bucket, one object per weight bucket. An
/// export that fails midway deletes what it stored.
pub(super) async fn export(shared: Arc<Shared>, request: ExportRequest) -> Answer<ExportReply> {
    let started = Instant::now();
    let kind = match &request.dtype {
        Some(name) => Some(
            keel_model::device::parse_kind(name).map_err(|e| refuse(error_types::INVALID_REQUEST, e.to_string()))?,
        ),
        None => None,
    };
    if request.bucket_bytes == 0 {
        return Err(refuse(error_types::INVALID_REQUEST, "bucket_bytes must be positive"));
    }
    let bucket_bytes = request.bucket_bytes;
    // Shared memory: the buckets are written in place into files of a fresh directory,
    // which is renamed into view once whole.
    let shared_dir = match &request.to {
        ExportTo::SharedMemory { dir } => {
            let dir = shared.roots.check("to.dir", dir).map_err(|e| refuse(error_types::INVALID_REQUEST, e))?;
            {
                let mut exports = shared.exports.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if !exports.contains(&dir) {
                    exports.push(dir.clone());
                }
            }
            let begun = tokio::task::spawn_blocking(move || SharedExport::begin(dir))
                .await
                .map_err(|e| refuse(error_types::INTERNAL, e.to_string()))?;
            Some(begun.map_err(|e| refuse(error_types::PAYLOAD, e))?)
        }
        _ => None,
    };
    let to = match (&shared_dir, &request.to) {
        (Some(export), _) => PackTarget::Files(export.partial.clone()),
        (None, ExportTo::CudaIpc) => PackTarget::Device,
        (None, ExportTo::Collective) => PackTarget::Buffer,
        (None, _) => PackTarget::Memory,
    };
    let cuda_ipc = request.to == ExportTo::CudaIpc;
    let command = shared.command(|| Command::Export { dtype: request.dtype.clone(), bucket_bytes });
    let (step, kind, packed, lora, handles) = shared
        .on_ranks(command, move |slot| {
            let trainer = loaded(slot)?;
            let lora = trainer
                .lora_base()
                .map(|base| AdapterRefit { scale: trainer.config().lora.scale(), base: base.display().to_string() });
            let (step, kind, packed) = trainer.export(kind, bucket_bytes, to)?;
            // The handles are made where the buffer was, on the engine's thread.
            let handles = match &packed {
                Packed::Device(device) if cuda_ipc => {
                    let offsets: Vec<u64> = device.buckets.iter().map(|(at, _, _)| *at).collect();
                    keel_model::cuda::ipc::share(&device.buffer, &offsets)?
                }
                _ => Vec::new(),
            };
            Ok((step, kind, packed, lora, handles))
        })
        .instrument(info_span!("export", dtype = ?request.dtype, to = ?request.to))
        .await?;
    let packing = started.elapsed().as_secs_f64();
    let buckets = match (shared_dir, packed) {
        (None, Packed::Device(device)) => {
            let id = uuid::Uuid::new_v4().simple().to_string();
            let (subject, meeting) = shared.send_subjects.clone();
            let place = keel_model::device::memory_name(device.buffer.device());
            let gpu_uuid = match device.buffer.device() {
                tch::Device::Cuda(ordinal) => keel_model::cuda::ipc::device_uuid(ordinal).ok(),
                _ => None,
            };
            let mut handles = handles.into_iter();
            let buckets = device
                .buckets
                .into_iter()
                .map(|(offset, size, entries)| {
                    let at = match handles.next() {
                        Some(handle) => BucketAt::CudaIpc(handle),
                        None => BucketAt::Collective(CollectiveBuffer {
                            export: id.clone(),
                            offset,
                            subject: subject.clone(),
                            meeting: meeting.clone(),
                            device: place.into(),
                            gpu_uuid: gpu_uuid.clone(),
                        }),
                    };
                    WeightBucket { at, bytes: size, tensors: entries }
                })
                .collect();
            let mut kept = shared.device_exports.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            kept.push_back((id, device.buffer));
            while kept.len() > KEPT_DEVICE_EXPORTS {
                kept.pop_front();
            }
            buckets
        }
        (Some(export), Packed::Files(files)) => tokio::task::spawn_blocking(move || export.finish(files))
            .await
            .map_err(|e| refuse(error_types::INTERNAL, e.to_string()))?
            .map_err(|e| refuse(error_types::PAYLOAD, e))?,
        (None, Packed::Memory(packed)) => {
            store_objects(&shared.bulk, packed).await.map_err(|e| refuse(error_types::PAYLOAD, e))?
        }
        _ => return Err(refuse(error_types::INTERNAL, "the export came back in the wrong form")),
    };
    let timing =
        Timing::from([("export_pack".to_string(), packing), ("export".to_string(), started.elapsed().as_secs_f64())]);
    let weights = WeightBuckets { dtype: keel_model::weights::dtype_name(kind).to_string(), buckets, lora };
    Ok(ExportReply { step, weights, timing })
}
