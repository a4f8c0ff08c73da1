//! The deployment files agree with each other and with the local launcher: compose.yaml
//! passes a Compose validator (docker-compose 1.29.2 from PyPI, which checks the file
//! against the Compose Specification schema; `scripts/setup` installs it in .venv-compose),
//! each service's `command` and host-independent environment are exactly those of
//! scripts/stack.sh, every Keel service exports traces to Jaeger, has a health check and
//! waits for what it needs, and the gpu profile reserves the NVIDIA GPUs. And the repository
//! stands alone: no tracked file points at documents outside it.
//!
//! No Docker engine is needed: nothing is built or started.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use serde_yaml::Value;

const SERVICES: [&str; 5] = ["orchestrator", "generator", "reward", "checkpoint", "trainer"];

fn root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// compose.yaml with its `<<` merge keys applied. serde_yaml applies one level per pass (a
/// merged-in mapping that has a merge key of its own keeps it), so it runs until none is left.
fn compose() -> Value {
    let text = std::fs::read_to_string(root().join("compose.yaml")).expect("read compose.yaml");
    let mut value: Value = serde_yaml::from_str(&text).expect("compose.yaml is YAML");
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
    for profiles in [&[][..], &["--profile", "gpu"][..]] {
        let out = Command::new(&validator)
            .args(profiles)
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
    let ports: Vec<String> = jaeger["ports"].as_sequence().unwrap().iter().map(scalar).collect();
    for port in ["16686", "4318"] {
        assert!(ports.iter().any(|p| p.ends_with(&format!(":{port}"))), "jaeger publishes {port}: {ports:?}");
    }
    assert!(jaeger["healthcheck"]["test"].as_sequence().is_some(), "jaeger health check");

    // The demo runs the shared client script from the image, once, after the model exists.
    let demo = &services["demo"];
    assert_eq!(command(demo), ["/usr/share/keel/scripts/demo-run"]);
    assert_eq!(scalar(&demo["restart"]), "no");
    assert!(demo["profiles"].is_null(), "`docker compose up` runs the demo");
    assert_eq!(scalar(&demo["environment"]["KEEL_DEMO_DONE"]), "/var/lib/keel/work/demo.done");
    assert_eq!(scalar(&demo["depends_on"]["model-init"]["condition"]), "service_completed_successfully");
    assert_eq!(scalar(&demo["depends_on"]["orchestrator"]["condition"]), "service_healthy");
    let dockerfile = std::fs::read_to_string(root().join("docker/Dockerfile")).unwrap();
    for needed in ["COPY examples/ /usr/share/keel/examples/", "COPY scripts/demo-run /usr/share/keel/scripts/demo-run"]
    {
        assert!(dockerfile.contains(needed), "docker/Dockerfile: {needed}");
    }
    let model_init = command(&services["model-init"]).join(" ");
    assert!(model_init.contains("/usr/share/keel/examples/tokenizer-corpus.txt"), "{model_init}");
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
