//! A control group for each sandboxed program, so that its limits hold for the program as a
//! whole (every process it forks, every page they touch) and not only per process, as
//! `prlimit`'s do: memory (`memory.max`, or v1's `memory.limit_in_bytes`), processes
//! (`pids.max`) and one CPU's worth of time (`cpu.max`, or v1's CFS quota).
//!
//! The groups are made under the service's own group, in the cgroup v2 hierarchy when its
//! controllers are delegated there, else in the v1 `memory`, `pids` and `cpu` hierarchies when
//! they are writable (a service running as root on a host, or a container given them). Where
//! neither is (an unprivileged container's read-only `/sys/fs/cgroup`), the sandbox runs with
//! its per-process limits only and says so once at start-up; `sandbox.cgroups: required`
//! refuses samples instead.
//!
//! A program is put in its group before bubblewrap runs: a shell writes its own pid into the
//! group's `cgroup.procs` and then becomes bubblewrap (`exec`), so nothing it starts is ever
//! outside. When the run ends every process left in the group is killed and the group removed.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Whether programs run in control groups of their own (`KEEL_REWARD__SANDBOX__CGROUPS`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CgroupMode {
    /// When a writable hierarchy is found; else per-process limits only (said at start-up).
    #[default]
    Auto,
    /// Always: without a writable hierarchy the sandbox is unavailable.
    Required,
    /// Never.
    Off,
}

/// Where the per-program groups are made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hierarchy {
    /// The service's cgroup v2 group, with `memory`, `pids` and `cpu` enabled for children.
    V2(PathBuf),
    /// The service's groups in the v1 `memory`, `pids` and `cpu` hierarchies.
    V1 { memory: PathBuf, pids: PathBuf, cpu: Option<PathBuf> },
}

/// What one program's group allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupLimits {
    pub memory_bytes: u64,
    pub processes: u64,
}

/// The CFS period and quota: one CPU.
const CPU_PERIOD_US: u64 = 100_000;

impl Hierarchy {
    /// A hierarchy this process may make groups in, or why there is none.
    pub fn find() -> Result<Self, String> {
        let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| format!("/proc/self/cgroup: {e}"))?;
        let root = Path::new("/sys/fs/cgroup");
        if root.join("cgroup.controllers").is_file() {
            let path = own.lines().find_map(|l| l.strip_prefix("0::")).unwrap_or("/");
            let dir = root.join(path.trim_start_matches('/'));
            return v2(&dir).map(Self::V2);
        }
        let v1_dir = |controller: &str| -> Option<PathBuf> {
            let mount = root.join(controller);
            let path = own.lines().find_map(|l| {
                let mut parts = l.splitn(3, ':');
                let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
                controllers.split(',').any(|c| c == controller).then(|| path.to_string())
            })?;
            let dir = mount.join(path.trim_start_matches('/'));
            writable(&dir).then_some(dir)
        };
        match (v1_dir("memory"), v1_dir("pids")) {
            (Some(memory), Some(pids)) => Ok(Self::V1 { memory, pids, cpu: v1_dir("cpu") }),
            _ => Err("neither cgroup v2 with delegated controllers nor writable v1 memory and pids hierarchies".into()),
        }
    }

    /// Makes the group `name` for one program with `limits`.
    pub fn group(&self, name: &str, limits: GroupLimits) -> std::io::Result<Group> {
        let mut group = Group { dirs: Vec::new() };
        match self {
            Self::V2(parent) => {
                let dir = make(parent, name)?;
                group.dirs.push(dir.clone());
                write(&dir, "memory.max", limits.memory_bytes)?;
                // No swap either, where the kernel has it.
                let _ = write(&dir, "memory.swap.max", 0);
                write(&dir, "pids.max", limits.processes)?;
                let _ = std::fs::write(dir.join("cpu.max"), format!("{CPU_PERIOD_US} {CPU_PERIOD_US}"));
            }
            Self::V1 { memory, pids, cpu } => {
                let dir = make(memory, name)?;
                group.dirs.push(dir.clone());
                write(&dir, "memory.limit_in_bytes", limits.memory_bytes)?;
                let _ = write(&dir, "memory.memsw.limit_in_bytes", limits.memory_bytes);
                let dir = make(pids, name)?;
                group.dirs.push(dir.clone());
                write(&dir, "pids.max", limits.processes)?;
                if let Some(cpu) = cpu
                    && let Ok(dir) = make(cpu, name)
                {
                    group.dirs.push(dir.clone());
                    let _ = write(&dir, "cpu.cfs_period_us", CPU_PERIOD_US);
                    let _ = write(&dir, "cpu.cfs_quota_us", CPU_PERIOD_US);
                }
            }
        }
        Ok(group)
    }
}

