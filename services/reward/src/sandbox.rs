//! The sandbox that runs untrusted programs (the `code` environment's Python).
//!
//! Each run is a separate process tree under bubblewrap (`bwrap`), the sandbox Flatpak uses:
//! - its own network namespace (only a loopback device: no connection leaves it), PID, IPC
//!   and UTS namespaces; killed with its whole tree when the wall-clock limit passes;
//! - a filesystem of read-only system directories (`/usr` and the `/lib*`, `/bin` links, for
//!   the interpreter) and one fresh temporary directory, `/sandbox`, its working directory and
//!   the only place it can write; nothing else of the host is there (no `/etc/shadow`, no
//!   `/home`, no `/proc` of the host: the service's processes and environment are invisible),
//!   and the environment is cleared;
//! - `prlimit` limits on CPU seconds, address space, processes, file size, open files and
//!   core dumps;
//! - when the service runs as root, the program runs as an unprivileged user of its own (one
//!   uid per slot, from `first_uid`) with no capabilities and `no_new_privs`, so process limits
//!   count only its own processes. Without root, bubblewrap's user namespace maps the
//!   service's own user, and the process limit counts the service user's processes.
//!
//! At most `slots` programs run at once; further runs wait for a slot. Where bubblewrap
//! is missing or cannot create namespaces the sandbox reports itself unavailable and nothing
//! runs: there is no unsandboxed fallback.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;
use tokio::sync::{OnceCell, Semaphore};

/// The sandbox settings of the service configuration (`KEEL_REWARD__SANDBOX__...`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxConfig {
    /// The bubblewrap binary.
    pub bwrap: PathBuf,
    /// The Python interpreter inside the sandbox (it must live under a read-only directory).
    pub python: PathBuf,
    /// Host directories visible read-only (those missing are skipped).
    pub read_only: Vec<PathBuf>,
    /// Programs running at once.
    pub slots: usize,
    /// The uid of slot 0 when running as root (slot i runs as first_uid + i).
    pub first_uid: u32,
    /// Where the temporary directories are made (default: the system's).
    pub work_dir: Option<PathBuf>,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            bwrap: "/usr/bin/bwrap".into(),
            python: "/usr/bin/python3".into(),
            read_only: ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/alternatives"]
                .iter()
                .map(PathBuf::from)
                .collect(),
            slots: 8,
            first_uid: 61_000,
            work_dir: None,
        }
    }
}

impl SandboxConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.slots == 0 {
            return Err("sandbox.slots: must be at least 1".into());
        }
        if self.first_uid == 0 {
            return Err("sandbox.first_uid: must not be root".into());
        }
        if !self.python.is_absolute() {
            return Err("sandbox.python: must be an absolute path".into());
        }
        Ok(())
    }
}

/// Per-run limits.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    pub cpu_seconds: u64,
    pub wall: Duration,
    pub memory_bytes: u64,
    pub processes: u64,
    pub file_bytes: u64,
    /// Kept per stream; the rest is read and dropped.
    pub output_bytes: usize,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "value")]
pub enum Termination {
    Exited(i32),
    /// Killed by a signal (e.g. SIGXCPU or SIGKILL at the CPU limit).
    Signaled(i32),
    /// The wall-clock limit passed and the tree was killed.
    TimedOut,
}

impl Termination {
    /// bwrap's init reports a child killed by signal N as exit code 128 + N; this undoes it.
    fn unwrapped(self) -> Self {
        match self {
            Self::Exited(code) if (129..160).contains(&code) => Self::Signaled(code - 128),
            other => other,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunReport {
    pub termination: Termination,
    pub stdout: String,
    pub stderr: String,
    /// Output beyond `output_bytes` was dropped.
    pub truncated: bool,
    pub wall_seconds: f64,
}

impl RunReport {
    pub fn succeeded(&self) -> bool {
        self.termination == Termination::Exited(0)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("the sandbox is unavailable: {0}")]
    Unavailable(String),
    #[error("sandbox: {0}")]
    Io(String),
}

pub struct Sandbox {
    config: SandboxConfig,
    root: bool,
    slots: Semaphore,
    free_uids: Mutex<Vec<u32>>,
    probe: OnceCell<Result<(), String>>,
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox").field("config", &self.config).field("root", &self.root).finish()
    }
}

/// Whether this process runs as root (from `/proc/self/status`; no `unsafe` needed).
fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(1) == Some("0")))
        .unwrap_or(false)
}

