//! Content-addressed blobs on any `object_store` backend: the local file system by default,
//! an S3-compatible bucket with the `s3` feature. A blob lives at `blobs/<aa>/<sha256>`, so
//! identical files are stored once. Uploads stream into `staging/<uuid>` while being hashed,
//! and only content whose hash was verified is moved to its blob path; a failed upload's
//! staging object is removed (and any left by a crash are swept at start-up).

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt, WriteMultipart};
use sha2::{Digest, Sha256};

/// Bytes buffered per part of a multipart write (memory per upload is about twice this).
const PART_BYTES: usize = 8 << 20;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The body was larger than declared.
    #[error("the upload is larger than the declared {0} bytes")]
    TooLarge(u64),
    /// The client's body stream failed (the connection dropped).
    #[error("the upload was interrupted: {0}")]
    Interrupted(String),
    /// The storage is full.
    #[error("the checkpoint storage is full")]
    Full,
    #[error("storage: {0}")]
    Backend(String),
}

fn backend(e: object_store::Error) -> StoreError {
    let text = e.to_string();
    if text.contains("No space left") || text.contains("os error 28") {
        StoreError::Full
    } else {
        StoreError::Backend(text)
    }
}

/// Content written to staging and hashed, not yet a blob.
#[derive(Debug)]
pub struct Staged {
    path: ObjectPath,
    pub sha256: String,
    pub size: u64,
}

#[derive(Clone)]
pub struct BlobStore {
    store: Arc<dyn ObjectStore>,
    /// The directory of a local store (its unfinished uploads are files `list` does not show).
    local_root: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for BlobStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlobStore({})", self.store)
    }
}

impl BlobStore {
    pub fn new(store: Arc<dyn ObjectStore>) -> Self {
        Self { store, local_root: None }
    }

    /// Blobs under a local directory (created when missing), written durably (fsync).
    pub fn local(root: &std::path::Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(root)
            .map_err(|e| StoreError::Backend(format!("cannot create {}: {e}", root.display())))?;
        let fs = object_store::local::LocalFileSystem::new_with_prefix(root)
            .map_err(|e| StoreError::Backend(format!("cannot use {}: {e}", root.display())))?
            .with_fsync(true);
        Ok(Self { store: Arc::new(fs), local_root: Some(root.to_path_buf()) })
    }

    fn blob_path(sha256: &str) -> ObjectPath {
        ObjectPath::from(format!("blobs/{}/{sha256}", &sha256[..2]))
    }

