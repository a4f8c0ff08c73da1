//! The `code` environment and its sandbox against hostile programs: each must be stopped or
//! denied, and reported, while correct programs pass. Needs bubblewrap (`scripts/setup`
//! installs it); without it these tests fail rather than pass vacuously.

#![allow(clippy::unwrap_used)]

use keel_environments::scoring::Scorer;
use keel_protocol::reward::{CodeConfig, EnvConfig, EnvSample, EnvStepRequest, EnvStepResult, Message, OnError};
use serde_json::{Value, json};

/// A scorer whose sandbox uses uids of its own (tests run in parallel processes).
fn scorer(first_uid: u32) -> Scorer {
    let mut config = keel_reward::default_config();
    config.sandbox.first_uid = first_uid;
    config.sandbox.slots = 4;
    keel_reward::state(&config, None).unwrap().scorer
}

fn program(code: &str) -> String {
    format!("Here is my solution:\n```python\n{code}\n```\n")
}

async fn run(scorer: &Scorer, config: CodeConfig, code: &str, tests: Value) -> EnvStepResult {
    let sample = EnvSample {
        messages: vec![Message::new("user", "write it"), Message::new("assistant", program(code))],
        metadata: json!({"tests": tests}),
        token_ids: None,
        agent: None,
    };
    let request = EnvStepRequest { env: EnvConfig::Code(config), on_error: OnError::Fail, samples: vec![sample] };
    let mut reply = scorer.step(request).await.unwrap();
    reply.results.remove(0)
}

fn statuses(result: &EnvStepResult) -> Vec<String> {
    result.info["tests"].as_array().unwrap().iter().map(|t| t["status"].as_str().unwrap().to_string()).collect()
}

fn output(result: &EnvStepResult) -> String {
    let test = &result.info["tests"][0];
    format!("{}{}", test["stdout"].as_str().unwrap_or(""), test["stderr"].as_str().unwrap_or(""))
}

#[tokio::test]
async fn correct_programs_pass_and_partial_credit_counts() {
    let scorer = scorer(62_000);
    let code = "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    a, b = map(int, input().split())\n    print(add(a, b))";
    let tests = json!([
        {"stdin": "1 2\n", "stdout": "3\n"},
        {"stdin": "10 -4", "stdout": "6"},
        {"assert": "assert add(2, 2) == 4"},
        {"assert": "assert add(2, 2) == 5"},
    ]);
    let result = run(&scorer, CodeConfig::default(), code, tests.clone()).await;
    assert_eq!(statuses(&result), ["passed", "passed", "passed", "runtime_error"]);
    assert_eq!(result.reward, 0.75);
    assert!(result.terminated);
    let strict = run(&scorer, CodeConfig { all_or_nothing: true, ..CodeConfig::default() }, code, tests).await;
    assert_eq!(strict.reward, 0.0);

    let wrong = run(&scorer, CodeConfig::default(), "print(41)", json!([{"stdout": "42"}])).await;
    assert_eq!((statuses(&wrong), wrong.reward), (vec!["wrong_answer".to_string()], 0.0));
}

#[tokio::test]
async fn feedback_mode_returns_the_report_as_an_observation() {
    let scorer = scorer(62_100);
    let config = CodeConfig { feedback: true, max_attempts: 2, ..CodeConfig::default() };
    let tests = json!([{"stdin": "3", "stdout": "9"}]);
    let first = run(&scorer, config.clone(), "print(int(input()) * 2)", tests.clone()).await;
    assert!(!first.terminated);
    let text = first.observation.unwrap().content;
    assert!(
        text.contains("0 of 1 tests passed") && text.contains("Expected:\n9") && text.contains("Got:\n6"),
        "{text}"
    );
    assert_eq!(first.metadata["attempts"], 1);
    let sample = EnvSample {
        messages: vec![Message::new("assistant", program("print(int(input()) ** 2)"))],
        metadata: first.metadata,
        token_ids: None,
        agent: None,
    };
    let request = EnvStepRequest { env: EnvConfig::Code(config), on_error: OnError::Fail, samples: vec![sample] };
    let second = scorer.step(request).await.unwrap().results.remove(0);
    assert_eq!((second.reward, second.terminated, second.observation), (1.0, true, None));
}

#[tokio::test]
async fn an_infinite_loop_is_killed_at_the_cpu_or_wall_limit() {
    let scorer = scorer(62_200);
    let config = CodeConfig { cpu_seconds: 1, wall_seconds: 60.0, ..CodeConfig::default() };
    let result = run(&scorer, config, "while True:\n    pass", json!([{"stdout": "x"}])).await;
    assert_eq!(statuses(&result), ["cpu_limit"], "{:?}", result.info);
    // Sleeping burns no CPU: the wall-clock limit kills it.
    let config = CodeConfig { cpu_seconds: 60, wall_seconds: 1.0, ..CodeConfig::default() };
    let result = run(&scorer, config, "import time\ntime.sleep(60)", json!([{"stdout": "x"}])).await;
    assert_eq!(statuses(&result), ["timeout"], "{:?}", result.info);
    assert_eq!(result.reward, 0.0);
}

