//! The deployment files agree with each other and with the local launcher: compose.yaml
//! passes a Compose validator (docker-compose 1.29.2 from PyPI, which checks the file
//! against the Compose Specification schema; `scripts/setup` installs it in .venv-compose),
//! each service's `command` and host-independent environment are exactly those of
//! scripts/stack.sh, every Keel service exports traces to Jaeger, has a health check and
//! waits for what it needs, and the gpu profile reserves the NVIDIA GPUs. And the repository
//! stands alone: no tracked file points at documents outside it.
//!
//! The Kubernetes manifests (deploy/kubernetes, rendered by `kubectl kustomize`) pass a
//! schema validator (kubernetes-validate from PyPI, in .venv-kube), run the same commands on
//! the same ports with the same probes, and each service's own configuration loader accepts
//! the environment they give it (`keel-<service> --check-config`).
//!
//! No Docker engine or cluster is needed: nothing is built or started.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use serde_yaml_ng::Value;

const SERVICES: [&str; 5] = ["orchestrator", "generator", "reward", "checkpoint", "trainer"];

fn root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// compose.yaml with its `<<` merge keys applied. serde_yaml_ng applies one level per pass (a
/// merged-in mapping that has a merge key of its own keeps it), so it runs until none is left.
fn compose() -> Value {
    let text = std::fs::read_to_string(root().join("compose.yaml")).expect("read compose.yaml");
    let mut value: Value = serde_yaml_ng::from_str(&text).expect("compose.yaml is YAML");
    for _ in 0..8 {
        value.apply_merge().expect("compose.yaml's merge keys");
        if !has_merge_key(&value) {
            return value;
        }
    }
    panic!("compose.yaml: merge keys nested too deep");
}

fn has_merge_key(value: &Value) -> bool {
    match value {
        Value::Mapping(m) => m.contains_key("<<") || m.values().any(has_merge_key),
        Value::Sequence(s) => s.iter().any(has_merge_key),
        Value::Tagged(t) => has_merge_key(&t.value),
        _ => false,
    }
}

fn services(compose: &Value) -> BTreeMap<String, Value> {
    compose["services"]
        .as_mapping()
        .expect("compose.yaml has services")
        .iter()
        .map(|(k, v)| (k.as_str().unwrap().to_string(), v.clone()))
        .collect()
}

fn scalar(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        other => panic!("not a scalar: {other:?}"),
    }
}

/// A service's `command` as words (the list form, or a string split at spaces).
fn command(service: &Value) -> Vec<String> {
    match &service["command"] {
        Value::Sequence(words) => words.iter().map(scalar).collect(),
        Value::String(s) => s.split_whitespace().map(str::to_string).collect(),
        Value::Null => Vec::new(),
        other => panic!("command: {other:?}"),
    }
}

/// A service's `environment`, map or `VAR=VALUE` list form.
fn environment(service: &Value) -> BTreeMap<String, String> {
    match &service["environment"] {
        Value::Mapping(m) => m.iter().map(|(k, v)| (scalar(k), scalar(v))).collect(),
        Value::Sequence(items) => items
            .iter()
            .map(|item| {
                let item = scalar(item);
                let (k, v) = item.split_once('=').unwrap_or((item.as_str(), ""));
                (k.to_string(), v.to_string())
            })
            .collect(),
        _ => BTreeMap::new(),
    }
}

/// `bash scripts/stack.sh WHAT`: `name: value` lines.
fn launcher(what: &str) -> Vec<(String, String)> {
    let out = Command::new("bash").arg("scripts/stack.sh").arg(what).current_dir(root()).output().expect("run bash");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bash scripts/stack.sh {what}: {}", String::from_utf8_lossy(&out.stderr));
    stdout
        .lines()
        .map(|line| {
            let (name, value) = line.split_once(": ").unwrap_or_else(|| panic!("stack.sh {what}: `{line}`"));
            (name.to_string(), value.to_string())
        })
        .collect()
}

/// The Keel services of compose.yaml: name → (launcher service it runs, definition). A
/// variant such as `trainer-gpu` runs the same command as `trainer`.
fn keel_services(compose: &Value) -> Vec<(String, &'static str, Value)> {
    services(compose)
        .into_iter()
        .filter_map(|(name, service)| {
            let command = command(&service);
            let base = SERVICES.into_iter().find(|s| command.first().is_some_and(|c| *c == format!("keel-{s}")))?;
            Some((name, base, service))
        })
        .collect()
}

