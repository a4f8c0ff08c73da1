//! Several hosts on this machine: network namespaces made by the test (`ip netns`), each
//! with a veth pair into a bridge of the test's own. NATS (a server of the test's own, on
//! the bridge's address), Postgres and the orchestrator, checkpoint store and reward
//! service stay in the machine's own namespace; a trainer group of four processes, one per
//! namespace, trains a GRPO run at data parallelism 2 × tensor parallelism 2, and the
//! run's generator is a group of two processes (tensor parallelism 2) on the first two
//! namespaces, the ranks meeting over NATS and talking TCP between the namespaces (rollouts,
//! and the weights of every refit broadcast from the generator's leader). The weights reach
//! the generator's leader by the collective transfer: the trainer group's leader sends them
//! over a communicator the two form for each refit.
//!
//! A trainer rank is killed midway: the run fails that attempt with an error naming the
//! group, waits for the group to be whole again (the rank is started again) and resumes from
//! its latest checkpoint. Later a rank of the generator is killed: the generator's leader
//! exits instead of hanging, both are started again (as a supervisor would) and the run goes
//! on. It succeeds with every step recorded once.
//!
//! Making namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN): without it the test says
//! the hosts were skipped and runs the same group with every rank on this host (loopback).

#![allow(clippy::unwrap_used)]

mod stack;

use std::process::Command;
use std::time::{Duration, Instant};

use keel_testkit::{NatsServer, ServiceProcess};
use serde_json::json;
use stack::{Servers, Stack, grpo_spec};

const RANKS: usize = 4;
const STEPS: u64 = 8;

/// Runs `ip ARGS`, returning whether it worked (and its error output when not).
fn ip(args: &[&str]) -> Result<(), String> {
    let output = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&output.stderr).trim()))
    }
}

/// The test's hosts: a bridge with address .1 in this namespace, and a namespace per host
/// with address .2, .3, ... on it. Removed when dropped. Without namespaces (`local`), every
/// host is this one, on loopback.
struct Hosts {
    tag: String,
    subnet: String,
    namespaces: Vec<String>,
}

impl Hosts {
    fn local() -> Self {
        Self { tag: String::new(), subnet: String::new(), namespaces: Vec::new() }
    }

    fn is_local(&self) -> bool {
        self.tag.is_empty()
    }