impl Sandbox {
    pub fn new(config: SandboxConfig) -> Arc<Self> {
        let uids = (0..config.slots as u32).map(|i| config.first_uid + i).rev().collect();
        Arc::new(Self {
            slots: Semaphore::new(config.slots),
            free_uids: Mutex::new(uids),
            root: running_as_root(),
            probe: OnceCell::new(),
            config,
        })
    }

    /// Checks once that a sandboxed `python3 -c pass` runs; afterwards answers from memory.
    pub async fn available(&self) -> Result<(), SandboxError> {
        let probe = self
            .probe
            .get_or_init(|| async {
                if !self.config.bwrap.is_file() {
                    return Err(format!("{} not found (install bubblewrap)", self.config.bwrap.display()));
                }
                let limits = Limits {
                    cpu_seconds: 10,
                    wall: Duration::from_secs(30),
                    memory_bytes: 1 << 30,
                    processes: 16,
                    file_bytes: 1 << 20,
                    output_bytes: 4096,
                };
                match self.run_unchecked(&[("main.py", "pass\n")], "main.py", b"", &limits).await {
                    Ok(report) if report.succeeded() => Ok(()),
                    Ok(report) => {
                        Err(format!("a probe run failed: {:?}: {}", report.termination, report.stderr.trim()))
                    }
                    Err(e) => Err(e.to_string()),
                }
            })
            .await;
        probe.clone().map_err(SandboxError::Unavailable)
    }

    /// Runs `python main` in a fresh directory holding `files`, with `stdin` as input.
    pub async fn run_python(
        &self,
        files: &[(&str, &str)],
        main: &str,
        stdin: &[u8],
        limits: &Limits,
    ) -> Result<RunReport, SandboxError> {
        self.available().await?;
        self.run_unchecked(files, main, stdin, limits).await
    }

    async fn run_unchecked(
        &self,
        files: &[(&str, &str)],
        main: &str,
        stdin: &[u8],
        limits: &Limits,
    ) -> Result<RunReport, SandboxError> {
        let _permit = self.slots.acquire().await.map_err(|e| SandboxError::Io(e.to_string()))?;
        let uid = UidGuard::take(&self.free_uids)?;
        let owner = self.root.then_some(uid.0);
        let work = self.config.work_dir.clone();
        let owned: Vec<(String, String)> = files.iter().map(|(n, c)| (n.to_string(), c.to_string())).collect();
        let dir = tokio::task::spawn_blocking(move || prepare(work.as_deref(), &owned, owner))
            .await
            .map_err(|e| SandboxError::Io(e.to_string()))??;
        let mut command = self.command(dir.path(), uid.0, main, limits);
        let report = execute(&mut command, stdin, limits).await;
        tokio::task::spawn_blocking(move || drop(dir)).await.map_err(|e| SandboxError::Io(e.to_string()))?;
        report
    }

    fn command(&self, dir: &Path, uid: u32, main: &str, limits: &Limits) -> Command {
        let mut c = Command::new(&self.config.bwrap);
        c.args(["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]);
        if !self.root {
            c.args(["--unshare-user", "--uid", "1000", "--gid", "1000"]);
        }
        c.args(["--die-with-parent", "--new-session", "--clearenv"]);
        for (key, value) in
            [("PATH", "/usr/bin:/bin"), ("HOME", "/sandbox"), ("TMPDIR", "/sandbox"), ("LANG", "C.UTF-8")]
        {
            c.args(["--setenv", key, value]);
        }
        for path in &self.config.read_only {
            c.arg("--ro-bind-try").arg(path).arg(path);
        }
        c.args(["--proc", "/proc", "--dev", "/dev"]);
        c.arg("--bind").arg(dir).arg("/sandbox");
        c.args(["--chdir", "/sandbox", "--"]);
        c.arg("/usr/bin/prlimit");
        c.arg(format!("--cpu={}", limits.cpu_seconds));
        c.arg(format!("--as={}", limits.memory_bytes));
        c.arg(format!("--nproc={}", limits.processes));
        c.arg(format!("--fsize={}", limits.file_bytes));
        c.args(["--nofile=64", "--core=0", "--"]);
        if self.root {
            c.arg("/usr/bin/setpriv");
            c.arg(format!("--reuid={uid}")).arg(format!("--regid={uid}"));
            c.args(["--clear-groups", "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all", "--"]);
        }
        c.arg(&self.config.python).args(["-I", "-B", main]);
        c.env_clear().stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
        c
    }
}

/// A uid for one run, given back when dropped.
struct UidGuard<'a>(u32, &'a Mutex<Vec<u32>>);

impl<'a> UidGuard<'a> {
    fn take(pool: &'a Mutex<Vec<u32>>) -> Result<Self, SandboxError> {
        let uid = pool.lock().ok().and_then(|mut p| p.pop()).ok_or_else(|| SandboxError::Io("no free uid".into()))?;
        Ok(Self(uid, pool))
    }
}

impl Drop for UidGuard<'_> {
    fn drop(&mut self) {
        if let Ok(mut pool) = self.1.lock() {
            pool.push(self.0);
        }
    }
}

