//! `keel checkpoint`: list a run's checkpoints, upload a directory as a checkpoint, download
//! one as an HF directory (every file verified against its sha256, the directory appearing
//! only when complete), or export it as a tar file. Talks to the checkpoint service's REST
//! API (`--url`, default `KEEL_CHECKPOINT_URL` or http://127.0.0.1:8083).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use futures::StreamExt;
use keel_protocol::checkpoint::{Checkpoint, CreateCheckpoint, FileEntry, check_path};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

#[derive(Debug, Subcommand)]
pub enum CheckpointCommand {
    /// A run's complete checkpoints.
    List {
        #[command(flatten)]
        service: Service,
        #[arg(long)]
        run: String,
    },
    /// Uploads a directory (an HF model directory, a trainer checkpoint) as a checkpoint.
    Upload(UploadArgs),
    /// Downloads a checkpoint as a directory, every file verified.
    Download {
        #[command(flatten)]
        service: Service,
        id: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// Writes a checkpoint as one tar file.
    Export {
        #[command(flatten)]
        service: Service,
        id: String,
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Debug, Args)]
pub struct Service {
    /// The checkpoint service.
    #[arg(long, env = "KEEL_CHECKPOINT_URL", default_value = "http://127.0.0.1:8083")]
    url: String,
}

#[derive(Debug, Args)]
pub struct UploadArgs {
    #[command(flatten)]
    service: Service,
    dir: PathBuf,
    #[arg(long)]
    run: String,
    #[arg(long)]
    step: u64,
    /// A metric, `name=value` (repeatable).
    #[arg(long = "metric")]
    metrics: Vec<String>,
}

pub fn run(command: CheckpointCommand) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        match command {
            CheckpointCommand::List { service, run } => list(&service.url, &run).await,
            CheckpointCommand::Upload(args) => upload(args).await,
            CheckpointCommand::Download { service, id, out } => download(&service.url, &id, &out).await,
            CheckpointCommand::Export { service, id, out } => export(&service.url, &id, &out).await,
        }
    })
}

/// The response, or its `{"error": {...}}` message as the error.
async fn checked(response: reqwest::Response, what: &str) -> anyhow::Result<reqwest::Response> {
    if response.status().is_success() {
        return Ok(response);
    }
    let status = response.status();
    let body: serde_json::Value = response.json().await.unwrap_or_default();
    let message = body["error"]["message"].as_str().unwrap_or("no details");
    bail!("{what}: {status}: {message}")
}

async fn list(url: &str, run: &str) -> anyhow::Result<()> {
    let response = reqwest::Client::new().get(format!("{url}/v1/checkpoints")).query(&[("run_id", run)]).send().await?;
    let checkpoints: Vec<Checkpoint> = checked(response, "list").await?.json().await?;
    for c in checkpoints {
        let size: u64 = c.files.iter().map(|f| f.size).sum();
        println!("{}  step {:>6}  {:>12} bytes  {}", c.id, c.step, size, serde_json::to_string(&c.metrics)?);
    }
    Ok(())
}

/// Every regular file under `dir`, relative, sorted; hidden entries (`.gitattributes`,
/// `.cache/`) are left out and symbolic links are not followed.
fn files_under(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next).with_context(|| format!("cannot read {}", next.display()))? {
            let entry = entry?;
            if entry.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            let kind = entry.file_type()?;
            if kind.is_dir() {
                pending.push(entry.path());
            } else if kind.is_file() {
                out.push(entry.path().strip_prefix(dir)?.to_path_buf());
            }
        }
    }
    out.sort();
    Ok(out)
}

fn sha256_file(path: &Path) -> anyhow::Result<(String, u64)> {
    let mut file = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((hex::encode(hasher.finalize()), size))
}

