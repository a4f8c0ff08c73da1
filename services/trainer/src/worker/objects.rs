//! Exports into the object store: each bucket an object of the run's bulk bucket.

use super::*;

/// Each bucket an object of the bulk bucket; on a failure the ones stored are deleted.
pub(super) async fn store_objects(
    bulk: &Bulk,
    packed: Vec<keel_model::packing::Bucket>,
) -> std::result::Result<Vec<WeightBucket>, keel_service::BulkError> {
    let mut buckets: Vec<WeightBucket> = Vec::with_capacity(packed.len());
    for bucket in packed {
        match bulk.put(&bucket.bytes).await {
            Ok(object) => buckets.push(WeightBucket {
                at: BucketAt::Object(object),
                bytes: bucket.bytes.len() as u64,
                tensors: bucket.entries,
            }),
            Err(e) => {
                for stored in buckets.iter().filter_map(|b| b.at.object()) {
                    let _ = bulk.delete(stored).await;
                }
                return Err(e);
            }
        }
    }
    Ok(buckets)
}
