//! The sandbox that runs untrusted programs (the `code` environment's Python).
//!
//! Each run is a separate process tree under bubblewrap (`bwrap`), the sandbox Flatpak uses:
//! - its own network namespace (only a loopback device: no connection leaves it), PID, IPC
//!   and UTS namespaces; killed with its whole tree when the wall-clock limit passes;
//! - a filesystem of read-only system directories (`/usr` and the `/lib*`, `/bin` links, for
//!   the interpreter), the run's files read-only in `/code`, and `/sandbox`, a fresh tmpfs of
//!   `disk_mb` that is its working directory and the only place it can write (gone when the
//!   run ends); `/dev` is read-only, and nothing else of the host is there (no `/etc`, no
//!   `/home`, no `/tmp`, no `/proc` of the host: the service's processes and environment are
//!   invisible); the environment is cleared;
//! - a seccomp filter ([`seccomp`]) refusing new namespaces, mounts, `ptrace`, keyrings, `bpf`
//!   and the like, so the program cannot build a way out or around the limits;
//! - `prlimit` limits on CPU seconds, address space, processes, file size, open files and
//!   core dumps;
//! - when the service runs as root, the program runs as an unprivileged user of its own (one
//!   uid per slot, from `first_uid`) with no capabilities and `no_new_privs`, so process limits
//!   count only its own processes. Without root, bubblewrap's user namespace maps the
//!   service's own user (and forbids further user namespaces), and the process limit counts
//!   the service user's processes.
//!
//! - a control group of its own ([`cgroup`]) where the service can make one: `memory_mb` and
//!   `max_processes` then hold for the program as a whole, and it gets at most one CPU.
//!
//! Without a control group the address-space limit is per process: a run may use up to
//! `memory_mb` × `max_processes` plus its tmpfs. At most `slots` programs run at once; further runs wait for a slot. A run
//! whose sandbox could not be set up is an error, never a program failure. Where bubblewrap
//! is missing or cannot create namespaces the sandbox reports itself unavailable (and checks
//! again a little later) and nothing runs: there is no unsandboxed fallback.

pub mod cgroup;
pub mod seccomp;

use keel_protocol::FieldError;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use command_fds::{CommandFdExt, FdMapping};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;
use tokio::sync::Semaphore;

/// File descriptors bwrap reads its seccomp filter from and writes its status to.
const SECCOMP_FD: i32 = 3;
const STATUS_FD: i32 = 4;

/// How long a failed availability check is trusted before the next run checks again.
const RECHECK_AFTER: Duration = Duration::from_secs(30);

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
    /// Where the run's files are written before they are shown read-only in `/code`.
    pub work_dir: Option<PathBuf>,
    /// Size of each run's writable tmpfs, MiB.
    pub disk_mb: u64,
    /// The most a request may ask for: each `code` limit is checked against these.
    pub ceilings: Ceilings,
    /// Whether each program runs in a control group of its own, which caps its memory,
    /// processes and CPU as a whole (`auto`: where one can be made; `required`; `off`).
    pub cgroups: cgroup::CgroupMode,
}

/// The operator's upper bounds on what a request may set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Ceilings {
    pub cpu_seconds: u64,
    pub wall_seconds: f64,
    pub memory_mb: u64,
    pub processes: u64,
    pub file_mb: u64,
    pub output_bytes: usize,
    /// Sandbox wall-clock seconds one request's programs may use in all: once spent, the
    /// request's remaining tests are not run (they fail as `not_run`).
    pub request_seconds: f64,
}

impl Default for Ceilings {
    fn default() -> Self {
        Self {
            cpu_seconds: 60,
            wall_seconds: 120.0,
            memory_mb: 4096,
            processes: 64,
            file_mb: 256,
            output_bytes: 1 << 20,
            request_seconds: 3600.0,
        }
    }
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
            disk_mb: 64,
            ceilings: Ceilings::default(),
            cgroups: cgroup::CgroupMode::Auto,
        }
    }
}

