//! Exports into shared memory: the buckets written as files of a directory on the trainer's
//! host (`/dev/shm`), renamed into view once whole; the newest few kept.

use super::*;

/// Exports in shared memory that stay untouched after a newer one (a generator may still be
/// loading them).
const KEPT_EXPORTS: usize = 3;

/// An export into shared memory under way: the buckets go into a hidden directory that is
/// renamed `export-<time>` when every bucket is written. The three newest exports are kept
/// (a generator may still be loading the previous one); the files of a fourth are written
/// over by the next export, whose pages they already have.
pub(super) struct SharedExport {
    dir: std::path::PathBuf,
    pub(super) partial: std::path::PathBuf,
    export: std::path::PathBuf,
}

/// A file operation of a shared-memory export failed.
#[derive(Debug, thiserror::Error)]
#[error("{}: {source}", path.display())]
pub(super) struct FileError {
    path: std::path::PathBuf,
    source: std::io::Error,
}

fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> FileError + '_ {
    move |source| FileError { path: path.to_path_buf(), source }
}

impl SharedExport {
    pub(super) fn begin(dir: std::path::PathBuf) -> std::result::Result<Self, FileError> {
        // The directory the runs' directories are in (`/dev/shm/keel-weights`) is every
        // user's, as /tmp is: the worker that makes it makes it writable by all, sticky.
        if let Some(shared) = dir.parent()
            && !shared.exists()
        {
            std::fs::create_dir_all(shared).map_err(io(shared))?;
            let _ = std::fs::set_permissions(shared, std::fs::Permissions::from_mode(0o1777));
        }
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let export = dir.join(format!("export-{nanos:032}"));
        let partial = dir.join(format!(".partial-{nanos:032}"));
        let mut exports = Self::exports(&dir)?;
        let reused = exports.len() > KEPT_EXPORTS && std::fs::rename(exports.remove(0), &partial).is_ok();
        if !reused {
            std::fs::create_dir(&partial).map_err(io(&partial))?;
        }
        Ok(Self { dir, partial, export })
    }

    /// The finished exports in `dir`, oldest first.
    fn exports(dir: &std::path::Path) -> std::result::Result<Vec<std::path::PathBuf>, FileError> {
        let mut exports: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
            .map_err(io(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("export-")))
            .collect();
        exports.sort();
        Ok(exports)
    }

    pub(super) fn finish(
        self,
        files: Vec<keel_model::packing::FileBucket>,
    ) -> std::result::Result<Vec<WeightBucket>, FileError> {
        std::fs::rename(&self.partial, &self.export).map_err(io(&self.export))?;
        let buckets = files
            .into_iter()
            .map(|f| {
                let name = f.path.file_name().map(std::path::PathBuf::from).unwrap_or_default();
                WeightBucket {
                    at: BucketAt::File(self.export.join(name).to_string_lossy().into_owned()),
                    bytes: f.bytes,
                    tensors: f.entries,
                }
            })
            .collect();
        // Kept: the newest few, and one more whose files the next export reuses.
        for old in Self::exports(&self.dir)?.iter().rev().skip(KEPT_EXPORTS + 1) {
            if let Err(e) = std::fs::remove_dir_all(old) {
                warn!("cannot remove the old export {}: {e}", old.display());
            }
        }
        Ok(buckets)
    }
}

impl Drop for SharedExport {
    /// An export that failed midway leaves nothing behind.
    fn drop(&mut self) {
        if self.partial.exists() {
            let _ = std::fs::remove_dir_all(&self.partial);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The directory of the runs' shared-memory exports is made writable by every user
    /// (sticky, as /tmp) by the worker that makes it; one that was there is left as it is.
    #[test]
    fn the_directory_of_shared_exports_is_every_users() {
        let root = tempfile::tempdir().unwrap();
        let mode = |path: &std::path::Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o7777;
        SharedExport::begin(root.path().join("keel-weights/run-1")).unwrap();
        assert_eq!(mode(&root.path().join("keel-weights")), 0o1777);
        let own = root.path().join("own");
        std::fs::create_dir(&own).unwrap();
        std::fs::set_permissions(&own, std::fs::Permissions::from_mode(0o755)).unwrap();
        SharedExport::begin(own.join("run-1")).unwrap();
        assert_eq!(mode(&own), 0o755);
    }

    /// Exports in shared memory: the three newest stay as written, and the next export
    /// writes over the files of the fourth.
    #[test]
    fn shared_exports_keep_the_newest_three_and_reuse_the_one_before() {
        let dir = tempfile::tempdir().unwrap();
        let bucket = "bucket-00000.bin";
        for i in 0..6u8 {
            let export = SharedExport::begin(dir.path().to_path_buf()).unwrap();
            let reused = export.partial.join(bucket).exists();
            assert_eq!(reused, i >= 4, "export {i} reuses the files of the fourth newest");
            std::fs::write(export.partial.join(bucket), [i; 8]).unwrap();
            let file = keel_model::packing::FileBucket { path: export.partial.join(bucket), bytes: 8, entries: vec![] };
            let buckets = export.finish(vec![file]).unwrap();
            let BucketAt::File(file) = &buckets[0].at else { panic!("a shared-memory export's bucket is a file") };
            assert_eq!(std::fs::read(file).unwrap(), [i; 8]);
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let exports = SharedExport::exports(dir.path()).unwrap();
        let contents: Vec<u8> = exports.iter().map(|e| std::fs::read(e.join(bucket)).unwrap()[0]).collect();
        assert_eq!(contents, [2, 3, 4, 5], "the newest three and the one to reuse, oldest first");
        let partials = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with(".partial"));
        assert_eq!(partials.count(), 0, "no partial export is left behind");
    }
}
