//! A watchdog for collectives that cannot notice a lost peer.
//!
//! NCCL has no failure detection of its own: when a rank of a multi-process group dies, the
//! others wait in their next collective for ever (the kernel spins on data that never comes).
//! A [`Watchdog`] gives each rank a second, tiny group of the same ranks over TCP
//! ([`TcpCollective`], through rank 0) on which every rank meets in a barrier every
//! [`BEAT`], on a thread of its own. A rank that exits (killed, crashed) closes its
//! connections, and the TCP backend fails the barrier on every other rank at once: rank 0
//! reads the end of the lost rank's connection and tells the rest why, and a lost rank 0
//! closes them all. A rank that stops meeting without closing anything (its machine gone)
//! fails it after the channel's timeout. Either way each surviving rank's watchdog runs its
//! `on_failure` once with the reason; for NCCL that is [`crate::nccl::AbortHandle::abort`]
//! (`ncclCommAbort`), which ends the rank's pending collectives and makes the next one an
//! [`crate::Error::Aborted`] instead of a hang.
//!
//! The ranks of a group live and leave together: a rank that drops its watchdog alone is, to
//! the others, a lost rank.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::tcp::TcpCollective;
use crate::{Collective, Error, Result};

/// How often the ranks meet on the watchdog's channel.
pub const BEAT: Duration = Duration::from_millis(500);

/// One rank's watchdog; dropping it stops the watching (without calling `on_failure`).
#[derive(Debug)]
pub struct Watchdog {
    stop: Arc<AtomicBool>,
}

impl Watchdog {
    /// Watches `channel`, a TCP group of the same ranks used by nothing else: `on_failure`
    /// runs once, on the watchdog's thread, with the reason the group was lost.
    pub fn start(channel: TcpCollective, on_failure: impl FnOnce(String) + Send + 'static) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let rank = channel.rank();
        std::thread::Builder::new()
            .name(format!("keel-watchdog-{rank}"))
            .spawn(move || {
                loop {
                    std::thread::sleep(BEAT);
                    if stopped.load(Ordering::Acquire) {
                        return;
                    }
                    if let Err(e) = channel.barrier() {
                        if !stopped.load(Ordering::Acquire) {
                            on_failure(e.to_string());
                        }
                        return;
                    }
                }
            })
            .map_err(|e| Error::Invalid(format!("rank {rank}: starting the watchdog: {e}")))?;
        Ok(Self { stop })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::net::IpAddr;
    use std::process::{Child, Command, Stdio};
    use std::sync::{Condvar, Mutex};

    /// The group's own timeout in these tests: far longer than the test waits, so a rank that
    /// fails in time was told by the watchdog, not by a timeout.
    const GROUP_TIMEOUT: Duration = Duration::from_secs(600);

    fn nats_url() -> String {
        std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
    }

    /// One rank of the test's group, as a process of its own (this test binary run again):
    /// joins the watchdog, says `ready`, then waits in a "collective" that only the watchdog's
    /// abort ends (as a rank waits in an NCCL kernel), and prints the reason.
    #[test]
    #[ignore = "a rank process of a_killed_rank_makes_every_other_rank_fail_within_seconds, which runs it"]
    fn rank_process() {
        let Ok(spec) = std::env::var("KEEL_WATCHDOG_RANK") else { return };
        let (subject, rank, world) = match spec.split(',').collect::<Vec<_>>()[..] {
            [subject, rank, world] => (subject.to_string(), rank.parse().unwrap(), world.parse().unwrap()),
            _ => panic!("KEEL_WATCHDOG_RANK={spec}"),
        };
        let aborted = Arc::new((Mutex::new(None::<String>), Condvar::new()));
        let on_failure = {
            let aborted = aborted.clone();
            move |reason: String| {
                *aborted.0.lock().unwrap() = Some(reason);
                aborted.1.notify_all();
            }
        };
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _watchdog = runtime.block_on(async {
            let client = async_nats::connect(nats_url()).await.unwrap();
            let ip: IpAddr = "127.0.0.1".parse().unwrap();
            let channel = TcpCollective::join(&client, &subject, rank, world, ip, GROUP_TIMEOUT).await.unwrap();
            Watchdog::start(channel, on_failure).unwrap()
        });
        println!("ready");
        let (lock, signal) = &*aborted;
        let mut reason = lock.lock().unwrap();
        while reason.is_none() {
            reason = signal.wait(reason).unwrap();
        }
        println!("aborted: {}", reason.as_deref().unwrap_or_default());
    }

    struct Rank {
        child: Child,
        lines: std::sync::mpsc::Receiver<String>,
    }

    fn start_rank(subject: &str, rank: usize, world: usize) -> Rank {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["watchdog::tests::rank_process", "--exact", "--ignored", "--nocapture", "--test-threads", "1"])
            .env("KEEL_WATCHDOG_RANK", format!("{subject},{rank},{world}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(std::result::Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Rank { child, lines }
    }

    /// What a rank prints from `prefix` on, in the first line that has it within `wait` (a
    /// guard against a hang, not a measure of speed), if any. (The test harness may print
    /// the test's name first on the same line.)
    fn line_from(rank: &Rank, prefix: &str, wait: Duration) -> Option<String> {
        let deadline = std::time::Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match rank.lines.recv_timeout(left) {
                Ok(line) if line.contains(prefix) => return line.find(prefix).map(|at| line[at..].to_string()),
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
    }

    /// Three rank processes wait in a collective that only an abort ends; one is killed
    /// (SIGKILL, no goodbye): the other two are aborted, with the lost rank named, long
    /// before the group's timeout (600 s). Once for a follower, once for rank 0, the hub of
    /// the watchdog's channel.
    #[test]
    fn a_killed_rank_makes_every_other_rank_fail_within_seconds() {
        for killed in [2usize, 0] {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
            let subject = format!("test.watchdog.{}.{nanos}.{killed}", std::process::id());
            let mut ranks: Vec<Rank> = (0..3).map(|rank| start_rank(&subject, rank, 3)).collect();
            for (rank, process) in ranks.iter().enumerate() {
                assert!(
                    line_from(process, "ready", Duration::from_secs(60)).is_some(),
                    "rank {rank} did not join the watchdog's group"
                );
            }
            ranks[killed].child.kill().unwrap();
            ranks[killed].child.wait().unwrap();
            for (rank, process) in ranks.iter_mut().enumerate().filter(|(rank, _)| *rank != killed) {
                let said = line_from(process, "aborted", Duration::from_secs(60));
                let said = said.unwrap_or_else(|| panic!("rank {rank} was not aborted after rank {killed} was killed"));
                assert!(said.contains(&format!("rank {killed}")), "rank {rank}: {said}");
                assert!(process.child.wait().unwrap().success(), "rank {rank} ends cleanly once aborted");
            }
        }
    }

    /// Dropping the watchdogs of every rank (a group that ends) calls nobody's `on_failure`.
    #[test]
    fn a_group_that_ends_together_is_not_a_failure() {
        let failures = Arc::new(Mutex::new(Vec::new()));
        let watchdogs = crate::tcp::tests::on_ranks(3, {
            let failures = failures.clone();
            move |channel| {
                let failures = failures.clone();
                Watchdog::start(channel, move |reason| failures.lock().unwrap().push(reason)).unwrap()
            }
        });
        std::thread::sleep(BEAT * 4);
        drop(watchdogs);
        std::thread::sleep(BEAT * 4);
        assert!(failures.lock().unwrap().is_empty(), "{:?}", failures.lock().unwrap());
    }
}