/// The service's v2 group, if children can have the memory and pids controllers: already
/// enabled there, or enabled now.
fn v2(dir: &Path) -> Result<PathBuf, String> {
    let subtree = dir.join("cgroup.subtree_control");
    let enabled = |text: &str| ["memory", "pids"].iter().all(|c| text.split_whitespace().any(|w| w == *c));
    let current = std::fs::read_to_string(&subtree).map_err(|e| format!("{}: {e}", subtree.display()))?;
    if !enabled(&current) {
        // Fails while this group holds processes itself (cgroup v2's rule), unless it is the root.
        std::fs::write(&subtree, "+memory +pids +cpu")
            .or_else(|_| std::fs::write(&subtree, "+memory +pids"))
            .map_err(|e| format!("cannot enable memory and pids for {}'s children: {e}", dir.display()))?;
    }
    if !writable(dir) {
        return Err(format!("cannot make groups in {}", dir.display()));
    }
    Ok(dir.to_path_buf())
}

/// Whether a group can be made (and removed) in `dir`.
fn writable(dir: &Path) -> bool {
    let probe = dir.join(format!("keel-probe-{}", std::process::id()));
    let made = std::fs::create_dir(&probe).is_ok();
    made && std::fs::remove_dir(&probe).is_ok()
}

fn make(parent: &Path, name: &str) -> std::io::Result<PathBuf> {
    let dir = parent.join(name);
    std::fs::create_dir(&dir)?;
    Ok(dir)
}

fn write(dir: &Path, file: &str, value: u64) -> std::io::Result<()> {
    std::fs::write(dir.join(file), value.to_string())
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", dir.join(file).display())))
}

/// One program's group (a directory per hierarchy); dropped, it kills what is left in it and
/// is removed.
#[derive(Debug)]
pub struct Group {
    dirs: Vec<PathBuf>,
}

impl Group {
    /// The `cgroup.procs` files a process writes its pid to, to join the group.
    pub fn procs(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.procs")).collect()
    }

    /// Kills what is left in the group and removes it, waiting for both (blocking: on the
    /// blocking pool, as the sandbox does after every run).
    pub fn close(mut self) {
        remove(std::mem::take(&mut self.dirs));
    }
}

/// Kills every process left in the groups `dirs` and removes them.
fn remove(dirs: Vec<PathBuf>) {
    let procs: Vec<PathBuf> = dirs.iter().map(|d| d.join("cgroup.procs")).collect();
    let pids = || -> Vec<String> {
        procs
            .iter()
            .flat_map(|p| {
                std::fs::read_to_string(p).unwrap_or_default().lines().map(str::to_string).collect::<Vec<_>>()
            })
            .collect()
    };
    for _ in 0..50 {
        let left = pids();
        if left.is_empty() {
            break;
        }
        // cgroup v2 kills a whole group at once; v1 has no such file.
        let all_at_once = dirs.first().is_some_and(|dir| std::fs::write(dir.join("cgroup.kill"), "1").is_ok());
        if !all_at_once {
            let _ = std::process::Command::new("kill").arg("-KILL").args(&left).status();
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    for dir in &dirs {
        for _ in 0..50 {
            if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

impl Drop for Group {
    /// A group dropped without [`Group::close`] (its run was cancelled) is removed on the
    /// blocking pool, never on an async worker.
    fn drop(&mut self) {
        let dirs = std::mem::take(&mut self.dirs);
        if dirs.is_empty() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn_blocking(move || remove(dirs))),
            Err(_) => remove(dirs),
        }
    }
}