impl SandboxConfig {
    pub fn validate(&self) -> Result<(), FieldError> {
        if self.slots == 0 {
            return Err(FieldError::new("sandbox.slots", "must be at least 1"));
        }
        if self.first_uid == 0 || self.first_uid.checked_add(self.slots as u32).is_none() {
            return Err(FieldError::new("sandbox.first_uid", "must not be root, and leave room for every slot"));
        }
        if !self.python.is_absolute() {
            return Err(FieldError::new("sandbox.python", "must be an absolute path"));
        }
        if !(1..=1 << 20).contains(&self.disk_mb) {
            return Err(FieldError::new("sandbox.disk_mb", "must be 1 to 1048576"));
        }
        let request = self.ceilings.request_seconds;
        if !(request.is_finite() && request > 0.0) {
            return Err(FieldError::new("sandbox.ceilings.request_seconds", "must be more than 0"));
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
    /// Not started: the request had used its sandbox seconds.
    NotRun,
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

#[derive(Debug, Clone, thiserror::Error)]
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
    filter: Option<Vec<u8>>,
    /// Where each program's control group is made, or why none is.
    cgroups: Result<cgroup::Hierarchy, String>,
    /// The last availability check: when, and what it found (success is kept for good).
    checked: tokio::sync::Mutex<Option<(Instant, Result<(), SandboxError>)>>,
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
        let cgroups = match config.cgroups {
            cgroup::CgroupMode::Off => Err("sandbox.cgroups is off".to_string()),
            _ => cgroup::Hierarchy::find(),
        };
        match &cgroups {
            Ok(hierarchy) => tracing::info!(?hierarchy, "sandboxed programs run in control groups of their own"),
            Err(why) if config.cgroups == cgroup::CgroupMode::Auto => tracing::warn!(
                "sandboxed programs get per-process limits only, no control group capping each program as a whole: {why}"
            ),
            Err(_) => {}
        }
        Arc::new(Self {
            cgroups,
            slots: Semaphore::new(config.slots),
            free_uids: Mutex::new(uids),
            root: running_as_root(),
            filter: seccomp::program(),
            checked: tokio::sync::Mutex::new(None),
            config,
        })
    }

    pub fn config(&self) -> &SandboxConfig {
        &self.config
    }

    /// Whether sandboxed programs can run: a sandboxed `python3 -c pass` is tried once, and
    /// again [`RECHECK_AFTER`] a failure.
    pub async fn available(&self) -> Result<(), SandboxError> {
        let mut checked = self.checked.lock().await;
        match &*checked {
            Some((_, Ok(()))) => return Ok(()),
            Some((at, Err(e))) if at.elapsed() < RECHECK_AFTER => return Err(e.clone()),
            _ => {}
        }
        let result = self.probe().await;
        *checked = Some((Instant::now(), result.clone()));
        result
    }

    async fn probe(&self) -> Result<(), SandboxError> {
        let unavailable = |why: String| Err(SandboxError::Unavailable(why));
        if !self.config.bwrap.is_file() {
            return unavailable(format!("{} not found (install bubblewrap)", self.config.bwrap.display()));
        }
        if self.filter.is_none() {
            return unavailable(format!("no seccomp filter for the {} architecture", std::env::consts::ARCH));
        }
        if let (cgroup::CgroupMode::Required, Err(why)) = (self.config.cgroups, &self.cgroups) {
            return unavailable(format!("sandbox.cgroups is required and no control group can be made: {why}"));
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
                unavailable(format!("a probe run failed: {:?}: {}", report.termination, report.stderr.trim()))
            }
            Err(e) => unavailable(e.to_string()),
        }
    }

