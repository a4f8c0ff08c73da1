//! NATS with Keel's authorization (`docker/nats.conf`): a nats-server of the test's own with
//! that file (its subjects moved to the test's prefix), each service connecting as its own
//! user. A GRPO run goes through end to end, large bodies pass through the object store
//! between the users that share them, and what the report's attacker did is refused: no
//! password, no connection; the generator's user cannot claim a trainer (it may only ask one
//! for an export kept for the collective transfer, which the run uses), the reward
//! service's cannot publish weights, and neither can listen on subjects that are not theirs.

#![allow(clippy::unwrap_used)]

mod stack;

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use keel_testkit::NatsServer;
use serde_json::json;
use stack::{Servers, Stack, grpo_spec};

const SERVICES: [&str; 5] = ["orchestrator", "trainer", "generator", "reward", "checkpoint"];

/// A nats-server of the test's own with Keel's authorization: `docker/nats.conf` with its
/// subjects moved to `prefix`, and each service's password.
fn start_nats(prefix: &str, passwords: &BTreeMap<&str, String>) -> (NatsServer, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let template = std::fs::read_to_string(keel_testkit::workspace_root().join("docker/nats.conf")).unwrap();
    let config = dir.path().join("nats.conf");
    std::fs::write(&config, template.replace("keel.v1.", &format!("{prefix}."))).unwrap();
    let env: Vec<(String, String)> = passwords
        .iter()
        .map(|(service, password)| (format!("KEEL_NATS_{}_PASSWORD", service.to_uppercase()), password.clone()))
        .collect();
    (NatsServer::start("127.0.0.1", Some(&config), &env), dir)
}

/// Whether a message published by `sender` on `subject` reaches `listener` (subscribed
/// first). An allowed publish is sent again every half second for up to ten seconds, so a
/// loaded machine does not read as a refusal; a refused one is sent once and waited for two.
async fn arrives(listener: &async_nats::Client, sender: &async_nats::Client, subject: &str, expected: bool) -> bool {
    let mut subscription = listener.subscribe(subject.to_string()).await.unwrap();
    listener.flush().await.unwrap();
    let (tries, wait) = if expected { (20, Duration::from_millis(500)) } else { (1, Duration::from_secs(2)) };
    for _ in 0..tries {
        let _ = sender.publish(subject.to_string(), "{}".into()).await;
        let _ = sender.flush().await;
        if tokio::time::timeout(wait, subscription.next()).await.is_ok_and(|m| m.is_some()) {
            return true;
        }
    }
    false
}