    /// Streams `body` into staging, hashing it; refuses more than `limit` bytes.
    pub async fn stage<E: std::fmt::Display>(
        &self,
        body: impl Stream<Item = Result<Bytes, E>>,
        limit: u64,
    ) -> Result<Staged, StoreError> {
        let path = ObjectPath::from(format!("staging/{}", uuid::Uuid::new_v4()));
        let upload = self.store.put_multipart(&path).await.map_err(backend)?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
        let mut hasher = Sha256::new();
        let mut size = 0u64;
        futures::pin_mut!(body);
        let result = async {
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(|e| StoreError::Interrupted(e.to_string()))?;
                size += chunk.len() as u64;
                if size > limit {
                    return Err(StoreError::TooLarge(limit));
                }
                hasher.update(&chunk);
                writer.wait_for_capacity(2).await.map_err(backend)?;
                writer.put(chunk);
            }
            Ok(())
        }
        .await;
        match result {
            Ok(()) => {
                writer.finish().await.map_err(backend)?;
                Ok(Staged { path, sha256: hex::encode(hasher.finalize()), size })
            }
            Err(e) => {
                let _ = writer.abort().await;
                Err(e)
            }
        }
    }

    /// Makes verified staged content the blob of its hash (the same content may already be
    /// there: it is simply replaced).
    pub async fn promote(&self, staged: &Staged) -> Result<(), StoreError> {
        self.store.rename(&staged.path, &Self::blob_path(&staged.sha256)).await.map_err(backend)
    }

    pub async fn discard(&self, staged: Staged) {
        if let Err(e) = self.store.delete(&staged.path).await {
            tracing::warn!(path = %staged.path, "cannot remove a staged upload: {e}");
        }
    }

    /// The blob's bytes, or a byte range of them.
    pub async fn get(
        &self,
        sha256: &str,
        range: Option<Range<u64>>,
    ) -> Result<BoxStream<'static, Result<Bytes, StoreError>>, StoreError> {
        if let Some(root) = &self.local_root {
            return read_local(root.join(Self::blob_path(sha256).as_ref()), range).await;
        }
        let options = GetOptions { range: range.map(GetRange::Bounded), ..GetOptions::default() };
        let result = self.store.get_opts(&Self::blob_path(sha256), options).await.map_err(backend)?;
        Ok(result.into_stream().map_err(backend).boxed())
    }

    pub async fn delete(&self, sha256: &str) -> Result<(), StoreError> {
        match self.store.delete(&Self::blob_path(sha256)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(backend(e)),
        }
    }

    /// Removes staging objects older than `age` (uploads a crash left behind).
    pub async fn sweep_staging(&self, age: Duration) -> Result<usize, StoreError> {
        let cutoff = std::time::SystemTime::now().checked_sub(age).unwrap_or(std::time::UNIX_EPOCH);
        if let Some(root) = &self.local_root {
            // Unfinished local uploads are `staging/<id>#<n>` files, which listing hides.
            let dir = root.join("staging");
            let sweep = move || -> std::io::Result<usize> {
                let mut removed = 0;
                let Ok(entries) = std::fs::read_dir(&dir) else { return Ok(0) };
                for entry in entries.filter_map(Result::ok) {
                    if entry.metadata()?.modified()? < cutoff {
                        std::fs::remove_file(entry.path())?;
                        removed += 1;
                    }
                }
                Ok(removed)
            };
            return tokio::task::spawn_blocking(sweep)
                .await
                .map_err(|e| StoreError::Backend(e.to_string()))?
                .map_err(|e| StoreError::Backend(e.to_string()));
        }
        let prefix = ObjectPath::from("staging");
        let stale: Vec<ObjectPath> = self
            .store
            .list(Some(&prefix))
            .try_filter(|m| futures::future::ready(std::time::SystemTime::from(m.last_modified) < cutoff))
            .map_ok(|m| m.location)
            .try_collect()
            .await
            .map_err(backend)?;
        for path in &stale {
            self.store.delete(path).await.map_err(backend)?;
        }
        Ok(stale.len())
    }
}

/// Bytes read per step from a local blob. `object_store`'s local reader reads 8 KiB at a
/// time; reading 1 MiB at a time made downloads several times faster (bench/checkpoint-throughput).
const READ_BYTES: usize = 1 << 20;

/// A local blob (or a range of it) as a stream of [`READ_BYTES`] chunks.
async fn read_local(
    path: std::path::PathBuf,
    range: Option<Range<u64>>,
) -> Result<BoxStream<'static, Result<Bytes, StoreError>>, StoreError> {
    use tokio::io::{AsyncReadExt, AsyncSeekExt};
    let mut file =
        tokio::fs::File::open(&path).await.map_err(|e| StoreError::Backend(format!("{}: {e}", path.display())))?;
    let length = file.metadata().await.map_err(|e| StoreError::Backend(e.to_string()))?.len();
    let range = range.unwrap_or(0..length);
    file.seek(std::io::SeekFrom::Start(range.start)).await.map_err(|e| StoreError::Backend(e.to_string()))?;
    let left = range.end.saturating_sub(range.start);
    let stream = futures::stream::try_unfold((file, left), |(mut file, left)| async move {
        if left == 0 {
            return Ok(None);
        }
        let mut buf = vec![0u8; READ_BYTES.min(left as usize)];
        let n = file.read(&mut buf).await.map_err(|e| StoreError::Backend(e.to_string()))?;
        if n == 0 {
            return Err(StoreError::Backend("the blob is shorter than recorded".into()));
        }
        buf.truncate(n);
        Ok(Some((Bytes::from(buf), (file, left - n as u64))))
    });
    Ok(stream.boxed())
}