async fn upload(args: UploadArgs) -> anyhow::Result<()> {
    let mut metrics = BTreeMap::new();
    for m in &args.metrics {
        let (name, value) = m.split_once('=').with_context(|| format!("--metric `{m}`: expected name=value"))?;
        metrics.insert(name.to_string(), value.parse::<f64>().with_context(|| format!("--metric `{m}`"))?);
    }
    let dir = args.dir.clone();
    let files = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<FileEntry>> {
        files_under(&dir)?
            .into_iter()
            .map(|rel| {
                let (sha256, size) = sha256_file(&dir.join(&rel))?;
                Ok(FileEntry { path: rel.to_string_lossy().into_owned(), sha256, size })
            })
            .collect()
    })
    .await??;
    let client = reqwest::Client::new();
    let url = &args.service.url;
    let request = CreateCheckpoint {
        run_id: args.run,
        step: args.step,
        metrics,
        info: serde_json::Value::Null,
        files,
        retention: None,
    };
    let response = client.post(format!("{url}/v1/checkpoints")).json(&request).send().await?;
    let created: Checkpoint = checked(response, "create").await?.json().await?;
    // Only files listed here are ever read, whatever the service names as missing.
    for path in request.files.iter().map(|f| &f.path).filter(|p| created.missing.contains(p)) {
        let file = tokio::fs::File::open(args.dir.join(path)).await?;
        let body = reqwest::Body::wrap_stream(tokio_util_stream(file));
        let response =
            client.put(format!("{url}/v1/checkpoints/{}/files/{path}", created.id)).body(body).send().await?;
        checked(response, &format!("upload {path}")).await?;
    }
    let response = client.post(format!("{url}/v1/checkpoints/{}/commit", created.id)).send().await?;
    let committed: Checkpoint = checked(response, "commit").await?.json().await?;
    println!("{}", committed.id);
    Ok(())
}

/// A file as a stream of 1 MiB chunks.
fn tokio_util_stream(file: tokio::fs::File) -> impl futures::Stream<Item = std::io::Result<bytes::Bytes>> {
    futures::stream::unfold(file, |mut file| async move {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; 1 << 20];
        match file.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(bytes::Bytes::from(buf)), file))
            }
            Err(e) => Some((Err(e), file)),
        }
    })
}

async fn download(url: &str, id: &str, out: &Path) -> anyhow::Result<()> {
    if out.exists() {
        bail!("{} exists already", out.display());
    }
    let client = reqwest::Client::new();
    let response = client.get(format!("{url}/v1/checkpoints/{id}")).send().await?;
    let checkpoint: Checkpoint = checked(response, "get").await?.json().await?;
    if checkpoint.status != "complete" {
        bail!("checkpoint {id} is not committed");
    }
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let staging = tempfile::Builder::new().prefix(".keel-download-").tempdir_in(parent)?;
    for file in &checkpoint.files {
        check_path(&file.path).map_err(|e| anyhow::anyhow!("the service sent a bad file name: {e}"))?;
        let target = staging.path().join(&file.path);
        if let Some(dir) = target.parent() {
            tokio::fs::create_dir_all(dir).await?;
        }
        let response = client.get(format!("{url}/v1/checkpoints/{id}/files/{}", file.path)).send().await?;
        let mut body = checked(response, &format!("download {}", file.path)).await?.bytes_stream();
        let mut writer = tokio::io::BufWriter::with_capacity(1 << 20, tokio::fs::File::create(&target).await?);
        let mut hasher = Sha256::new();
        while let Some(chunk) = body.next().await {
            let chunk = chunk?;
            hasher.update(&chunk);
            writer.write_all(&chunk).await?;
        }
        writer.flush().await?;
        writer.get_ref().sync_all().await?;
        let sha = hex::encode(hasher.finalize());
        if sha != file.sha256 {
            bail!("{} arrived with sha256 {sha}, expected {}", file.path, file.sha256);
        }
    }
    let staged = staging.keep();
    std::fs::rename(&staged, out).with_context(|| format!("cannot move the download to {}", out.display()))?;
    println!("{}", out.display());
    Ok(())
}

async fn export(url: &str, id: &str, out: &Path) -> anyhow::Result<()> {
    let response = reqwest::Client::new().get(format!("{url}/v1/checkpoints/{id}/archive")).send().await?;
    let mut body = checked(response, "export").await?.bytes_stream();
    let partial = out.with_extension("tar.partial");
    let mut writer = tokio::io::BufWriter::with_capacity(1 << 20, tokio::fs::File::create(&partial).await?);
    while let Some(chunk) = body.next().await {
        writer.write_all(&chunk?).await?;
    }
    writer.flush().await?;
    writer.get_ref().sync_all().await?;
    std::fs::rename(&partial, out)?;
    println!("{}", out.display());
    Ok(())
}