#[test]
fn compose_file_passes_the_validator() {
    let validator = root().join(".venv-compose/bin/docker-compose");
    assert!(
        validator.exists(),
        "the compose validator {} is not installed: run scripts/setup (it installs docker-compose 1.29.2 from PyPI)",
        validator.display()
    );
    let version = Command::new(&validator).args(["version", "--short"]).output().expect("run docker-compose");
    assert_eq!(String::from_utf8_lossy(&version.stdout).trim(), "1.29.2", "run scripts/setup");
    let (_dir, secrets) = secrets_file();
    for profiles in [&[][..], &["--profile", "gpu"][..]] {
        let out = Command::new(&validator)
            .args(profiles)
            .arg("--env-file")
            .arg(&secrets)
            .args(["-f", "compose.yaml", "config", "-q"])
            .current_dir(root())
            .env_remove("COMPOSE_FILE")
            .env_remove("COMPOSE_PROFILES")
            .output()
            .expect("run docker-compose config");
        assert!(
            out.status.success(),
            "docker-compose {} config -q rejects compose.yaml:\n{}",
            profiles.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A `.env` as `scripts/make-secrets` writes it, in a directory of its own.
fn secrets_file() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join(".env");
    let made = Command::new("bash").arg(root().join("scripts/make-secrets")).arg(&file).output().unwrap();
    assert!(made.status.success(), "scripts/make-secrets: {}", String::from_utf8_lossy(&made.stderr));
    (dir, file)
}

/// `docker-compose --env-file ENV --profile gpu -f compose.yaml config` (the validator's
/// rendering, variables substituted); `Err` holds its stderr.
fn compose_config(env: &std::path::Path) -> Result<Value, String> {
    let out = Command::new(root().join(".venv-compose/bin/docker-compose"))
        .arg("--env-file")
        .arg(env)
        .args(["--profile", "gpu", "-f", "compose.yaml", "config"])
        .current_dir(root())
        .env_remove("COMPOSE_FILE")
        .env_remove("COMPOSE_PROFILES")
        .output()
        .expect("run docker-compose config");
    if out.status.success() {
        Ok(serde_yaml_ng::from_slice(&out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// The secrets each container is given: Compose service → the `.env` names whose values
/// appear in its environment. Every other container is given none.
const SECRETS_OF: [(&str, &[&str]); 10] = [
    (
        "orchestrator",
        &["KEEL_API_TOKEN", "KEEL_CHECKPOINT_TOKEN", "POSTGRES_PASSWORD", "KEEL_NATS_ORCHESTRATOR_PASSWORD"],
    ),
    ("generator", &["KEEL_GENERATOR_API_KEY", "KEEL_NATS_GENERATOR_PASSWORD"]),
    ("generator-gpu", &["KEEL_GENERATOR_API_KEY", "KEEL_NATS_GENERATOR_PASSWORD"]),
    ("reward", &["KEEL_REWARD_TOKEN", "KEEL_NATS_REWARD_PASSWORD"]),
    ("checkpoint", &["KEEL_CHECKPOINT_TOKEN", "POSTGRES_PASSWORD", "KEEL_NATS_CHECKPOINT_PASSWORD"]),
    ("trainer", &["KEEL_TRAINER_TOKEN", "KEEL_NATS_TRAINER_PASSWORD"]),
    ("trainer-gpu", &["KEEL_TRAINER_TOKEN", "KEEL_NATS_TRAINER_PASSWORD"]),
    (
        "nats",
        &[
            "KEEL_NATS_CHECKPOINT_PASSWORD",
            "KEEL_NATS_GENERATOR_PASSWORD",
            "KEEL_NATS_ORCHESTRATOR_PASSWORD",
            "KEEL_NATS_REWARD_PASSWORD",
            "KEEL_NATS_TRAINER_PASSWORD",
        ],
    ),
    ("postgres", &["POSTGRES_PASSWORD"]),
    ("demo", &["KEEL_API_TOKEN"]),
];

/// No token or password has a value in compose.yaml or the Kubernetes base: both read what
/// `scripts/make-secrets` writes, and refuse to start without it, saying how to make it. Compose
/// publishes the API and dashboard, the generators' OpenAI API and the Jaeger UI only, on
/// 127.0.0.1 unless `KEEL_PUBLISH_ADDRESS` says otherwise, and gives each container only the
/// secrets it uses.
#[test]
fn compose_and_kubernetes_ship_no_secret_and_publish_on_loopback() {
    // Nothing published as an example is in a deployment file.
    let mut files = vec![root().join("compose.yaml"), root().join("docker/nats.conf")];
    for entry in std::fs::read_dir(root().join("deploy/kubernetes/base")).unwrap() {
        files.push(entry.unwrap().path());
    }
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for secret in keel_service::PUBLISHED_SECRETS.iter().filter(|s| s.starts_with("keel-local")) {
            assert!(!text.contains(secret), "{} ships the token {secret}", file.display());
        }
        assert!(!text.contains("POSTGRES_PASSWORD: keel"), "{} ships Postgres's password", file.display());
    }

    // Without .env, compose refuses and says how to make one.
    let empty = tempfile::NamedTempFile::new().unwrap();
    let refused = compose_config(empty.path()).expect_err("compose.yaml renders without any secret");
    assert!(refused.contains("scripts/make-secrets"), "the refusal says how to make the secrets: {refused}");

    let (_dir, env_file) = secrets_file();
    let secrets: BTreeMap<String, String> = std::fs::read_to_string(&env_file)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect();
    assert_eq!(secrets.len(), 11, "{secrets:?}");
    let rendered = compose_config(&env_file).unwrap();
    let mut published = BTreeMap::new();
    for (name, service) in services(&rendered) {
        for port in service["ports"].as_sequence().into_iter().flatten() {
            let port = scalar(port);
            assert!(port.starts_with("127.0.0.1:"), "{name} publishes {port} beyond loopback");
            published.insert(name.clone(), port);
        }
        let env: Vec<String> = environment(&service).into_values().collect();
        let given: Vec<&str> = secrets
            .iter()
            .filter(|(_, v)| env.iter().any(|e| e.contains(v.as_str())))
            .map(|(k, _)| k.as_str())
            .collect();
        let expected = SECRETS_OF.iter().find(|(n, _)| *n == name).map(|(_, s)| s.to_vec()).unwrap_or_default();
        let mut expected = expected;
        expected.sort();
        assert_eq!(given, expected, "the secrets compose gives `{name}`");
    }
    assert_eq!(
        published.keys().map(String::as_str).collect::<Vec<_>>(),
        ["generator", "generator-gpu", "jaeger", "orchestrator"],
        "what compose publishes: {published:?}"
    );
    assert_eq!(published["jaeger"], "127.0.0.1:16686:16686/tcp", "the Jaeger UI only");

    // Kubernetes: the Secret is made from secrets.env, which is not shipped; without it the
    // base does not render, and the error names the file.
    let copy = tempfile::tempdir().unwrap();
    for tree in ["deploy", "docker"] {
        assert!(Command::new("cp").arg("-r").arg(root().join(tree)).arg(copy.path()).status().unwrap().success());
    }
    let _ = std::fs::remove_file(copy.path().join("deploy/kubernetes/base/secrets.env"));
    let refused = kustomize_in(copy.path(), "base").expect_err("the base renders without secrets.env");
    assert!(refused.contains("secrets.env"), "{refused}");
    let docs = documents(&kustomize("base"));
    let secret = find_prefixed(&docs, "Secret", "keel-secrets");
    let keys: Vec<String> = secret["data"].as_mapping().unwrap().keys().map(scalar).collect();
    assert_eq!(keys, secrets.keys().cloned().collect::<Vec<_>>(), "keel-secrets holds what make-secrets writes");
}

#[test]
fn compose_commands_and_environment_are_the_launchers() {
    let compose = compose();
    let services = services(&compose);
    let commands = launcher("commands");
    let names: Vec<&str> = commands.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, SERVICES, "stack.sh commands lists the five services");
    for (name, line) in &commands {
        let service = services.get(name).unwrap_or_else(|| panic!("compose.yaml has no service `{name}`"));
        let expected: Vec<String> = line.split_whitespace().map(str::to_string).collect();
        assert_eq!(command(service), expected, "compose.yaml's `{name}` command is not scripts/stack.sh's");
    }
    // The variants (the gpu profile's) run the same commands.
    let keel = keel_services(&compose);
    assert!(keel.len() > SERVICES.len(), "the gpu variants run Keel's commands too: {:?}", services.keys());
    for (name, base, service) in &keel {
        let expected = &commands.iter().find(|(n, _)| n == base).unwrap().1;
        assert_eq!(command(service).join(" "), *expected, "{name}");
    }

    // Environment that stack.sh gives a service on every host is in compose.yaml too.
    let env = launcher("env");
    assert!(!env.is_empty(), "stack.sh env prints the host-independent environment");
    for (name, base, service) in &keel {
        let environment = environment(service);
        for (_, assignment) in env.iter().filter(|(n, _)| n == base) {
            let (var, value) = assignment.split_once('=').unwrap();
            assert_eq!(
                environment.get(var).map(String::as_str),
                Some(value),
                "compose.yaml's `{name}` lacks {assignment} (scripts/stack.sh sets it)"
            );
        }
    }

    // Each listens on its launcher port inside the container, which the health check asks.
    let ports: BTreeMap<String, String> = launcher("ports").into_iter().collect();
    for (name, base, service) in &keel {
        let port = &ports[*base];
        let listen = format!("KEEL_{}__LISTEN", base.to_uppercase());
        assert_eq!(environment(service).get(&listen), Some(&format!("0.0.0.0:{port}")), "{name}: {listen}");
        let test: Vec<String> =
            service["healthcheck"]["test"].as_sequence().map(|t| t.iter().map(scalar).collect()).unwrap_or_default();
        assert!(test.iter().any(|w| w.contains(&format!(":{port}/healthz"))), "{name}: health check {test:?}");
    }
}

#[test]
fn keel_services_trace_have_health_checks_and_wait_for_their_dependencies() {
    let compose = compose();
    let services = services(&compose);
    let keel = keel_services(&compose);
    let mut bases: Vec<&str> = keel.iter().map(|(_, b, _)| *b).collect();
    bases.sort_unstable();
    bases.dedup();
    assert_eq!(bases.len(), SERVICES.len(), "all five services are in compose.yaml");

    for (name, base, service) in &keel {
        let environment = environment(service);
        assert_eq!(
            environment.get("OTEL_EXPORTER_OTLP_ENDPOINT").map(String::as_str),
            Some("http://jaeger:4318"),
            "{name}: OTEL_EXPORTER_OTLP_ENDPOINT"
        );
        assert!(service["healthcheck"]["test"].as_sequence().is_some_and(|t| !t.is_empty()), "{name}: healthcheck");
        let depends =
            service["depends_on"].as_mapping().unwrap_or_else(|| panic!("{name}: depends_on with conditions"));
        let condition = |on: &str| depends.get(on).map(|d| scalar(&d["condition"]));
        for infra in ["nats", "postgres"] {
            assert_eq!(condition(infra).as_deref(), Some("service_healthy"), "{name} waits for {infra}");
        }
        match *base {
            "orchestrator" => assert_eq!(condition("checkpoint").as_deref(), Some("service_healthy"), "{name}"),
            "generator" => {
                assert_eq!(condition("model-init").as_deref(), Some("service_completed_successfully"), "{name}");
                let model = &environment["KEEL_GENERATOR__MODEL"];
                assert!(model.starts_with("/var/lib/keel/models/"), "{name}: model {model}");
            }
            _ => {}
        }
        for on in depends.keys() {
            assert!(services.contains_key(on.as_str().unwrap()), "{name} depends on unknown {on:?}");
        }
    }

    // The orchestrator's work_dir is a volume the trainers and generators mount at the same path.
    let work_dir = environment(&services["orchestrator"])["KEEL_ORCHESTRATOR__WORK_DIR"].clone();
    let mounts = |service: &Value| -> Vec<String> {
        service["volumes"].as_sequence().map(|v| v.iter().map(scalar).collect()).unwrap_or_default()
    };
    let work_mount = mounts(&services["orchestrator"])
        .into_iter()
        .find(|m| m.ends_with(&format!(":{work_dir}")))
        .expect("work_dir volume");
    for (name, base, service) in &keel {
        if matches!(*base, "orchestrator" | "trainer" | "generator") {
            assert!(mounts(service).contains(&work_mount), "{name} mounts {work_mount}");
        }
    }

    let jaeger = &services["jaeger"];
    assert_eq!(environment(jaeger).get("COLLECTOR_OTLP_ENABLED").map(String::as_str), Some("true"));
    // The UI is published; OTLP (4318) is for the services, inside the network.
    let ports: Vec<String> = jaeger["ports"].as_sequence().unwrap().iter().map(scalar).collect();
    assert!(ports.iter().any(|p| p.ends_with(":16686")), "jaeger publishes its UI: {ports:?}");
    assert!(environment(&services["orchestrator"])["OTEL_EXPORTER_OTLP_ENDPOINT"].ends_with("jaeger:4318"));
    assert!(jaeger["healthcheck"]["test"].as_sequence().is_some(), "jaeger health check");

    // The demo runs the shared client script from the image, once, after the model exists.
    let demo = &services["demo"];
    assert_eq!(command(demo), ["/usr/share/keel/scripts/demo-run"]);
    assert_eq!(scalar(&demo["restart"]), "no");
    assert!(demo["profiles"].is_null(), "`docker compose up` runs the demo");
    assert_eq!(scalar(&demo["environment"]["KEEL_DEMO_DONE"]), "/var/lib/keel/work/demo.done");
    assert_eq!(scalar(&demo["depends_on"]["model-init"]["condition"]), "service_completed_successfully");
    assert_eq!(scalar(&demo["depends_on"]["orchestrator"]["condition"]), "service_healthy");
    assert_eq!(
        scalar(&demo["environment"]["KEEL_API_TOKEN"]),
        scalar(&services["orchestrator"]["environment"]["KEEL_API_TOKEN"]),
        "the demo sends the orchestrator's API token"
    );
    let dockerfile = std::fs::read_to_string(root().join("docker/Dockerfile")).unwrap();
    for needed in ["COPY examples/ /usr/share/keel/examples/", "COPY scripts/demo-run /usr/share/keel/scripts/demo-run"]
    {
        assert!(dockerfile.contains(needed), "docker/Dockerfile: {needed}");
    }
    let model_init = command(&services["model-init"]).join(" ");
    assert!(model_init.contains("/usr/share/keel/examples/tokenizer-corpus.txt"), "{model_init}");
}

/// Where no registry is reachable, scripts/docker-engine makes every image compose.yaml and
/// docker/Dockerfile start from: a stand-in per third-party image, the Rust image from the
/// Dockerfile's own `FROM` line.
#[test]
fn docker_engine_script_makes_every_image_compose_starts_from() {
    let script = std::fs::read_to_string(root().join("scripts/docker-engine")).unwrap();
    let compose = compose();
    let images: std::collections::BTreeSet<String> =
        services(&compose).values().filter_map(|s| s["image"].as_str().map(String::from)).collect();
    assert!(images.contains("keel:latest"), "{images:?}");
    for image in images.iter().filter(|i| *i != "keel:latest") {
        let entry = script
            .lines()
            .find_map(|l| l.trim().trim_matches('"').strip_prefix(&format!("{image} ")).map(str::to_string))
            .unwrap_or_else(|| panic!("scripts/docker-engine has no stand-in for {image}"));
        let folder = root().join("docker/local").join(entry.trim());
        assert!(folder.join("Dockerfile").is_file(), "{image}: {} has no Dockerfile", folder.display());
    }
    let dockerfile = std::fs::read_to_string(root().join("docker/Dockerfile")).unwrap();
    // The images the stages start from, less the stages built on earlier ones.
    let mut stages = Vec::new();
    let mut bases = Vec::new();
    for line in dockerfile.lines().filter_map(|l| l.strip_prefix("FROM ")) {
        let words: Vec<&str> = line.split_whitespace().collect();
        if !stages.contains(&words[0]) {
            bases.push(words[0]);
        }
        if let [_, "AS", name] = words[..] {
            stages.push(name);
        }
    }
    assert_eq!(bases, ["rust:1.95-bookworm", "debian:bookworm-slim"], "docker/Dockerfile's base images");
    assert!(script.contains("sed -n 's/^FROM \\(rust:"), "the Rust image's name is read from docker/Dockerfile");
    assert!(script.contains("debian:bookworm-slim"), "the Debian base image");
}

#[test]
fn gpu_profile_reserves_nvidia_gpus_for_the_trainer_and_generator() {
    let compose = compose();
    let gpu: Vec<(String, &str, Value)> = keel_services(&compose)
        .into_iter()
        .filter(|(_, _, s)| s["profiles"].as_sequence().is_some_and(|p| p.iter().any(|p| p.as_str() == Some("gpu"))))
        .collect();
    let mut bases: Vec<&str> = gpu.iter().map(|(_, b, _)| *b).collect();
    bases.sort_unstable();
    assert_eq!(bases, ["generator", "trainer"], "the gpu profile's services");
    for (name, base, service) in &gpu {
        let devices = service["deploy"]["resources"]["reservations"]["devices"]
            .as_sequence()
            .unwrap_or_else(|| panic!("{name}: deploy.resources.reservations.devices"));
        assert!(
            devices.iter().any(|d| d["driver"].as_str() == Some("nvidia")
                && d["capabilities"].as_sequence().is_some_and(|c| c.iter().any(|c| c.as_str() == Some("gpu")))),
            "{name}: an nvidia device with the gpu capability: {devices:?}"
        );
        let device = format!("KEEL_{}__DEVICE", base.to_uppercase());
        assert_eq!(environment(service).get(&device).map(String::as_str), Some("cuda"), "{name}: {device}");
    }
    // The default services stay on the CPU and outside any profile.
    let services = services(&compose);
    for name in SERVICES {
        let service = &services[name];
        assert!(service["profiles"].is_null(), "{name} is in the default set");
        assert!(service["deploy"].is_null(), "{name} reserves no device");
    }
}

/// The repository stands alone: no tracked file points at documents outside it (the
/// planning folder beside a checkout is not part of the project).
#[test]
fn no_file_points_outside_the_repository() {
    let listed = Command::new("git").args(["ls-files", "-z"]).current_dir(root()).output().unwrap();
    assert!(listed.status.success(), "git ls-files failed");
    let outside = ["../shared/", "nemo-rl-reference.md", "DESIGN.md"];
    let mut found = Vec::new();
    for name in listed.stdout.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let name = String::from_utf8_lossy(name).into_owned();
        // Text files only; this test names the strings it looks for.
        let Ok(text) = std::fs::read_to_string(root().join(&name)) else { continue };
        if name == "tests/deploy.rs" {
            continue;
        }
        for needle in outside.iter().filter(|n| text.contains(**n)) {
            found.push(format!("{name}: {needle}"));
        }
    }
    assert!(found.is_empty(), "files that point outside the repository:\n{}", found.join("\n"));
}

/// Libraries sit below services: no crate under `shared/` depends (normally, for builds or
/// for tests) on a crate under `services/`.
#[test]
fn no_library_depends_on_a_service() {
    let output = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(root())
        .output()
        .unwrap();
    assert!(output.status.success(), "cargo metadata failed: {}", String::from_utf8_lossy(&output.stderr));
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let packages = metadata["packages"].as_array().unwrap();
    let root = root().canonicalize().unwrap();
    let under = |package: &serde_json::Value, folder: &str| {
        let manifest = PathBuf::from(package["manifest_path"].as_str().unwrap());
        manifest.strip_prefix(&root).is_ok_and(|p| p.starts_with(folder))
    };
    let services: Vec<&str> =
        packages.iter().filter(|p| under(p, "services")).map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(services.len(), SERVICES.len(), "services found: {services:?}");
    let mut found = Vec::new();
    for library in packages.iter().filter(|p| under(p, "shared")) {
        for dependency in library["dependencies"].as_array().unwrap() {
            let name = dependency["name"].as_str().unwrap();
            if services.contains(&name) {
                found.push(format!("{} -> {name}", library["name"].as_str().unwrap()));
            }
        }
    }
    assert!(found.is_empty(), "libraries that depend on a service:\n{}", found.join("\n"));
}

// --- Kubernetes (deploy/kubernetes) --------------------------------------------------------

/// The Kubernetes version the manifests are validated against.
const KUBERNETES_VERSION: &str = "1.32.0";

/// `kubectl kustomize deploy/kubernetes/<dir>`: the rendered manifests as one YAML stream.
/// The base's Secret comes from a `secrets.env` the user makes, which the repository does not
/// hold: the manifests are copied aside and given one from `scripts/make-secrets`.
fn kustomize(dir: &str) -> String {
    let copy = tempfile::tempdir().unwrap();
    for tree in ["deploy", "docker"] {
        let status = Command::new("cp").arg("-r").arg(root().join(tree)).arg(copy.path()).status().unwrap();
        assert!(status.success(), "copy {tree}");
    }
    // One set of secrets for every rendering of this test process, so that the Secret's
    // name (with its content's hash) is the same in all of them.
    static SECRETS: std::sync::OnceLock<(tempfile::TempDir, PathBuf)> = std::sync::OnceLock::new();
    let (_, made) = SECRETS.get_or_init(secrets_file);
    std::fs::copy(made, copy.path().join("deploy/kubernetes/base/secrets.env")).unwrap();
    kustomize_in(copy.path(), dir)
        .unwrap_or_else(|stderr| panic!("kubectl kustomize deploy/kubernetes/{dir}:\n{stderr}"))
}

/// `kubectl kustomize deploy/kubernetes/<dir>` in the tree `at`; `Err` holds its stderr.
fn kustomize_in(at: &std::path::Path, dir: &str) -> Result<String, String> {
    let out = Command::new("kubectl")
        .args(["kustomize", &format!("deploy/kubernetes/{dir}")])
        .current_dir(at)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run kubectl ({e}): the Kubernetes tests render the manifests with `kubectl kustomize` (kubectl 1.21 or newer)")
        });
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn documents(stream: &str) -> Vec<Value> {
    use serde::Deserialize;
    serde_yaml_ng::Deserializer::from_str(stream).map(|d| Value::deserialize(d).unwrap()).collect()
}

/// Runs kubernetes-validate (PyPI; its JSON schemas are bundled, nothing is fetched) in
/// strict mode, which also refuses fields a kind does not have. `Err` holds its output.
fn kubernetes_validate(stream: &str) -> Result<(), String> {
    let validator = root().join(".venv-kube/bin/kubernetes-validate");
    assert!(
        validator.exists(),
        "{} is not installed: run scripts/setup (it installs kubernetes-validate from PyPI into .venv-kube)",
        validator.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("manifests.yaml");
    std::fs::write(&file, stream).unwrap();
    let out = Command::new(validator)
        .args(["--strict", "--quiet", "-k", KUBERNETES_VERSION])
        .arg(&file)
        .output()
        .expect("run kubernetes-validate");
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
    }
}

/// The object of `kind` named `name` or `name-<hash>` (what a kustomize generator makes).
fn find_prefixed<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| {
            d["kind"].as_str() == Some(kind)
                && d["metadata"]["name"].as_str().is_some_and(|n| n == name || n.starts_with(&format!("{name}-")))
        })
        .unwrap_or_else(|| panic!("the manifests have no {kind} {name}"))
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"].as_str() == Some(kind) && d["metadata"]["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("the manifests have no {kind} {name}"))
}