    /// Runs `python /code/<main>` with `files` in `/code` (read-only) and `stdin` as input.
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
        let work = self.config.work_dir.clone();
        let owned: Vec<(String, String)> = files.iter().map(|(n, c)| (n.to_string(), c.to_string())).collect();
        let filter = self.filter.clone().ok_or_else(|| SandboxError::Unavailable("no seccomp filter".into()))?;
        let dir = blocking(move || prepare(work.as_deref(), &owned, &filter)).await??;
        let group = match &self.cgroups {
            Ok(hierarchy) => {
                let hierarchy = hierarchy.clone();
                static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let name = format!("keel-sandbox-{}-{}-{run}", std::process::id(), uid.0);
                let caps = cgroup::GroupLimits { memory_bytes: limits.memory_bytes, processes: limits.processes };
                let made = blocking(move || hierarchy.group(&name, caps)).await?;
                Some(made.map_err(|e| SandboxError::Io(format!("cannot make the program's control group: {e}")))?)
            }
            Err(_) => None,
        };
        let procs = group.as_ref().map(cgroup::Group::procs).unwrap_or_default();
        let command = self.command(&dir, uid.0, main, limits, &procs);
        let report = match command {
            Ok(command) => execute(command, stdin, limits).await,
            Err(e) => Err(e),
        };
        // Whatever the program left running in its group is killed as the group goes.
        blocking(move || {
            if let Some(group) = group {
                group.close();
            }
            drop(dir)
        })
        .await?;
        report
    }

    /// The command that runs bubblewrap for one program; with `procs` (its control group's
    /// `cgroup.procs` files), through a shell that joins the group and then becomes
    /// bubblewrap, so that nothing of the program starts outside it.
    fn command(
        &self,
        dir: &Prepared,
        uid: u32,
        main: &str,
        limits: &Limits,
        procs: &[PathBuf],
    ) -> Result<(Command, Status), SandboxError> {
        let io = |e: std::io::Error| SandboxError::Io(format!("cannot set up the sandbox's descriptors: {e}"));
        let filter = std::fs::File::open(&dir.filter).map_err(io)?;
        let (status_reader, status_writer) = std::io::pipe().map_err(io)?;
        let mut c = Command::new(&self.config.bwrap);
        c.args(["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]);
        if !self.root {
            c.args(["--unshare-user", "--disable-userns", "--uid", "1000", "--gid", "1000"]);
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
        c.args(["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]);
        c.arg("--size").arg((self.config.disk_mb << 20).to_string()).args(["--perms", "01777", "--tmpfs", "/sandbox"]);
        c.arg("--ro-bind").arg(dir.code.path()).arg("/code");
        c.args(["--chdir", "/sandbox"]);
        c.arg("--seccomp").arg(SECCOMP_FD.to_string()).arg("--json-status-fd").arg(STATUS_FD.to_string());
        c.args(["--", "/usr/bin/prlimit"]);
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
        c.arg(&self.config.python).args(["-I", "-B"]).arg(format!("/code/{main}"));
        if !procs.is_empty() {
            let bwrap = c.as_std();
            let mut joined = Command::new("/bin/sh");
            joined
                .arg("-c")
                .arg(r#"n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n - 1)); done; exec "$@""#)
                .arg("sh")
                .arg(procs.len().to_string())
                .args(procs)
                .arg(bwrap.get_program())
                .args(bwrap.get_args());
            c = joined;
        }
        c.env_clear().stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
        let mappings = vec![
            FdMapping { parent_fd: OwnedFd::from(filter), child_fd: SECCOMP_FD },
            FdMapping { parent_fd: OwnedFd::from(status_writer), child_fd: STATUS_FD },
        ];
        c.fd_mappings(mappings).map_err(|e| SandboxError::Io(format!("cannot map descriptors: {e}")))?;
        Ok((c, Status(status_reader)))
    }
}

/// Runs `work` on the blocking pool (file system work never holds an async worker).
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Result<T, SandboxError> {
    tokio::task::spawn_blocking(work).await.map_err(|e| SandboxError::Io(e.to_string()))
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

/// A run's host-side files: the program's directory (readable by all, shown read-only) and
/// the seccomp filter beside it.
struct Prepared {
    code: tempfile::TempDir,
    filter: PathBuf,
    _scratch: tempfile::TempDir,
}

fn prepare(parent: Option<&Path>, files: &[(String, String)], filter: &[u8]) -> Result<Prepared, SandboxError> {
    use std::os::unix::fs::PermissionsExt;
    let io = |e: std::io::Error| SandboxError::Io(format!("cannot prepare the sandbox's files: {e}"));
    let tempdir = || {
        let builder = tempfile::Builder::new().prefix("keel-sandbox-").to_owned();
        match parent {
            Some(parent) => builder.tempdir_in(parent),
            None => builder.tempdir(),
        }
    };
    let code = tempdir().map_err(io)?;
    for (name, content) in files {
        if name.contains('/') || name.starts_with('.') {
            return Err(SandboxError::Io(format!("file name `{name}` must be a plain name")));
        }
        let path = code.path().join(name);
        std::fs::write(&path, content).map_err(io)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).map_err(io)?;
    }
    std::fs::set_permissions(code.path(), std::fs::Permissions::from_mode(0o555)).map_err(io)?;
    let scratch = tempdir().map_err(io)?;
    let filter_path = scratch.path().join("seccomp.bpf");
    std::fs::File::create(&filter_path).and_then(|mut f| f.write_all(filter)).map_err(io)?;
    Ok(Prepared { code, filter: filter_path, _scratch: scratch })
}

impl Drop for Prepared {
    fn drop(&mut self) {
        // Read-only so the program could not change it; writable again so it can be removed.
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(self.code.path(), std::fs::Permissions::from_mode(0o755));
    }
}

/// The read end of bwrap's `--json-status-fd`.
struct Status(std::io::PipeReader);

impl Status {
    /// Whether bwrap reported starting the program (`{"child-pid": N}`); read after bwrap has
    /// exited, so the pipe is at its end.
    fn program_started(mut self) -> bool {
        let mut text = String::new();
        let _ = self.0.read_to_string(&mut text);
        text.contains("\"child-pid\"")
    }
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

/// Aborts a task when dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn execute(
    (mut command, status): (Command, Status),
    stdin: &[u8],
    limits: &Limits,
) -> Result<RunReport, SandboxError> {
    let started = Instant::now();
    let spawned = command.spawn();
    // The command holds our copies of the descriptors bwrap inherited: close them now, so the
    // status pipe ends when bwrap does.
    drop(command);
    let mut child = spawned.map_err(|e| SandboxError::Unavailable(format!("cannot start bwrap: {e}")))?;
    let (Some(mut input), Some(stdout), Some(stderr)) = (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        return Err(SandboxError::Io("the sandbox's pipes are missing".into()));
    };
    let input_bytes = stdin.to_vec();
    // A program that never reads its input must not block the run: write in the background.
    let _writer = AbortOnDrop(tokio::spawn(async move {
        let _ = input.write_all(&input_bytes).await;
    }));
    let mut out = AbortOnDrop(tokio::spawn(read_capped(stdout, limits.output_bytes)));
    let mut err = AbortOnDrop(tokio::spawn(read_capped(stderr, limits.output_bytes)));
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
    let grace = Duration::from_secs(2);
    let (stdout, t1) = tokio::time::timeout(grace, &mut out.0).await.ok().and_then(Result::ok).unwrap_or_default();
    let (stderr, t2) = tokio::time::timeout(grace, &mut err.0).await.ok().and_then(Result::ok).unwrap_or_default();
    let stderr = String::from_utf8_lossy(&stderr).into_owned();
    if termination != Termination::TimedOut && !blocking(move || status.program_started()).await? {
        return Err(SandboxError::Unavailable(format!("bwrap could not set up the sandbox: {}", stderr.trim())));
    }
    Ok(RunReport {
        termination,
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr,
        truncated: t1 || t2,
        wall_seconds: started.elapsed().as_secs_f64(),
    })
}