#[tokio::test]
async fn a_fork_bomb_is_contained() {
    let scorer = scorer(62_300);
    let config = CodeConfig { max_processes: 8, wall_seconds: 5.0, ..CodeConfig::default() };
    let bomb = "import os\nwhile True:\n    os.fork()";
    let result = run(&scorer, config, bomb, json!([{"stdout": "x"}])).await;
    let status = &statuses(&result)[0];
    assert!(["runtime_error", "timeout", "cpu_limit"].contains(&status.as_str()), "{:?}", result.info);
    assert_eq!(result.reward, 0.0);
    // Contained: the sandbox still works right after.
    let after = run(&scorer, CodeConfig::default(), "print('ok')", json!([{"stdout": "ok"}])).await;
    assert_eq!(after.reward, 1.0, "{:?}", after.info);
}

/// Six processes that each touch 120 MB, under a 256 MB limit: every one fits the
/// per-process limit, but the program as a whole is capped by its control group, so it does
/// not finish (where the service can make control groups, as here when it runs as root; the
/// test says so when it cannot, and checks the per-process limit alone).
#[tokio::test]
async fn the_memory_limit_holds_for_the_program_as_a_whole() {
    let scorer = scorer(62_450);
    let config = CodeConfig { memory_mb: 256, max_processes: 16, wall_seconds: 20.0, ..CodeConfig::default() };
    let code = r#"import os
children = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        block = bytearray(120 * 1024 * 1024)
        for i in range(0, len(block), 4096):
            block[i] = 1
        import time
        time.sleep(3)
        os._exit(0)
    children.append(pid)
codes = [os.waitpid(pid, 0)[1] for pid in children]
print('all held' if all(c == 0 for c in codes) else 'killed')
"#;
    let result = run(&scorer, config, code, json!([{"stdout": "all held"}])).await;
    match keel_environments::sandbox::cgroup::Hierarchy::find() {
        Ok(hierarchy) => {
            println!("control groups in {hierarchy:?}");
            assert_eq!(result.reward, 0.0, "six 120 MB processes under a 256 MB program limit: {:?}", result.info);
        }
        Err(why) => {
            println!("SKIPPED the whole-program check: no control group can be made here ({why})");
            assert_eq!(result.reward, 1.0, "each process is within the per-process limit: {:?}", result.info);
        }
    }
    // The sandbox still works right after.
    let after = run(&scorer, CodeConfig::default(), "print('ok')", json!([{"stdout": "ok"}])).await;
    assert_eq!(after.reward, 1.0, "{:?}", after.info);
}

/// A request's tests hold at most `ceilings.request_seconds` of sandbox time between them:
/// each reserves its wall-clock limit before it starts, so with room for two 2-second tests
/// the other two of a sample's four are not run (and fail, saying why); a later request has
/// its own budget.
#[tokio::test]
async fn a_request_uses_at_most_its_sandbox_seconds() {
    let mut config = keel_reward::default_config();
    config.sandbox.first_uid = 62_480;
    config.sandbox.slots = 4;
    config.sandbox.ceilings.request_seconds = 5.0;
    let scorer = keel_reward::state(&config, None).unwrap().scorer;
    let code = CodeConfig { wall_seconds: 2.0, ..CodeConfig::default() };
    let tests = json!([{"stdout": "ok"}, {"stdout": "ok"}, {"stdout": "ok"}, {"stdout": "ok"}]);
    let result = run(&scorer, code.clone(), "print('ok')", tests.clone()).await;
    assert_eq!(statuses(&result), ["passed", "passed", "not_run", "not_run"], "{:?}", result.info);
    assert_eq!(result.reward, 0.5);
    let why = result.info["tests"][2]["stderr"].as_str().unwrap_or_default();
    assert!(why.contains("sandbox.ceilings.request_seconds"), "{why}");
    assert_eq!(run(&scorer, code, "print('ok')", json!([{"stdout": "ok"}])).await.reward, 1.0);
}

#[tokio::test]
async fn a_10_gb_allocation_is_refused() {
    let scorer = scorer(62_400);
    let result = run(
        &scorer,
        CodeConfig::default(),
        "x = bytearray(10 * 1024**3)\nprint('allocated')",
        json!([{"stdout": "allocated"}]),
    )
    .await;
    assert_eq!(statuses(&result), ["memory_limit"], "{:?}", result.info);
    assert!(output(&result).contains("MemoryError"));
}

