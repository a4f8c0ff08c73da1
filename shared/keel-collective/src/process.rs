//! Groups whose ranks are processes of their own (one per GPU, on one machine or several),
//! led by rank 0: what a service needs to run as one rank of such a group.
//!
//! - [`GroupConfig`]: the group's name and size and this process's rank, as a service's
//!   configuration says them.
//! - [`Meeting`]: where the ranks find each other over NATS; [`form`]: the group's control
//!   channel, a [`TcpCollective`] whose hub is the leader.
//! - The lockstep protocol on it, for any service's command type: the leader sends each
//!   command ([`lead_command`]; [`ping`] while idle), every rank runs it ([`follow`] on the
//!   others), and every rank reports how it went ([`report`], an all-gather of [`status`]es);
//!   [`settle`] picks the leader's answer: its own result, or the error that started a
//!   failure (the first, in rank order, that is not only a consequence of another rank's
//!   failure). A service keeps only its command enum and what each command does.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::tcp::TcpCollective;
use crate::{Error, Result};

/// The most ranks a group has.
pub const MAX_GROUP_SIZE: usize = 64;

/// A service's `group`: this process as one rank of a group of processes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupConfig {
    /// The group's name: the same on every rank, unique among the groups of its service on
    /// one NATS subject prefix.
    pub name: String,
    /// This process's rank, in `0..size`; rank 0 is the leader.
    pub rank: usize,
    /// How many processes the group has.
    pub size: usize,
    /// How long a rank waits for the others: to form the group, in a collective, for the
    /// leader's next command.
    #[serde(default = "default_timeout")]
    pub timeout_seconds: f64,
    /// The address the other ranks reach this one at (default: this machine's address
    /// towards the NATS server).
    #[serde(default)]
    pub address: Option<IpAddr>,
}

fn default_timeout() -> f64 {
    300.0
}

impl GroupConfig {
    /// What is wrong with this configuration, as (field under `group.`, why).
    pub fn problem(&self) -> Option<(&'static str, String)> {
        let token =
            !self.name.is_empty() && self.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !token {
            return Some(("group.name", format!("`{}` must be letters, digits, `-` and `_`", self.name)));
        }
        if !(1..=MAX_GROUP_SIZE).contains(&self.size) {
            return Some(("group.size", format!("must be 1 to {MAX_GROUP_SIZE}, got {}", self.size)));
        }
        if self.rank >= self.size {
            return Some(("group.rank", format!("must be below group.size ({}), got {}", self.size, self.rank)));
        }
        if !(self.timeout_seconds.is_finite() && self.timeout_seconds > 0.0) {
            return Some(("group.timeout_seconds", format!("must be positive, got {}", self.timeout_seconds)));
        }
        None
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.timeout_seconds)
    }

    /// `address`, else this machine's address towards the NATS server of `nats_url`.
    pub fn ip(&self, nats_url: &str) -> Result<IpAddr> {
        match self.address {
            Some(ip) => Ok(ip),
            None => ip_towards_nats(nats_url),
        }
    }
}

/// This machine's address towards the NATS server of `nats_url`: one the processes that
/// reach that server can reach this one at.
pub fn ip_towards_nats(nats_url: &str) -> Result<IpAddr> {
    crate::tcp::local_ip_towards(&nats_address(nats_url))
        .map_err(|e| Error::Invalid(format!("no address towards NATS at {nats_url}: {e}")))
}

/// `host:port` of the first NATS server of `url` (`nats://[user:password@]host[:port][,...]`).
pub fn nats_address(url: &str) -> String {
    let first = url.split(',').next().unwrap_or(url).trim();
    let rest = first.split_once("://").map_or(first, |(_, rest)| rest);
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host).trim_end_matches('/');
    if host.rsplit_once(':').is_some_and(|(_, port)| port.parse::<u16>().is_ok()) {
        host.to_string()
    } else {
        format!("{host}:4222")
    }
}

