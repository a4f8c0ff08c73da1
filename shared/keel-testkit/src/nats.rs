//! A nats-server of a test's own, with JetStream, killed when dropped.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct NatsServer {
    child: Child,
    /// The address it listens on.
    pub host: String,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl NatsServer {
    /// Starts nats-server on `host` (an address of this machine) and a free port, with
    /// JetStream in a directory of its own, `config` as its configuration file when given
    /// and `env` added to its environment (e.g. the passwords a configuration reads).
    pub fn start(host: &str, config: Option<&Path>, env: &[(String, String)]) -> Self {
        let dir = tempfile::tempdir().expect("a directory for nats-server");
        let server = ["/usr/sbin/nats-server", "/usr/bin/nats-server", "/usr/local/bin/nats-server"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .expect("nats-server is installed (scripts/setup)");
        let log = dir.path().join("nats-server.log");
        // A free port can be taken by another test before the server binds it: try again.
        for _ in 0..3 {
            let port = std::net::TcpListener::bind((host, 0)).expect("a free port").local_addr().expect("port").port();
            let mut command = Command::new(server);
            if let Some(config) = config {
                command.arg("-c").arg(config);
            }
            command
                .args(["-a", host, "-p", &port.to_string(), "-js", "-sd"])
                .arg(dir.path().join("store"))
                .arg("-l")
                .arg(&log)
                .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let mut child = command.spawn().expect("start nats-server");
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                if std::net::TcpStream::connect((host, port)).is_ok() {
                    return Self { child, host: host.to_string(), port, _dir: dir };
                }
                if child.try_wait().ok().flatten().is_some() || Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        panic!("nats-server did not start; its log:\n{}", std::fs::read_to_string(&log).unwrap_or_default());
    }

    /// `nats://host:port`.
    pub fn url(&self) -> String {
        format!("nats://{}:{}", self.host, self.port)
    }

    /// The URL with a user's credentials.
    pub fn url_as(&self, user: &str, password: &str) -> String {
        format!("nats://{user}:{password}@{}:{}", self.host, self.port)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