#[tokio::test]
async fn network_connections_fail() {
    let scorer = scorer(62_500);
    // A listener on the host's loopback: the sandbox must not reach it either.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let code = format!(
        "import socket\nfor host in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n    try:\n        socket.create_connection(host, timeout=2)\n        print('connected', host)\n    except OSError as e:\n        print('refused', host, type(e).__name__)"
    );
    let result = run(&scorer, CodeConfig::default(), &code, json!([{"stdout": "never"}])).await;
    let out = output(&result);
    assert!(!out.contains("connected"), "{out}");
    assert_eq!(out.matches("refused").count(), 3, "{out}");
}

#[tokio::test]
async fn files_outside_the_directory_are_out_of_reach() {
    let scorer = scorer(62_600);
    let service_pid = std::process::id();
    let code = format!(
        r#"import os
def attempt(name, action):
    try:
        action()
        print(name, 'ALLOWED')
    except OSError as e:
        print(name, 'denied', type(e).__name__)
attempt('shadow', lambda: open('/etc/shadow').read())
attempt('passwd', lambda: open('/etc/passwd').read())
attempt('service_environ', lambda: open('/proc/{service_pid}/environ').read())
attempt('root_home', lambda: os.listdir('/root'))
attempt('write_usr', lambda: open('/usr/evil', 'w').write('x'))
attempt('write_root', lambda: open('/evil', 'w').write('x'))
attempt('write_tmp', lambda: open('/tmp/evil', 'w').write('x'))
open('mine.txt', 'w').write('fine')
print('own_dir', open('mine.txt').read())
print('env', sorted(os.environ))
"#
    );
    let result = run(&scorer, CodeConfig::default(), &code, json!([{"stdout": "never"}])).await;
    let out = output(&result);
    assert!(!out.contains("ALLOWED"), "{out}");
    for name in ["shadow", "passwd", "service_environ", "root_home", "write_usr", "write_root", "write_tmp"] {
        assert!(out.contains(&format!("{name} denied")), "{name}: {out}");
    }
    assert!(out.contains("own_dir fine"), "{out}");
    assert!(
        out.contains("env ['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR']"),
        "nothing of the service's environment: {out}"
    );
    assert!(!std::path::Path::new("/usr/evil").exists() && !std::path::Path::new("/evil").exists());
}

#[tokio::test]
async fn huge_output_and_big_files_are_capped() {
    let scorer = scorer(62_700);
    let config = CodeConfig { max_output_bytes: 1000, max_file_mb: 1, ..CodeConfig::default() };
    let code = "import sys\nsys.stdout.write('y' * 10_000_000)\nsys.stdout.flush()\ntry:\n    open('big', 'wb').write(b'0' * (5 << 20))\nexcept OSError as e:\n    print('file errno', e.errno, file=sys.stderr)";
    let result = run(&scorer, config, code, json!([{"stdout": "never"}])).await;
    let test = &result.info["tests"][0];
    assert!(test["stdout"].as_str().unwrap().len() <= 1000);
    assert!(test["stderr"].as_str().unwrap().contains("file errno 27"), "EFBIG expected: {test}");
}

#[tokio::test]
async fn samples_without_tests_carry_an_error() {
    let scorer = scorer(62_800);
    let sample = EnvSample {
        messages: vec![Message::new("assistant", "print(1)")],
        metadata: json!({"tests": [{"stdin": 3}]}),
        token_ids: None,
        agent: None,
    };
    let request =
        EnvStepRequest { env: EnvConfig::Code(CodeConfig::default()), on_error: OnError::Zero, samples: vec![sample] };
    let result = scorer.step(request).await.unwrap().results.remove(0);
    let error = result.error.unwrap();
    assert_eq!((error.kind.as_str(), result.reward), ("invalid_sample", 0.0));
    assert!(error.message.contains("metadata.tests[0]"), "{}", error.message);
}

#[tokio::test]
async fn a_program_cannot_fake_passing_assert_tests() {
    let scorer = scorer(62_900);
    let tests = json!([{"assert": "assert answer() == 42"}]);
    let honest = run(&scorer, CodeConfig::default(), "def answer():\n    return 42", tests.clone()).await;
    assert_eq!(honest.reward, 1.0, "{:?}", honest.info);
    for cheat in [
        "import sys\nsys.exit(0)",
        "import os\nos._exit(0)",
        "import atexit, os\natexit.register(lambda: os._exit(0))\ndef answer():\n    return 0",
        "import sys\nprint(sys.stdin.readline().strip())\nsys.exit(0)",
        "import __main__, sys\nprint(getattr(__main__, '_keel_token', ''))\nsys.exit(0)",
        "import __main__, sys\nprint(*[v for k, v in vars(__main__).items() if 'token' in k])\nsys.exit(0)",
    ] {
        let result = run(&scorer, CodeConfig::default(), cheat, tests.clone()).await;
        assert_eq!(
            (result.reward, statuses(&result)),
            (0.0, vec!["runtime_error".to_string()]),
            "{cheat}: {:?}",
            result.info
        );
    }
}