/// A fresh directory with `files`, owned by `owner` when given.
fn prepare(
    parent: Option<&Path>,
    files: &[(String, String)],
    owner: Option<u32>,
) -> Result<tempfile::TempDir, SandboxError> {
    let io = |e: std::io::Error| SandboxError::Io(format!("cannot prepare the sandbox directory: {e}"));
    let dir = match parent {
        Some(parent) => tempfile::Builder::new().prefix("keel-sandbox-").tempdir_in(parent),
        None => tempfile::Builder::new().prefix("keel-sandbox-").tempdir(),
    }
    .map_err(io)?;
    for (name, content) in files {
        if name.contains('/') || name.starts_with('.') {
            return Err(SandboxError::Io(format!("file name `{name}` must be a plain name")));
        }
        let path = dir.path().join(name);
        std::fs::write(&path, content).map_err(io)?;
        if let Some(uid) = owner {
            std::os::unix::fs::chown(&path, Some(uid), Some(uid)).map_err(io)?;
        }
    }
    if let Some(uid) = owner {
        std::os::unix::fs::chown(dir.path(), Some(uid), Some(uid)).map_err(io)?;
    }
    Ok(dir)
}

/// Reads all of `reader`, keeping the first `keep` bytes.
async fn read_capped(mut reader: impl AsyncRead + Unpin, keep: usize) -> (Vec<u8>, bool) {
    let mut kept = Vec::new();
    let mut truncated = false;
    let mut buf = vec![0u8; 16 * 1024];
    while let Ok(n) = reader.read(&mut buf).await {
        if n == 0 {
            break;
        }
        let room = keep.saturating_sub(kept.len());
        kept.extend_from_slice(&buf[..n.min(room)]);
        truncated |= n > room;
    }
    (kept, truncated)
}

async fn execute(command: &mut Command, stdin: &[u8], limits: &Limits) -> Result<RunReport, SandboxError> {
    let started = Instant::now();
    let mut child = command.spawn().map_err(|e| SandboxError::Unavailable(format!("cannot start bwrap: {e}")))?;
    let (Some(mut input), Some(stdout), Some(stderr)) = (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        return Err(SandboxError::Io("the sandbox's pipes are missing".into()));
    };
    let input_bytes = stdin.to_vec();
    // A program that never reads its input must not block the run: write in the background.
    let writer = tokio::spawn(async move {
        let _ = input.write_all(&input_bytes).await;
    });
    let out = tokio::spawn(read_capped(stdout, limits.output_bytes));
    let err = tokio::spawn(read_capped(stderr, limits.output_bytes));
    let termination = match tokio::time::timeout(limits.wall, child.wait()).await {
        Ok(Ok(status)) => match (status.code(), status.signal()) {
            (Some(code), _) => Termination::Exited(code).unwrapped(),
            (None, Some(signal)) => Termination::Signaled(signal),
            (None, None) => Termination::Exited(-1),
        },
        Ok(Err(e)) => return Err(SandboxError::Io(format!("waiting for the sandbox failed: {e}"))),
        Err(_) => {
            // bwrap dies, its child gets SIGKILL (--die-with-parent) and the PID namespace
            // takes every other process with it.
            let _ = child.kill().await;
            Termination::TimedOut
        }
    };
    writer.abort();
    let grace = Duration::from_secs(2);
    let (stdout, t1) = tokio::time::timeout(grace, out).await.ok().and_then(Result::ok).unwrap_or_default();
    let (stderr, t2) = tokio::time::timeout(grace, err).await.ok().and_then(Result::ok).unwrap_or_default();
    Ok(RunReport {
        termination,
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
        truncated: t1 || t2,
        wall_seconds: started.elapsed().as_secs_f64(),
    })
}