    fn create(count: usize) -> Result<Self, String> {
        let id = std::process::id();
        let tag = format!("{:04x}", id & 0xffff);
        let subnet = format!("10.{}.{}", 200 + (id >> 8) % 50, id % 250);
        let mut hosts = Self { tag, subnet, namespaces: Vec::new() };
        let bridge = hosts.bridge();
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        ip(&["addr", "add", &format!("{}/24", hosts.gateway()), "dev", &bridge])?;
        ip(&["link", "set", &bridge, "up"])?;
        hosts.forwarding(true);
        for i in 0..count {
            let namespace = format!("keel-{}-{i}", hosts.tag);
            ip(&["netns", "add", &namespace])?;
            hosts.namespaces.push(namespace.clone());
            let (outside, inside) = (format!("kv{}h{i}", hosts.tag), format!("kv{}n{i}", hosts.tag));
            ip(&["link", "add", &outside, "type", "veth", "peer", "name", &inside])?;
            ip(&["link", "set", &inside, "netns", &namespace])?;
            ip(&["link", "set", &outside, "master", &bridge, "up"])?;
            ip(&["-n", &namespace, "addr", "add", &format!("{}/24", hosts.address(i)), "dev", &inside])?;
            ip(&["-n", &namespace, "link", "set", &inside, "up"])?;
            ip(&["-n", &namespace, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    fn bridge(&self) -> String {
        format!("kbr{}", self.tag)
    }

    /// Lets traffic between the hosts cross the bridge whatever iptables' FORWARD policy
    /// (Docker sets it to DROP and has bridged frames go through iptables), by a rule of the
    /// test's own at the top of that chain; `false` takes the rule out again. Without
    /// iptables there is no such filter, and nothing to do.
    fn forwarding(&self, allow: bool) {
        let bridge = self.bridge();
        let action = if allow { "-I" } else { "-D" };
        let _ = Command::new("iptables")
            .args([action, "FORWARD", "-i", &bridge, "-o", &bridge, "-j", "ACCEPT"])
            .stderr(std::process::Stdio::null())
            .status();
    }

    /// The machine's own address on the bridge.
    fn gateway(&self) -> String {
        if self.is_local() { "127.0.0.1".into() } else { format!("{}.1", self.subnet) }
    }

    fn address(&self, host: usize) -> String {
        format!("{}.{}", self.subnet, host + 2)
    }

    /// The command prefix that runs a program on host `host`.
    fn wrapper(&self, host: usize) -> Vec<&str> {
        match self.namespaces.get(host) {
            Some(namespace) => vec!["ip", "netns", "exec", namespace],
            None => Vec::new(),
        }
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for namespace in &self.namespaces {
            let _ = ip(&["netns", "delete", namespace]);
        }
        if !self.tag.is_empty() {
            self.forwarding(false);
            let _ = ip(&["link", "delete", &self.bridge()]);
        }
    }
}

/// Rank `rank` of the trainer group, in its namespace.
fn start_rank(hosts: &Hosts, rank: usize, prefix: &str, nats_url: &str) -> ServiceProcess {
    let rank_text = rank.to_string();
    let size = RANKS.to_string();
    let env = [
        ("KEEL_TRAINER__SUBJECT_PREFIX", prefix),
        ("KEEL_TRAINER__NATS_URL", nats_url),
        ("KEEL_TRAINER__GROUP__NAME", "multihost"),
        ("KEEL_TRAINER__GROUP__RANK", &rank_text),
        ("KEEL_TRAINER__GROUP__SIZE", &size),
        ("KEEL_TRAINER__GROUP__TIMEOUT_SECONDS", "60"),
    ];
    ServiceProcess::start_in(&hosts.wrapper(rank), "trainer", &env)
}

/// Rank `rank` of the run's generator group (tensor parallelism 2), on host `rank`.
fn start_generator_rank(hosts: &Hosts, rank: usize, prefix: &str, nats_url: &str, model: &str) -> ServiceProcess {
    let rank_text = rank.to_string();
    let mut env = vec![
        ("KEEL_GENERATOR__SUBJECT_PREFIX", prefix),
        ("KEEL_GENERATOR__NATS_URL", nats_url),
        ("KEEL_GENERATOR__GROUP__NAME", "multihost"),
        ("KEEL_GENERATOR__GROUP__RANK", &rank_text),
        ("KEEL_GENERATOR__GROUP__SIZE", "2"),
        ("KEEL_GENERATOR__GROUP__TIMEOUT_SECONDS", "60"),
    ];
    if rank == 0 {
        env.push(("KEEL_GENERATOR__MODEL", model));
    }
    ServiceProcess::start_in(&hosts.wrapper(rank), "generator", &env)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dp2_tp2_grpo_run_across_four_hosts_survives_a_killed_rank() {
    let hosts = match Hosts::create(RANKS) {
        Ok(hosts) => hosts,
        Err(why) => {
            eprintln!("SKIPPED the hosts: cannot make network namespaces here (needs root): {why}");
            eprintln!("every rank runs on this host instead");
            Hosts::local()
        }
    };
    let nats = NatsServer::start(&hosts.gateway(), None, &[]);
    // Every host reaches NATS on the bridge.
    for host in (0..RANKS).filter(|_| !hosts.is_local()) {
        let connect = format!("exec 3<>/dev/tcp/{}/{}", nats.host, nats.port);
        let reach =
            Command::new("ip").args(["netns", "exec", &hosts.namespaces[host], "bash", "-c", &connect]).output();
        let reach = reach.unwrap();
        assert!(reach.status.success(), "host {host} cannot reach NATS: {}", String::from_utf8_lossy(&reach.stderr));
    }
    let servers = Servers { nats_url: Some(nats.url()), ..Servers::default() };
    let mut stack = Stack::start_on(&[("KEEL_ORCHESTRATOR__MAX_ATTEMPTS", "5")], &servers);
    // The stack's own trainer and generator would take the run: this one runs on the groups
    // only (the generator's follower first: its leader loads once every rank is there).
    stack.trainer.kill();
    stack.generator.kill();
    let model = stack.model.to_str().unwrap().to_string();
    let mut generators: Vec<ServiceProcess> =
        [1, 0].into_iter().map(|rank| start_generator_rank(&hosts, rank, &stack.prefix, &nats.url(), &model)).collect();
    let mut ranks: Vec<ServiceProcess> =
        (0..RANKS).map(|rank| start_rank(&hosts, rank, &stack.prefix, &nats.url())).collect();

    let mut spec = grpo_spec(&json!({"path": stack.model}));
    spec["tensor_parallel_size"] = json!(2);
    spec["data_parallel_size"] = json!(2);
    spec["max_num_steps"] = json!(STEPS);
    spec["checkpointing"] = json!({"save_period": 2});
    spec["validation"]["period"] = json!(0);
    // Each refit's weights are sent by the trainer group's leader to the generator's leader
    // over a communicator the two form (TCP, the trainer listening on its host's address).
    spec["generation"]["weight_transfer"] = json!("collective");
    let id = stack.submit(&spec).await;

    // Midway: after the checkpoint of step 2, the last rank (on the fourth host) dies.
    let started = Instant::now();
    let at = loop {
        let run = stack.get(&format!("/v1/runs/{id}")).await;
        assert!(!matches!(run["status"].as_str(), Some("failed" | "cancelled" | "succeeded")), "{run}");
        let step = run["step"].as_u64().unwrap();
        if step >= 3 {
            break step;
        }
        assert!(started.elapsed() < Duration::from_secs(600), "the run did not reach step 3: {run}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(at < STEPS, "the run finished before the rank was killed");
    ranks[RANKS - 1].kill();
    eprintln!("killed rank {} at step {at}", RANKS - 1);
    // The run fails its attempt and waits in the queue while the group is not whole.
    let requeued = stack
        .wait_for(&id, Duration::from_secs(120), |run| run["status"] == "queued" || run["status"] == "failed")
        .await;
    assert_eq!(requeued["status"], "queued", "{requeued}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    ranks[RANKS - 1] = start_rank(&hosts, RANKS - 1, &stack.prefix, &nats.url());

    // Later, the generator's second rank (on the second host) dies: the generator's leader
    // exits instead of hanging; both are started again (as a supervisor would), and the run
    // goes on with them.
    let resumed = stack.wait_for(&id, Duration::from_secs(300), |run| run["step"].as_u64() >= Some(at + 2)).await;
    let generator_at = resumed["step"].as_u64().unwrap();
    assert!(generator_at < STEPS, "the run finished before the generator's rank was killed: {resumed}");
    generators[0].kill();
    let exited = generators[1].wait_exit(Duration::from_secs(60)).expect("the generator's leader exits");
    assert!(!exited.success(), "{exited}");
    eprintln!("killed the generator's rank 1 at step {generator_at}: its leader exited ({exited})");
    generators =
        [1, 0].into_iter().map(|rank| start_generator_rank(&hosts, rank, &stack.prefix, &nats.url(), &model)).collect();

    let run = stack.wait_succeeded(&id, Duration::from_secs(600)).await;
    assert_eq!(run["step"], STEPS, "{run}");
    let losses = stack.series(&id, "train/loss").await;
    let steps: Vec<u64> = losses.iter().map(|(step, _)| *step).collect();
    assert_eq!(steps, (1..=STEPS).collect::<Vec<_>>(), "train/loss at exactly 1..{STEPS}");
    assert!(losses.iter().all(|(_, loss)| loss.is_finite()), "{losses:?}");
    let events = stack.http.get(format!("{}/v1/runs/{id}/events", stack.api())).send().await.unwrap();
    let text = events.text().await.unwrap();
    assert!(text.contains("attempt 1 failed, retrying"), "{text}");
    assert!(text.contains("trainer group"), "the failure names the trainer group: {text}");
    assert!(text.contains("resumed") || text.contains("\"running\""), "{text}");
    let checkpoints = stack.get(&format!("/v1/runs/{id}/checkpoints")).await;
    let saved: Vec<u64> = checkpoints.as_array().unwrap().iter().map(|c| c["step"].as_u64().unwrap()).collect();
    assert!(saved.contains(&STEPS), "{checkpoints}");
    let over = if hosts.is_local() { "processes on one host" } else { "hosts (network namespaces)" };
    eprintln!(
        "GRPO at DP 2 x TP 2 over {RANKS} {over}, generated by a TP 2 generator group on two of them: trainer \
         rank {} killed at step {at}, the generator's rank 1 at step {generator_at}, run succeeded",
        RANKS - 1
    );
    drop((ranks, generators));
}