#[tokio::test]
async fn no_namespaces_mounts_or_shared_memory_and_only_its_own_processes() {
    let scorer = scorer(63_000);
    let code = r#"import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
print('unshare_user', libc.unshare(0x10000000), ctypes.get_errno())
print('unshare_net', libc.unshare(0x40000000), ctypes.get_errno())
print('mount', libc.mount(b'x', b'/sandbox', b'tmpfs', 0, None), ctypes.get_errno())
r = subprocess.run(['unshare', '-r', 'true'], capture_output=True)
print('unshare_cmd', r.returncode)
for path in ['/dev/shm/x', '/dev/x']:
    try:
        open(path, 'w').write('x')
        print(path, 'ALLOWED')
    except OSError as e:
        print(path, 'denied')
import socket
for name in ['AF_NETLINK', 'AF_PACKET', 'AF_UNIX', 'AF_INET']:
    try:
        socket.socket(getattr(socket, name), socket.SOCK_DGRAM).close()
        print(name, 'opened')
    except OSError as e:
        print(name, 'refused', e.errno)
pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
print('pids', len(pids), max(pids))
"#;
    let result = run(&scorer, CodeConfig::default(), code, json!([{"stdout": "never"}])).await;
    let out = output(&result);
    for line in [
        "unshare_user -1 1",
        "unshare_net -1 1",
        "mount -1 1",
        "/dev/shm/x denied",
        "/dev/x denied",
        "AF_NETLINK refused 1",
        "AF_PACKET refused 1",
        "AF_UNIX opened",
        "AF_INET opened",
    ] {
        assert!(out.contains(line), "{line}: {out}");
    }
    assert!(!out.contains("unshare_cmd 0") && out.contains("unshare_cmd"), "{out}");
    let pids = out.lines().find(|l| l.starts_with("pids ")).unwrap();
    let counts: Vec<u32> = pids.split_whitespace().skip(1).map(|n| n.parse().unwrap()).collect();
    assert!(counts[0] <= 4 && counts[1] < 100, "the sandbox sees only its own processes: {pids}");
}

#[tokio::test]
async fn the_writable_directory_is_small_and_private() {
    let scorer = scorer(63_100);
    let code = "import os\nn = 0\ntry:\n    while True:\n        open(f'f{n}', 'wb').write(b'0' * (1 << 20))\n        n += 1\nexcept OSError as e:\n    print('stopped', e.errno, n)\ntry:\n    open('/code/solution.py', 'a').write('x')\nexcept OSError:\n    print('code read-only')";
    let result = run(&scorer, CodeConfig::default(), code, json!([{"stdout": "never"}])).await;
    let out = output(&result);
    let stopped =
        out.lines().find(|l| l.starts_with("stopped 28 ")).unwrap_or_else(|| panic!("ENOSPC expected: {out}"));
    let files: u64 = stopped.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(files <= 64, "the tmpfs holds at most disk_mb (64) MiB: {files} files of 1 MiB");
    assert!(out.contains("code read-only"), "{out}");
}

#[tokio::test]
async fn limits_above_the_ceilings_are_refused() {
    let scorer = scorer(63_200);
    for (config, field) in [
        (CodeConfig { memory_mb: 1 << 40, ..CodeConfig::default() }, "memory_mb"),
        (CodeConfig { max_output_bytes: 4_000_000_000, ..CodeConfig::default() }, "max_output_bytes"),
        (CodeConfig { wall_seconds: 1e9, ..CodeConfig::default() }, "wall_seconds"),
        (CodeConfig { max_processes: 0, ..CodeConfig::default() }, "max_processes"),
    ] {
        let sample = EnvSample {
            messages: vec![Message::new("assistant", "print(1)")],
            metadata: json!({}),
            token_ids: None,
            agent: None,
        };
        let request = EnvStepRequest { env: EnvConfig::Code(config), on_error: OnError::Fail, samples: vec![sample] };
        match scorer.step(request).await {
            Err(keel_environments::scoring::Error::InvalidRequest(message)) => {
                assert!(message.starts_with(&format!("env.{field}:")), "{message}")
            }
            other => panic!("{field}: expected an invalid request, got {other:?}"),
        }
    }
}