#[tokio::test(flavor = "multi_thread")]
async fn with_authorization_on_runs_work_and_the_reported_attacks_are_refused() {
    let prefix = format!("auth.{}", uuid::Uuid::new_v4().simple());
    let passwords: BTreeMap<&str, String> =
        // Passwords start with a letter: nats-server reads one that starts with a digit as a number.
        SERVICES.iter().map(|s| (*s, format!("k{}", uuid::Uuid::new_v4().simple()))).collect();
    let (nats, _config) = start_nats(&prefix, &passwords);
    let connect = |user: &str| {
        let url = nats.url_as(user, &passwords[user]);
        async move { keel_service::nats::connect(&url).await }
    };

    // No password, or a wrong one: no connection, and the error shows no password.
    let anonymous = keel_service::nats::connect(&format!("nats://127.0.0.1:{}", nats.port)).await;
    assert!(anonymous.is_err(), "an anonymous client connected");
    let wrong = keel_service::nats::connect(&nats.url_as("trainer", "guess")).await.unwrap_err().to_string();
    assert!(wrong.contains("trainer:***@") && !wrong.contains("guess"), "{wrong}");

    // Large bodies: the orchestrator puts a batch in the object store, the trainer reads it.
    let orchestrator = connect("orchestrator").await.unwrap();
    let trainer = connect("trainer").await.unwrap();
    let bucket = format!("keel-auth-{}", uuid::Uuid::new_v4().simple());
    let put = keel_service::nats::Bulk::open(orchestrator.clone(), &bucket).await.unwrap();
    let big = vec![7u32; 600_000];
    let payload = put.wrap(big.clone()).await.unwrap();
    assert!(matches!(payload, keel_protocol::Payload::Object(_)), "2.4 MB travels as an object");
    let get = keel_service::nats::Bulk::open(trainer.clone(), &bucket).await.unwrap();
    assert_eq!(get.fetch::<Vec<u32>>(payload).await.unwrap(), big);
    // No user may delete a stream: not the trainer's, nor the orchestrator that made it.
    for (user, client) in [("trainer", &trainer), ("orchestrator", &orchestrator)] {
        let js = async_nats::jetstream::new(client.clone());
        let deleted = tokio::time::timeout(Duration::from_secs(10), js.delete_object_store(&bucket)).await;
        assert!(!matches!(deleted, Ok(Ok(_))), "the {user} user deleted the bucket");
    }
    assert!(
        async_nats::jetstream::new(orchestrator.clone()).get_object_store(&bucket).await.is_ok(),
        "the bucket is gone"
    );

    // The reported attacks, each next to the allowed publish that shows the check can see it.
    // Each check has fresh connections: a refusal must not be what makes another one fail.
    let subjects = keel_protocol::Subjects::new(&prefix).unwrap();
    let check = |listener: &'static str, sender: &'static str, subject: String, expected: bool| {
        let (listener, sender) = (nats.url_as(listener, &passwords[listener]), nats.url_as(sender, &passwords[sender]));
        async move {
            let listener = keel_service::nats::connect(&listener).await.unwrap();
            let sender = keel_service::nats::connect(&sender).await.unwrap();
            arrives(&listener, &sender, &subject, expected).await
        }
    };
    // An allowed publish (expected to arrive), and a refused one.
    let allowed = |listener, sender, subject| check(listener, sender, subject, true);
    let reaches = |listener, sender, subject| check(listener, sender, subject, false);
    let claim = subjects.trainer_claim();
    assert!(allowed("trainer", "orchestrator", claim.clone()).await, "the orchestrator claims trainers");
    assert!(!reaches("trainer", "generator", claim.clone()).await, "the generator's user claimed a trainer");
    assert!(!reaches("trainer", "reward", claim.clone()).await, "the reward service's user claimed a trainer");
    let save = subjects.trainer("w1", keel_protocol::subjects::TrainerOp::Save);
    assert!(!reaches("trainer", "reward", save).await, "the reward service's user asked a trainer to save");
    let score = subjects.trainer("w1", keel_protocol::subjects::TrainerOp::Score);
    assert!(allowed("trainer", "reward", score).await, "the reward service asks trainers for scores");
    let weights = subjects.weights_updated("r1");
    assert!(allowed("generator", "orchestrator", weights.clone()).await, "the orchestrator publishes weights");
    assert!(!reaches("generator", "reward", weights.clone()).await, "the reward service's user published weights");
    assert!(!reaches("generator", "trainer", weights).await, "the trainer's user published weights");
    let memory = subjects.generator_memory("r1");
    assert!(allowed("generator", "orchestrator", memory.clone()).await, "the orchestrator puts generators to sleep");
    assert!(!reaches("generator", "reward", memory).await, "the reward service's user put generators to sleep");
    // A generator asks a trainer for an export kept for the collective transfer, and meets it
    // to receive it; it cannot ask for an export itself.
    let send = subjects.trainer_send_weights("w1");
    assert!(allowed("trainer", "generator", send.clone()).await, "a generator asks a trainer for weights");
    assert!(!reaches("trainer", "reward", send).await, "the reward service's user asked a trainer for weights");
    let meeting = format!("{}.s1", subjects.trainer_weights_meeting("w1"));
    assert!(allowed("trainer", "generator", meeting).await, "a generator meets a trainer to receive weights");
    let export = subjects.trainer("w1", keel_protocol::subjects::TrainerOp::Export);
    assert!(!reaches("trainer", "generator", export).await, "the generator's user asked a trainer to export");
    // Listening on another service's subjects is refused too.
    assert!(!reaches("generator", "orchestrator", claim).await, "the generator's user listened to trainer claims");
    assert!(!reaches("reward", "orchestrator", subjects.generate("r1")).await, "the reward user listened to rollouts");
    // Only the orchestrator claims and loads generators.
    let claim = subjects.generator_claim();
    assert!(allowed("generator", "orchestrator", claim.clone()).await, "the orchestrator claims generators");
    assert!(!reaches("generator", "reward", claim).await, "the reward service's user claimed a generator");
    let load = subjects.generator("g1", keel_protocol::subjects::GeneratorOp::Load);
    assert!(!reaches("generator", "trainer", load).await, "the trainer's user had a generator load a model");
    // The orchestrator reaches every operation of a generator; the reward service cannot open
    // an agent session (a key to the policy's API) itself.
    for op in keel_protocol::subjects::GeneratorOp::ALL {
        let subject = subjects.generator("g1", op);
        assert!(allowed("generator", "orchestrator", subject).await, "the orchestrator sends {}", op.name());
    }
    let open = subjects.generator("g1", keel_protocol::subjects::GeneratorOp::AgentOpen);
    assert!(!reaches("generator", "reward", open).await, "the reward service's user opened an agent session");

    // Replies: each user reads only its own inbox, and answers only the users that ask it.
    let to_orchestrator = "_INBOX_orchestrator.probe".to_string();
    assert!(allowed("orchestrator", "trainer", to_orchestrator.clone()).await, "a trainer answers the orchestrator");
    assert!(
        !reaches("reward", "trainer", to_orchestrator.clone()).await,
        "the reward user read the orchestrator's replies"
    );
    assert!(
        !reaches("generator", "trainer", to_orchestrator.clone()).await,
        "the generator user read the orchestrator's replies"
    );
    assert!(
        !reaches("orchestrator", "checkpoint", to_orchestrator).await,
        "the checkpoint user answered the orchestrator"
    );
    let to_generator = "_INBOX_generator.probe".to_string();
    assert!(allowed("generator", "trainer", to_generator.clone()).await, "a trainer answers a generator");
    assert!(!reaches("generator", "reward", to_generator).await, "the reward user answered in a trainer's place");
    assert!(!reaches("trainer", "orchestrator", "_INBOX.probe".into()).await, "a user read the shared inbox");
    assert_eq!(keel_service::nats::inbox_prefix("trainer").as_deref(), Some("_INBOX_trainer"));

    // And a run goes through with every service on its own user.
    let servers = Servers {
        nats_urls: SERVICES.iter().map(|s| (*s, nats.url_as(s, &passwords[s]))).collect(),
        ..Servers::default()
    };
    let stack = Stack::start_on_prefix(&prefix, &[], &servers);
    // Its weights travel by the collective transfer: a generator asks the trainer on its user.
    let mut spec = grpo_spec(&json!({"path": stack.model}));
    spec["generation"]["weight_transfer"] = json!("collective");
    let id = stack.submit(&spec).await;
    let run = stack.wait_succeeded(&id, Duration::from_secs(300)).await;
    assert_eq!(run["step"], 3);
    assert_eq!(stack.series(&id, "train/loss").await.len(), 3);
    let refit = stack.series(&id, "timing/train/generator_refit").await;
    assert!(!refit.is_empty(), "the generators reported the weights they received");
}