/// Forms the group's control channel on `subject`, waiting as long as it takes for every
/// rank (each try lasts the group's timeout).
pub async fn form(client: &async_nats::Client, subject: &str, config: &GroupConfig, ip: IpAddr) -> Arc<TcpCollective> {
    let (rank, size) = (config.rank, config.size);
    loop {
        tracing::info!(group = %config.name, rank, size, "waiting for every rank of the group");
        match TcpCollective::join(client, subject, rank, size, ip, config.timeout()).await {
            Ok(control) => {
                tracing::info!(group = %config.name, rank, size, "the group is whole");
                return Arc::new(control);
            }
            Err(e) => {
                tracing::info!(group = %config.name, rank, "the group did not form yet: {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// Where the ranks of a group meet: the NATS client, the subject every subject of the group
/// is under (`<prefix>.<service>.group.<name>`), this rank's configuration and the address
/// it listens on.
#[derive(Debug, Clone)]
pub struct Meeting {
    pub client: async_nats::Client,
    pub subject: String,
    pub config: GroupConfig,
    pub ip: IpAddr,
}

impl Meeting {
    /// The meeting of `service`'s group `config` under the subject prefix `prefix`, on the
    /// NATS server of `nats_url`.
    pub fn new(
        client: async_nats::Client,
        prefix: &str,
        service: &str,
        config: GroupConfig,
        nats_url: &str,
    ) -> Result<Self> {
        let ip = config.ip(nats_url)?;
        Ok(Self { client, subject: format!("{prefix}.{service}.group.{}", config.name), config, ip })
    }

    /// Forms the group's control channel, waiting as long as it takes for every rank.
    pub async fn form(&self) -> Arc<TcpCollective> {
        form(&self.client, &format!("{}.control", self.subject), &self.config, self.ip).await
    }

    /// Joins the communicator of `size` ranks on `device` found on the group's subject
    /// `part` (a session of its own, so that two never meet), as its rank `rank`.
    pub async fn join(&self, part: &str, rank: usize, size: usize, device: tch::Device) -> Result<crate::SharedComm> {
        let subject = format!("{}.{part}", self.subject);
        crate::join_process_group(&self.client, &subject, rank, size, device, self.ip, self.config.timeout()).await
    }
}

/// An error a rank can report to its leader and the leader can stand for.
pub trait RankError: Sized + From<Error> + std::fmt::Display {
    /// A stable name of the error's kind, carried to the leader.
    fn code(&self) -> &str;
    /// Whether it only follows another rank's failure.
    fn is_consequence(&self) -> bool;
    /// The error rank `rank` reported (`code`, `message`), as the leader's.
    fn reported(rank: usize, code: &str, message: String) -> Self;
}

/// How a rank's part of a command went, as it tells the leader.
#[derive(Debug, Serialize, Deserialize)]
struct Status {
    /// The error's code (none: it succeeded).
    code: Option<String>,
    message: String,
    consequence: bool,
}

/// `outcome` as a rank reports it.
pub fn status<T, E: RankError>(outcome: &std::result::Result<T, E>) -> Vec<u8> {
    let status = match outcome {
        Ok(_) => Status { code: None, message: String::new(), consequence: false },
        Err(e) => Status { code: Some(e.code().to_string()), message: e.to_string(), consequence: e.is_consequence() },
    };
    serde_json::to_vec(&status).unwrap_or_default()
}

/// Rank `rank`'s reported outcome (`Ok` when it succeeded).
fn reported<E: RankError>(rank: usize, bytes: &[u8]) -> std::result::Result<(), E> {
    let status: Status = serde_json::from_slice(bytes)
        .map_err(|e| E::from(Error::Invalid(format!("rank {rank} sent a malformed status: {e}"))))?;
    match status.code {
        None => Ok(()),
        Some(_) if status.consequence => {
            Err(E::from(Error::Aborted { rank, operation: "a command", reason: status.message }))
        }
        Some(code) => Err(E::reported(rank, &code, status.message)),
    }
}

/// Whether every rank's reported status (as [`report`] gathers them) says it succeeded.
pub fn all_succeeded(statuses: &[Vec<u8>]) -> bool {
    statuses.iter().all(|bytes| serde_json::from_slice::<Status>(bytes).is_ok_and(|status| status.code.is_none()))
}

/// The leader's answer to a command every rank ran: its own value `mine`, or the error that
/// started the failure. `statuses` are every rank's (the leader's first).
pub fn settle<T, E: RankError>(mine: std::result::Result<T, E>, statuses: &[Vec<u8>]) -> std::result::Result<T, E> {
    let others =
        statuses.iter().enumerate().skip(1).map(|(rank, status)| Ok(reported::<E>(rank, status).map(|()| None)));
    let results = std::iter::once(Ok(mine.map(Some))).chain(others).collect();
    crate::rank_zero(results, E::is_consequence)?
        .ok_or_else(|| E::from(Error::Invalid("the leader's own result is missing".into())))
}

/// Reports this rank's `outcome` of the current command to the leader.
pub fn report<T, E: RankError>(control: &TcpCollective, outcome: &std::result::Result<T, E>) -> Result<()> {
    control.all_gather_bytes(&status(outcome)).map(drop)
}

/// The leader's turn: the answer to the command, or why the control channel failed with this
/// rank's own outcome.
pub type Led<T, E> = std::result::Result<std::result::Result<T, E>, (Error, Option<std::result::Result<T, E>>)>;

/// The leader's turn: sends `command` to the other ranks, runs `local`, and gathers how every
/// rank did. `Err` when the control channel failed (the group is over), with this rank's own
/// outcome when it ran (not when the command never reached the others).
pub fn lead<T, E: RankError>(
    control: &TcpCollective,
    command: &[u8],
    local: impl FnOnce() -> std::result::Result<T, E>,
) -> Led<T, E> {
    if let Err(e) = control.broadcast_bytes(command, 0) {
        return Err((e, None));
    }
    let mine = local();
    match control.all_gather_bytes(&status(&mine)) {
        Ok(statuses) => Ok(settle(mine, &statuses)),
        Err(e) => Err((e, Some(mine))),
    }
}

/// How often an idle leader checks that every rank is still there ([`ping`]).
pub const PING: Duration = Duration::from_secs(5);

/// What a group's control channel carries: the leader's ping (no rank answers it), or one of
/// the service's commands, which every rank runs and reports on.
#[derive(Serialize, Deserialize)]
enum Message<C> {
    Ping,
    Command(C),
}

/// `command` as it travels on the control channel, for a leader whose turn is not one
/// [`lead_command`] (it sends the bytes itself, then reports like the other ranks).
pub fn encode<C: Serialize>(command: &C) -> Result<Vec<u8>> {
    serde_json::to_vec(&Message::Command(command))
        .map_err(|e| Error::Invalid(format!("cannot encode a group command: {e}")))
}

/// The leader's check, while idle, that every rank is still there: a failure means the
/// group is over.
pub fn ping(control: &TcpCollective) -> Result<()> {
    let bytes = serde_json::to_vec(&Message::<()>::Ping).map_err(|e| Error::Invalid(e.to_string()))?;
    control.broadcast_bytes(&bytes, 0).map(drop)
}

/// The leader's turn for `command` ([`lead`] with the command encoded). When the control
/// channel fails the group is over: `lose` is told why and makes the error that says so,
/// and the answer is this rank's own failure instead when it has one that did not only
/// follow from the rank that left (it says more).
pub fn lead_command<C: Serialize, T, E: RankError>(
    control: &TcpCollective,
    command: &C,
    local: impl FnOnce() -> std::result::Result<T, E>,
    lose: impl FnOnce(Error) -> E,
) -> std::result::Result<T, E> {
    let bytes = encode(command)?;
    match lead(control, &bytes, local) {
        Ok(outcome) => outcome,
        Err((channel, mine)) => {
            let lost = lose(channel);
            match mine {
                Some(Err(own)) if !own.is_consequence() => Err(own),
                _ => Err(lost),
            }
        }
    }
}

/// A rank other than the leader: runs each of the leader's commands with `execute` (given
/// the control channel, for a command that needs a round of its own) and reports how it went,
/// until the control channel fails, a command cannot be read (this rank is out of step), or
/// `execute` fails with an error that `must_leave`. Returns why it left.
pub fn follow<C: DeserializeOwned, E: RankError>(
    control: &TcpCollective,
    mut execute: impl FnMut(C, &TcpCollective) -> std::result::Result<(), E>,
    must_leave: impl Fn(&E) -> bool,
) -> String {
    loop {
        let bytes = match control.broadcast_bytes(&[], 0) {
            Ok(bytes) => bytes,
            Err(e) => return e.to_string(),
        };
        let (outcome, leave) = match serde_json::from_slice::<Message<C>>(&bytes) {
            Ok(Message::Ping) => continue,
            Ok(Message::Command(command)) => {
                let outcome = execute(command, control);
                let leave = outcome.as_ref().is_err_and(&must_leave);
                (outcome, leave)
            }
            Err(e) => {
                let unread = Error::Invalid(format!("the leader sent a command this rank cannot read: {e}"));
                (Err(E::from(unread)), true)
            }
        };
        if let Err(e) = report(control, &outcome) {
            return e.to_string();
        }
        if let (Err(e), true) = (&outcome, leave) {
            return e.to_string();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Collective;

    /// A test error: a code, and whether it is a consequence.
    #[derive(Debug, PartialEq)]
    struct Failed(String, bool);

    impl std::fmt::Display for Failed {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&self.0)
        }
    }

    impl From<Error> for Failed {
        fn from(e: Error) -> Self {
            let consequence = crate::is_consequence(&e);
            Failed(e.to_string(), consequence)
        }
    }

    impl RankError for Failed {
        fn code(&self) -> &str {
            &self.0
        }

        fn is_consequence(&self) -> bool {
            self.1
        }

        fn reported(rank: usize, code: &str, message: String) -> Self {
            Failed(format!("rank {rank}: {code}: {message}"), false)
        }
    }

    #[test]
    fn the_nats_address_is_found_in_every_url_form() {
        assert_eq!(nats_address("nats://127.0.0.1:4222"), "127.0.0.1:4222");
        assert_eq!(nats_address("nats://user:secret@nats.keel.svc:4223"), "nats.keel.svc:4223");
        assert_eq!(nats_address("nats://nats"), "nats:4222");
        assert_eq!(nats_address("tls://a:1,tls://b:2"), "a:1");
        assert_eq!(nats_address("10.0.0.1"), "10.0.0.1:4222");
    }

    #[test]
    fn the_leader_answers_with_the_error_that_started_a_failure() {
        let ok = status(&Ok::<(), Failed>(()));
        let consequence = status(&Err::<(), _>(Failed("aborted".into(), true)));
        let cause = status(&Err::<(), _>(Failed("non_finite".into(), false)));
        assert_eq!(settle::<_, Failed>(Ok(7), &[ok.clone(), ok.clone()]), Ok(7));
        let e = settle::<i32, Failed>(Ok(7), &[ok.clone(), consequence.clone(), cause.clone()]).unwrap_err();
        assert_eq!(e, Failed("rank 2: non_finite: non_finite".into(), false));
        let own = settle::<(), _>(Err(Failed("mine".into(), false)), &[ok.clone(), cause]).unwrap_err();
        assert_eq!(own.0, "mine", "the leader's own cause comes first");
        assert!(all_succeeded(&[ok.clone(), ok.clone()]));
        assert!(!all_succeeded(&[ok.clone(), consequence.clone()]));
        assert!(!all_succeeded(&[ok.clone(), b"{".to_vec()]));
        let e = settle::<i32, Failed>(Ok(7), &[ok, consequence]).unwrap_err();
        assert!(e.1, "only consequences: one of them");
        let bad = settle::<i32, Failed>(Ok(1), &[vec![], b"{".to_vec()]).unwrap_err();
        assert!(bad.0.contains("rank 1 sent a malformed status"), "{bad}");
    }

    /// The typed protocol: a ping no rank answers, commands every rank runs through
    /// [`follow`], a rank's failure answered by the leader, and a command a rank cannot read,
    /// after which the ranks leave and the leader's next turn reports the group lost.
    #[test]
    fn typed_commands_reach_every_follower_and_an_unreadable_one_ends_the_group() {
        #[derive(Serialize, Deserialize)]
        enum Command {
            Add(usize),
            Fail,
        }
        let results = crate::tcp::tests::on_ranks(3, |c| {
            if c.rank() == 0 {
                let lose = |e: Error| Failed(format!("lost: {e}"), false);
                ping(&c).unwrap();
                let added = lead_command(&c, &Command::Add(2), || Ok::<_, Failed>(1), lose);
                let failed = lead_command(&c, &Command::Fail, || Ok::<_, Failed>(1), lose);
                let garbled = lead::<(), Failed>(&c, b"garbled", || Ok(())).map_err(|(e, _)| e.to_string());
                let after = lead_command(&c, &Command::Add(1), || Ok::<_, Failed>(1), lose);
                vec![format!("{added:?}"), format!("{failed:?}"), format!("{garbled:?}"), format!("{after:?}")]
            } else {
                let mut total = 0;
                let why = follow(
                    &c,
                    |command, _| match command {
                        Command::Add(n) => {
                            total += n;
                            Ok(())
                        }
                        Command::Fail if c.rank() == 2 => Err(Failed("no".into(), false)),
                        Command::Fail => Ok(()),
                    },
                    |_| false,
                );
                vec![total.to_string(), why]
            }
        });
        assert_eq!(results[0][0], "Ok(1)");
        assert!(results[0][1].contains("rank 2: no: no"), "{:?}", results[0]);
        assert!(results[0][2].contains("rank 1: the leader sent a command this rank cannot read"), "{:?}", results[0]);
        assert!(results[0][3].contains("lost: "), "the ranks left: {:?}", results[0]);
        for rank in [1, 2] {
            assert_eq!(results[rank][0], "2", "rank {rank} ran the one Add(2)");
            assert!(results[rank][1].contains("cannot read"), "{:?}", results[rank]);
        }
    }

    #[test]
    fn a_group_configuration_names_its_bad_field() {
        let good = GroupConfig { name: "g".into(), rank: 1, size: 2, timeout_seconds: 5.0, address: None };
        assert!(good.problem().is_none());
        let field = |c: GroupConfig| c.problem().map(|(field, _)| field);
        assert_eq!(field(GroupConfig { rank: 2, ..good.clone() }), Some("group.rank"));
        assert_eq!(field(GroupConfig { size: 0, rank: 0, ..good.clone() }), Some("group.size"));
        assert_eq!(field(GroupConfig { name: "a.b".into(), ..good.clone() }), Some("group.name"));
        assert_eq!(field(GroupConfig { timeout_seconds: 0.0, ..good }), Some("group.timeout_seconds"));
    }

    #[test]
    fn a_leader_and_its_ranks_run_commands_in_lockstep_and_a_lost_rank_ends_the_group() {
        let results = crate::tcp::tests::on_ranks(3, |c| {
            let mut seen = Vec::new();
            if c.rank() == 0 {
                for command in [b"one".as_slice(), b"two"] {
                    let led = lead::<_, Failed>(&c, command, || Ok(command.len()));
                    seen.push(format!("{:?}", led.map_err(|(e, _)| e.to_string())));
                }
                let failed = lead::<usize, Failed>(&c, b"fail", || Ok(0));
                seen.push(format!("{failed:?}"));
                let lost = lead::<usize, Failed>(&c, b"after", || Ok(0));
                seen.push(format!("{}", lost.is_err()));
            } else {
                loop {
                    let Ok(command) = c.broadcast_bytes(&[], 0) else {
                        seen.push("left".into());
                        break;
                    };
                    let outcome: std::result::Result<(), Failed> = match (c.rank(), command.as_slice()) {
                        (2, b"fail") => Err(Failed("broken".into(), false)),
                        _ => Ok(()),
                    };
                    seen.push(String::from_utf8_lossy(&command).into_owned());
                    report(&c, &outcome).unwrap();
                    if outcome.is_err() {
                        break;
                    }
                }
            }
            seen
        });
        assert_eq!(results[0][..2], ["Ok(Ok(3))".to_string(), "Ok(Ok(3))".to_string()]);
        assert!(results[0][2].contains("rank 2: broken: broken"), "{:?}", results[0]);
        assert_eq!(results[0][3], "true", "rank 2 left: the next command fails");
        assert_eq!(results[2], ["one", "two", "fail"]);
        assert_eq!(results[1], ["one", "two", "fail", "left"]);
    }
}
