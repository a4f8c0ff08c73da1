//! Service binaries as processes: started with `KEEL_<SERVICE>__LISTEN=127.0.0.1:0`, ready
//! once they print their `listening on http://ADDR` line, killed when dropped.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// How long a service may take to start listening.
const START_DEADLINE: Duration = Duration::from_secs(60);

/// Makes a tiny Qwen3 model directory at `out` with the `keel` binary (`keel model init`,
/// tokenizer trained on the shipped corpus), as a user would.
pub fn keel_model_init(out: &std::path::Path) {
    keel_model_init_preset(out, "tiny", 0);
}

/// `keel model init --preset PRESET --seed SEED` into `out`.
pub fn keel_model_init_preset(out: &std::path::Path, preset: &str, seed: i64) {
    keel_model_init_arch(out, "qwen3", preset, seed);
}

/// `keel model init --arch ARCH --preset PRESET --seed SEED` into `out`.
pub fn keel_model_init_arch(out: &std::path::Path, arch: &str, preset: &str, seed: i64) {
    let corpus = crate::workspace_root().join("examples/tokenizer-corpus.txt");
    let init = Command::new(binary("keel"))
        .args(["model", "init", "--arch", arch, "--preset", preset, "--seed", &seed.to_string(), "--train-tokenizer"])
        .arg(&corpus)
        .arg("--out")
        .arg(out)
        .output()
        .expect("run keel model init");
    assert!(init.status.success(), "keel model init: {}", String::from_utf8_lossy(&init.stderr));
}

/// A binary of this workspace, next to the running test's `deps/` directory.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe.parent().and_then(|deps| deps.parent()).expect("target directory");
    let path = dir.join(name);
    assert!(path.is_file(), "{} is not built: run `cargo build --workspace --bins` first", path.display());
    path
}

#[derive(Debug)]
pub struct ServiceProcess {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub url: String,
}

impl ServiceProcess {
    /// Starts `keel-<service>` on a free port with extra environment variables.
    pub fn start(service: &str, env: &[(&str, &str)]) -> Self {
        Self::start_in(&[], service, env)
    }

    /// [`ServiceProcess::start`] through `wrapper`, a command that runs the binary (its path
    /// is appended) in the same process, e.g. `ip netns exec NAME` to run it in a network
    /// namespace. Its URL is then the namespace's.
    pub fn start_in(wrapper: &[&str], service: &str, env: &[(&str, &str)]) -> Self {
        let binary = binary(&format!("keel-{service}"));
        let mut command = match wrapper.split_first() {
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg(&binary);
                command
            }
            None => Command::new(&binary),
        };
        let mut child = command
            .env(format!("KEEL_{}__LISTEN", service.to_uppercase()), "127.0.0.1:0")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("start keel-{service}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(url) = line.split("listening on ").nth(1) {
                    let _ = tx.send(url.trim().to_string());
                }
            }
        });
        match rx.recv_timeout(START_DEADLINE) {
            Ok(url) => Self { child, url },
            Err(_) => {
                let _ = child.kill();
                panic!("keel-{service} did not start listening within {START_DEADLINE:?}");
            }
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the process (SIGKILL) and waits for it: a crash, as the rest of the system sees it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends `signal` (`STOP`, `CONT`, ...) to the process.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args([format!("-{signal}").as_str(), &pid]).status().expect("run kill");
        assert!(sent.success(), "kill -{signal} {pid} failed");
    }

    /// The exit status once the process has exited by itself, if it does within `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if std::time::Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
                _ => return None,
            }
        }
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(mut self) -> ExitStatus {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status().expect("run kill");
        assert!(sent.success(), "kill -TERM {pid} failed");
        self.child.wait().expect("wait for service")
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
