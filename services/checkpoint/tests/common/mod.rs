//! Test support: a database of the test's own on the real Postgres (dropped afterwards), a
//! blob directory, a NATS subject prefix, and the service's routes on a free port.

#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;

use keel_protocol::checkpoint::FileEntry;
use sha2::{Digest, Sha256};

pub struct Stack {
    pub url: String,
    pub root: PathBuf,
    pub prefix: String,
    pub database: keel_testkit::TestDatabase,
    pub checkpoints: keel_checkpoint::service::Checkpoints,
    _dir: tempfile::TempDir,
}

impl Stack {
    pub async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("blobs");
        Self::start_with(dir, root, 16).await
    }

    /// The store's blobs under `root` (inside `dir`, which the stack keeps).
    pub async fn start_with(dir: tempfile::TempDir, root: PathBuf, max_uploads: usize) -> Self {
        let database = keel_testkit::TestDatabase::new("keel_ckpt");
        let prefix = format!("test.{}", uuid::Uuid::new_v4().simple());
        let mut config = keel_checkpoint::default_config();
        config.database_url = database.url.clone();
        config.storage = keel_checkpoint::Storage::Local { root: root.clone() };
        config.subject_prefix = prefix.clone();
        config.max_uploads = max_uploads;
        let checkpoints = keel_checkpoint::open(&config).await.unwrap();
        let app = keel_checkpoint::api::routes(checkpoints.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(keel_service::serve(listener, app, std::future::pending()));
        Self { url, root, prefix, database, checkpoints, _dir: dir }
    }

    /// Stored blob files (what is on disk under `blobs/`).
    pub fn blob_count(&self) -> usize {
        count_files(&self.root.join("blobs"))
    }

    pub fn staging_count(&self) -> usize {
        count_files(&self.root.join("staging"))
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // Each test's event stream goes with it, so streams do not pile up on the shared NATS.
        let stream = keel_protocol::Subjects::new(&self.prefix).unwrap().checkpoint_stream();
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async {
                if let Ok(client) = keel_service::nats::connect(&keel_service::nats::default_url()).await {
                    let _ = async_nats::jetstream::new(client).delete_stream(&stream).await;
                }
            })
        })
        .join();
    }
}

fn count_files(dir: &std::path::Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries.filter_map(Result::ok).map(|e| if e.path().is_dir() { count_files(&e.path()) } else { 1 }).sum()
}

pub fn sha256(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

pub fn entry(path: &str, content: &[u8]) -> FileEntry {
    FileEntry { path: path.into(), sha256: sha256(content), size: content.len() as u64 }
}
