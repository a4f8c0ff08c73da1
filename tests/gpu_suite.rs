//! `bench/gpu-suite`, the one command a rare GPU loan runs, on the CPU (`DEVICE=cpu`: a tiny
//! model, a few requests): every step runs to the end and leaves its status row, its table
//! and its log, so the script cannot rot unnoticed between loans.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

/// keel-model's `cuda_kernels` test binary, built beside this one (`cargo nextest run
/// --workspace` builds every test binary first).
fn kernel_tests() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let mut found: Vec<PathBuf> = std::fs::read_dir(deps)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("cuda_kernels-") && p.extension().is_none()
        })
        .collect();
    found.sort_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok());
    found.pop().unwrap_or_else(|| {
        panic!("no cuda_kernels test binary in {}: build it (cargo test -p keel-model --no-run)", deps.display())
    })
}

#[test]
fn the_gpu_suite_runs_every_step_on_the_cpu() {
    let database = keel_testkit::TestDatabase::new("gpu_suite");
    let out = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let bin = keel_testkit::binary("keel").parent().unwrap().to_path_buf();
    let nats_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    // Five ports in a row for the services, away from the defaults and the other tests'.
    let base = 30000 + (std::process::id() % 2000) as u16 * 5;
    let root = keel_testkit::workspace_root();
    let run = Command::new(root.join("bench/gpu-suite"))
        .arg(out.path())
        .current_dir(&root)
        .env("DEVICE", "cpu")
        .env("KEEL_BIN", &bin)
        .env("KERNEL_TESTS", kernel_tests())
        .env("KEEL_STATE", state.path())
        .env("KEEL_DATABASE_URL", &database.url)
        .env("KEEL_STACK_PORTS_FROM", base.to_string())
        .env("KEEL_STACK_NATS_PORT", nats_port.to_string())
        .env("PYTHON", keel_testkit::python())
        .output()
        .unwrap();
    let summary = std::fs::read_to_string(out.path().join("summary.md")).unwrap_or_default();
    let logs: Vec<String> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".log"))
        .collect();
    let tail = |name: &str| {
        let text = std::fs::read_to_string(out.path().join(name)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    };
    let said = format!(
        "{summary}\n--- stderr\n{}\n{}",
        String::from_utf8_lossy(&run.stderr),
        logs.iter().map(|l| format!("--- {l}\n{}", tail(l))).collect::<Vec<_>>().join("\n")
    );
    assert!(run.status.success(), "bench/gpu-suite failed:\n{said}");
    for step in ["kernels", "serve", "generate", "grpo"] {
        assert!(summary.contains(&format!("| {step} | ok |")), "{step}:\n{said}");
    }
    assert!(summary.contains("| two-gpus | skipped"), "{said}");
    for log in ["01-kernels.log", "02-serve.log", "03-generate.log", "04-grpo.log"] {
        assert!(logs.iter().any(|l| l == log), "{log} in {logs:?}");
    }
    // Each step's own table: the accuracy rows, the serving report, the engine's batches,
    // the GRPO phases.
    assert!(summary.contains("| random | bf16 tch |") && summary.contains("| trained | bf16 tch |"), "{said}");
    assert!(summary.contains("request throughput (req/s):"), "{said}");
    assert!(summary.contains("| 1 |") && summary.contains("| 4 |"), "{said}");
    assert!(summary.contains("total_step_time"), "{said}");
}