/// The Deployment or StatefulSet `name` and its container of the same role.
fn workload<'a>(docs: &'a [Value], name: &str) -> (&'a Value, &'a Value) {
    let workload = docs
        .iter()
        .find(|d| {
            matches!(d["kind"].as_str(), Some("Deployment" | "StatefulSet"))
                && d["metadata"]["name"].as_str() == Some(name)
        })
        .unwrap_or_else(|| panic!("the manifests have no Deployment or StatefulSet {name}"));
    let containers = workload["spec"]["template"]["spec"]["containers"].as_sequence().unwrap();
    assert_eq!(containers.len(), 1, "{name}: one container");
    (workload, &containers[0])
}

/// A container's environment as the kubelet gives it: `envFrom` ConfigMaps, then `env` in
/// order with `secretKeyRef`, `configMapKeyRef` and `fieldRef: metadata.name` resolved (the
/// pod is `<workload>-0`) and `$(VAR)` expanded from the variables before it.
fn container_env(docs: &[Value], workload_name: &str, container: &Value) -> BTreeMap<String, String> {
    let data = |kind: &str, name: &str| -> BTreeMap<String, String> {
        let object = docs
            .iter()
            .find(|d| {
                d["kind"].as_str() == Some(kind)
                    && d["metadata"]["name"].as_str().is_some_and(|n| n == name || n.starts_with(&format!("{name}-")))
            })
            .unwrap_or_else(|| panic!("{workload_name} refers to {kind} {name}, which the manifests lack"));
        let values = object["data"].as_mapping().unwrap().iter().map(|(k, v)| (scalar(k), scalar(v)));
        if kind == "Secret" {
            use base64::Engine;
            let decode = |v: String| String::from_utf8(base64::engine::general_purpose::STANDARD.decode(v).unwrap());
            values.map(|(k, v)| (k, decode(v).unwrap())).collect()
        } else {
            values.collect()
        }
    };
    let mut env = BTreeMap::new();
    for source in container["envFrom"].as_sequence().into_iter().flatten() {
        let name = source["configMapRef"]["name"].as_str().expect("envFrom configMapRef");
        env.extend(data("ConfigMap", name));
    }
    for var in container["env"].as_sequence().into_iter().flatten() {
        let name = scalar(&var["name"]);
        let value = if let Some(value) = var.get("value") {
            let mut value = scalar(value);
            while let Some(start) = value.find("$(") {
                let end = start + value[start..].find(')').expect("closed $(");
                let referenced = &value[start + 2..end];
                let replacement = env
                    .get(referenced)
                    .unwrap_or_else(|| panic!("{workload_name}: {name} uses $({referenced}) before it is set"));
                value.replace_range(start..=end, replacement);
            }
            value
        } else if let Some(secret) = var["valueFrom"].get("secretKeyRef") {
            let (secret, key) = (scalar(&secret["name"]), scalar(&secret["key"]));
            data("Secret", &secret)
                .get(&key)
                .cloned()
                .unwrap_or_else(|| panic!("{workload_name}: secret {secret} has no {key}"))
        } else if let Some(map) = var["valueFrom"].get("configMapKeyRef") {
            let (map, key) = (scalar(&map["name"]), scalar(&map["key"]));
            data("ConfigMap", &map).get(&key).cloned().unwrap_or_else(|| panic!("{workload_name}: {map} has no {key}"))
        } else if var["valueFrom"]["fieldRef"]["fieldPath"].as_str() == Some("metadata.name") {
            format!("{workload_name}-0")
        } else if var["valueFrom"]["fieldRef"]["fieldPath"].as_str()
            == Some("metadata.labels['apps.kubernetes.io/pod-index']")
        {
            "0".to_string()
        } else {
            panic!("{workload_name}: {name}: a value this test cannot resolve: {var:?}")
        };
        env.insert(name, value);
    }
    env
}

/// A container's volume mounts as (claim name, mount path): pod volumes backed by a claim and
/// the StatefulSet's own claim templates.
fn claim_mounts(workload: &Value, container: &Value) -> Vec<(String, String)> {
    let pod = &workload["spec"]["template"]["spec"];
    let templates: Vec<String> = workload["spec"]["volumeClaimTemplates"]
        .as_sequence()
        .into_iter()
        .flatten()
        .map(|t| scalar(&t["metadata"]["name"]))
        .collect();
    container["volumeMounts"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|mount| {
            let volume = scalar(&mount["name"]);
            let path = scalar(&mount["mountPath"]);
            if templates.contains(&volume) {
                return Some((format!("template:{volume}"), path));
            }
            let claim = pod["volumes"]
                .as_sequence()
                .into_iter()
                .flatten()
                .find(|v| scalar(&v["name"]) == volume)?
                .get("persistentVolumeClaim")?
                .get("claimName")
                .map(scalar)?;
            Some((claim, path))
        })
        .collect()
}

#[test]
fn kubernetes_manifests_render_and_pass_the_schema_validator() {
    for dir in ["base", "overlays/gpu", "overlays/trainer-group", "overlays/generator-group"] {
        let stream = kustomize(dir);
        if let Err(output) = kubernetes_validate(&stream) {
            panic!("deploy/kubernetes/{dir} fails validation against Kubernetes {KUBERNETES_VERSION}:\n{output}");
        }
    }
    // The validator does refuse what Kubernetes would: a misspelt field, a wrong type.
    let base = kustomize("base");
    for (wrong, from, to) in [
        (
            "a misspelt field",
            "  replicas: 1\n  selector:\n    matchLabels:\n      app.kubernetes.io/name: keel-orchestrator",
            "  replica: 1\n  selector:\n    matchLabels:\n      app.kubernetes.io/name: keel-orchestrator",
        ),
        ("a port that is not a number", "containerPort: 8080", "containerPort: http-8080"),
    ] {
        assert!(base.contains(from), "the rendered base has `{from}`");
        let broken = base.replacen(from, to, 1);
        assert!(kubernetes_validate(&broken).is_err(), "kubernetes-validate accepts {wrong}");
    }
}

#[test]
fn kubernetes_services_are_the_launchers_with_probes_services_and_volumes() {
    let docs = documents(&kustomize("base"));
    let commands = launcher("commands");
    let ports: BTreeMap<String, String> = launcher("ports").into_iter().collect();
    let env_lines = launcher("env");
    let config = find(&docs, "ConfigMap", "keel-config");
    let otlp = scalar(&config["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"]);
    assert_eq!(otlp, "http://keel-jaeger:4318", "keel-config's OTLP endpoint is the Jaeger of jaeger.yaml");
    let jaeger = find(&docs, "Service", "keel-jaeger");
    assert!(jaeger["spec"]["ports"].as_sequence().unwrap().iter().any(|p| scalar(&p["port"]) == "4318"));

    for (service, line) in &commands {
        let name = format!("keel-{service}");
        let (workload, container) = workload(&docs, &name);
        let expected: Vec<String> = line.split_whitespace().map(str::to_string).collect();
        let actual: Vec<String> = container["command"].as_sequence().unwrap().iter().map(scalar).collect();
        assert_eq!(actual, expected, "{name}'s command is not scripts/stack.sh's");
        assert_eq!(scalar(&container["image"]), "keel:latest", "{name} runs the image the kustomization names");
        let env = container_env(&docs, &name, container);
        assert_eq!(env.get("OTEL_EXPORTER_OTLP_ENDPOINT"), Some(&otlp), "{name} exports traces");
        for (_, assignment) in env_lines.iter().filter(|(n, _)| n == service) {
            let (var, value) = assignment.split_once('=').unwrap();
            assert_eq!(env.get(var).map(String::as_str), Some(value), "{name} lacks {assignment} (stack.sh sets it)");
        }

        // It listens on its port, which the probes ask on /healthz and its Service exposes.
        let port = &ports[service];
        let listen = format!("KEEL_{}__LISTEN", service.to_uppercase());
        assert_eq!(env.get(&listen), Some(&format!("0.0.0.0:{port}")), "{name}: {listen}");
        let declared = container["ports"].as_sequence().unwrap();
        assert!(
            declared.iter().any(|p| scalar(&p["name"]) == "http" && scalar(&p["containerPort"]) == *port),
            "{name} declares port http = {port}"
        );
        for probe in ["readinessProbe", "livenessProbe"] {
            let get = &container[probe]["httpGet"];
            assert_eq!(get["path"].as_str(), Some("/healthz"), "{name}: {probe}");
            assert_eq!(scalar(&get["port"]), "http", "{name}: {probe}");
        }
        let labels = workload["spec"]["template"]["metadata"]["labels"].as_mapping().unwrap();
        let selector = workload["spec"]["selector"]["matchLabels"].as_mapping().unwrap();
        assert!(selector.iter().all(|(k, v)| labels.get(k) == Some(v)), "{name}: the selector matches its pods");
        let svc = find(&docs, "Service", &name);
        let svc_selector = svc["spec"]["selector"].as_mapping().unwrap();
        assert!(svc_selector.iter().all(|(k, v)| labels.get(k) == Some(v)), "Service {name} selects {name}'s pods");
        assert!(
            svc["spec"]["ports"].as_sequence().unwrap().iter().any(|p| scalar(&p["port"]) == *port),
            "Service {name} exposes {port}"
        );
    }

    // Trainers: a StatefulSet whose pods' stable names are their worker ids.
    let (trainer, container) = workload(&docs, "keel-trainer");
    assert_eq!(trainer["kind"].as_str(), Some("StatefulSet"));
    assert_eq!(scalar(&trainer["spec"]["serviceName"]), "keel-trainer");
    assert_eq!(container_env(&docs, "keel-trainer", container)["KEEL_TRAINER__WORKER_ID"], "keel-trainer-0");
    assert_eq!(scalar(&find(&docs, "Service", "keel-trainer")["spec"]["clusterIP"]), "None", "a headless Service");

    // The work_dir and the models are the same claims at the same paths in the orchestrator,
    // the trainers and the generators; the generator serves a model from that claim.
    let (orchestrator, container) = workload(&docs, "keel-orchestrator");
    let work_dir = container_env(&docs, "keel-orchestrator", container)["KEEL_ORCHESTRATOR__WORK_DIR"].clone();
    let shared = claim_mounts(orchestrator, container);
    assert!(
        shared.contains(&("keel-work".into(), work_dir.clone())),
        "the orchestrator's work_dir {work_dir} is keel-work"
    );
    assert!(shared.iter().any(|(claim, _)| claim == "keel-models"), "the orchestrator mounts keel-models");
    for name in ["keel-trainer", "keel-generator"] {
        let (workload, container) = workload(&docs, name);
        let mounts = claim_mounts(workload, container);
        for mount in &shared {
            assert!(mounts.contains(mount), "{name} mounts {mount:?} as the orchestrator does");
        }
    }
    for claim in ["keel-work", "keel-models"] {
        let modes = &find(&docs, "PersistentVolumeClaim", claim)["spec"]["accessModes"];
        assert_eq!(modes.as_sequence().unwrap()[0].as_str(), Some("ReadWriteMany"), "{claim} is shared by pods");
    }
    let (generator, container) = workload(&docs, "keel-generator");
    let model = container_env(&docs, "keel-generator", container)["KEEL_GENERATOR__MODEL"].clone();
    let models_path = &shared.iter().find(|(c, _)| c == "keel-models").unwrap().1;
    assert!(model.starts_with(&format!("{models_path}/")), "the generator's model {model} is on keel-models");
    let waits = generator["spec"]["template"]["spec"]["initContainers"][0]["command"].as_sequence().unwrap();
    assert!(
        scalar(waits.last().unwrap()).contains(&format!("{model}/config.json")),
        "the generator waits for its model"
    );
    let init = find(&docs, "Job", "keel-model-init");
    let init_command: Vec<String> = init["spec"]["template"]["spec"]["containers"][0]["command"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(scalar)
        .collect();
    assert!(init_command.join(" ").contains(&format!("--out {model}.tmp")), "keel-model-init makes {model}");

    // The checkpoint store keeps its files on its own claim.
    let (checkpoint, container) = workload(&docs, "keel-checkpoint");
    let store = container_env(&docs, "keel-checkpoint", container)["KEEL_CHECKPOINT__STORAGE__ROOT"].clone();
    assert!(
        claim_mounts(checkpoint, container)
            .iter()
            .any(|(claim, path)| claim.starts_with("template:") && *path == store),
        "the checkpoint store's root {store} is a volume claim of its StatefulSet"
    );

    // NATS runs with docker/nats.conf itself, and JetStream on.
    let nats_conf = std::fs::read_to_string(root().join("docker/nats.conf")).unwrap();
    let config_map = docs
        .iter()
        .find(|d| {
            d["kind"].as_str() == Some("ConfigMap") && scalar(&d["metadata"]["name"]).starts_with("keel-nats-config")
        })
        .expect("the NATS ConfigMap");
    assert_eq!(scalar(&config_map["data"]["keel.conf"]), nats_conf, "keel-nats-config is docker/nats.conf");
    let (nats, container) = workload(&docs, "keel-nats");
    let args: Vec<String> = container["args"].as_sequence().unwrap().iter().map(scalar).collect();
    assert!(args.windows(2).any(|w| w == ["-c", "/etc/nats/keel.conf"]) && args.contains(&"-js".into()), "{args:?}");
    let volume = &nats["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"];
    assert_eq!(volume, &config_map["metadata"]["name"], "keel-nats mounts keel-nats-config");
}

/// Each Keel container's environment, as the kubelet would give it, is accepted by that
/// service's own configuration loader (`--check-config`: every `KEEL_<SERVICE>__*` must be a
/// field, every value valid); a misspelt field is refused.
#[test]
fn kubernetes_environment_is_accepted_by_each_service() {
    for dir in ["base", "overlays/gpu"] {
        let docs = documents(&kustomize(dir));
        for service in SERVICES {
            let name = format!("keel-{service}");
            let (_, container) = workload(&docs, &name);
            let env = container_env(&docs, &name, container);
            let check = |extra: &[(&str, &str)]| {
                let mut command = Command::new(keel_testkit::binary(&name));
                command.arg("--check-config").env_clear().envs(&env).envs(extra.iter().copied());
                if let Ok(path) = std::env::var("LD_LIBRARY_PATH") {
                    command.env("LD_LIBRARY_PATH", path);
                }
                command.output().unwrap()
            };
            let out = check(&[]);
            assert!(
                out.status.success(),
                "{dir}: {name} refuses its environment: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            let misspelt = format!("KEEL_{}__NO_SUCH_FIELD", service.to_uppercase());
            let out = check(&[(misspelt.as_str(), "1")]);
            assert_eq!(out.status.code(), Some(2), "{name} --check-config accepts {misspelt}");
            assert!(String::from_utf8_lossy(&out.stderr).contains("no_such_field"), "{name} names the field");
        }
    }
}

#[test]
fn kubernetes_gpu_overlay_puts_the_trainer_and_generator_on_gpus() {
    let base = documents(&kustomize("base"));
    let gpu = documents(&kustomize("overlays/gpu"));
    for service in SERVICES {
        let name = format!("keel-{service}");
        let (workload, container) = workload(&gpu, &name);
        let gpus = &container["resources"]["limits"]["nvidia.com/gpu"];
        let device =
            container_env(&gpu, &name, container).get(&format!("KEEL_{}__DEVICE", service.to_uppercase())).cloned();
        if matches!(service, "trainer" | "generator") {
            assert_eq!(scalar(gpus), "1", "{name} asks for a GPU");
            assert_eq!(device.as_deref(), Some("cuda"), "{name} runs on CUDA");
            let pod = &workload["spec"]["template"]["spec"];
            assert_eq!(pod["nodeSelector"]["nvidia.com/gpu.present"].as_str(), Some("true"), "{name}: GPU nodes");
            assert!(
                pod["tolerations"]
                    .as_sequence()
                    .is_some_and(|t| t.iter().any(|t| t["key"].as_str() == Some("nvidia.com/gpu"))),
                "{name} tolerates the GPU nodes' taint"
            );
            // The patch adds to the base's container; it drops nothing.
            let (_, plain) = self::workload(&base, &name);
            for var in plain["env"].as_sequence().unwrap() {
                assert!(container["env"].as_sequence().unwrap().contains(var), "{name} keeps {var:?}");
            }
        } else {
            assert!(gpus.is_null(), "{name} asks for no GPU");
            assert!(device.is_none(), "{name} has no device");
        }
    }
    // On the CPU (the base) nothing asks for a GPU.
    for service in SERVICES {
        let (_, container) = workload(&base, &format!("keel-{service}"));
        assert!(container["resources"]["limits"]["nvidia.com/gpu"].is_null(), "keel-{service} on the CPU");
    }
}

#[test]
fn kubernetes_trainer_group_overlay_makes_the_trainer_pods_one_group_of_ranks() {
    let gpu = documents(&kustomize("overlays/gpu"));
    let group = documents(&kustomize("overlays/trainer-group"));
    let (trainer, container) = workload(&group, "keel-trainer");
    let replicas = scalar(&trainer["spec"]["replicas"]);
    let env = container_env(&group, "keel-trainer", container);
    assert_eq!(env["KEEL_TRAINER__GROUP__SIZE"], replicas, "one rank per pod");
    assert!(replicas.parse::<usize>().unwrap() > 1, "a group of several ranks");
    assert_eq!(env["KEEL_TRAINER__GROUP__NAME"], "keel-trainer");
    assert_eq!(env["KEEL_TRAINER__GROUP__RANK"], "0", "the pod's ordinal: keel-trainer-0 leads");
    assert_eq!(env["KEEL_TRAINER__DEVICE"], "cuda");
    assert_eq!(scalar(&container["resources"]["limits"]["nvidia.com/gpu"]), "1", "a GPU per rank");
    assert_eq!(scalar(&trainer["spec"]["podManagementPolicy"]), "Parallel", "the ranks start together");
    // Everything else is the gpu overlay's.
    let (_, plain) = workload(&gpu, "keel-trainer");
    for var in plain["env"].as_sequence().unwrap() {
        assert!(container["env"].as_sequence().unwrap().contains(var), "keeps {var:?}");
    }
    assert_eq!(group.len(), gpu.len(), "the same objects as the gpu overlay");
}

#[test]
fn kubernetes_generator_group_overlay_makes_the_generator_pods_one_group_behind_its_leader() {
    let gpu = documents(&kustomize("overlays/gpu"));
    let group = documents(&kustomize("overlays/generator-group"));
    let (generator, container) = workload(&group, "keel-generator");
    assert_eq!(scalar(&generator["kind"]), "StatefulSet", "each pod's ordinal is its rank");
    assert_eq!(scalar(&generator["spec"]["podManagementPolicy"]), "Parallel", "the ranks start together");
    let replicas = scalar(&generator["spec"]["replicas"]);
    assert!(replicas.parse::<usize>().unwrap() > 1, "a group of several ranks");
    let env = container_env(&group, "keel-generator", container);
    assert_eq!(env["KEEL_GENERATOR__GROUP__SIZE"], replicas, "one rank per pod");
    assert_eq!(env["KEEL_GENERATOR__GROUP__NAME"], "keel-generator");
    assert_eq!(env["KEEL_GENERATOR__GROUP__RANK"], "0", "the pod's ordinal: keel-generator-0 leads");
    assert_eq!(env["KEEL_GENERATOR__DEVICE"], "cuda");
    assert_eq!(scalar(&container["resources"]["limits"]["nvidia.com/gpu"]), "1", "a GPU per rank");
    // Requests reach the leader only.
    let service = find(&group, "Service", "keel-generator");
    assert_eq!(scalar(&service["spec"]["selector"]["apps.kubernetes.io/pod-index"]), "0");
    // Everything else is the gpu overlay's.
    let (_, plain) = workload(&gpu, "keel-generator");
    for var in plain["env"].as_sequence().unwrap() {
        assert!(container["env"].as_sequence().unwrap().contains(var), "keeps {var:?}");
    }
    assert_eq!(plain["startupProbe"], container["startupProbe"], "the same probes");
    assert_eq!(group.len(), gpu.len(), "the same objects as the gpu overlay");
}
