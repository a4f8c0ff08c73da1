"""The reference side of `bench/reward-throughput`: scores the same JSONL samples as
`keel reward bench` and prints one JSON line in the same shape.

- math: HF's `math_verify` (the checker NeMo-RL's math environment uses): the gold answer
  parsed from `\\boxed{ground truth}`, the prediction from the response, `verify(gold, pred)`.
- code: each test as a plain `python3` subprocess, no isolation at all, with the same number
  of programs at once: what running the tests costs without a sandbox.

    python bench/reward_reference.py math|code FILE [--workers N] [--repeats R]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def score_math(samples):
    from math_verify import parse, verify

    rewards = []
    for s in samples:
        gold = parse("\\boxed{" + s["metadata"]["ground_truth"] + "}")
        pred = parse(s["messages"][-1]["content"])
        rewards.append(1.0 if verify(gold, pred) else 0.0)
    return rewards


def extract_program(text):
    blocks, rest = [], text
    while "```" in rest:
        after = rest.split("```", 1)[1]
        if "\n" not in after or "```" not in after.split("\n", 1)[1]:
            break
        tag, body = after.split("\n", 1)
        code, rest = body.split("```", 1)
        if tag.strip().lower() in ("", "python", "py", "python3"):
            blocks.append(code)
    return blocks[-1] if blocks else text


def run_test(program, test):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "solution.py"
        path.write_text(program)
        try:
            out = subprocess.run(["/usr/bin/python3", "-I", "-B", str(path)], input=test["stdin"].encode(),
                                 capture_output=True, timeout=10, cwd=d)
        except subprocess.TimeoutExpired:
            return False
    got = [l.rstrip() for l in out.stdout.decode().splitlines()]
    want = [l.rstrip() for l in test["stdout"].splitlines()]
    while got and not got[-1]:
        got.pop()
    while want and not want[-1]:
        want.pop()
    return out.returncode == 0 and got == want


def score_code(samples, workers):
    jobs = [(i, extract_program(s["messages"][-1]["content"]), t) for i, s in enumerate(samples) for t in s["metadata"]["tests"]]
    with ThreadPoolExecutor(workers) as pool:
        passed = list(pool.map(lambda job: run_test(job[1], job[2]), jobs))
    totals = [0] * len(samples)
    for (i, _, _), ok in zip(jobs, passed):
        totals[i] += ok
    return [t / len(s["metadata"]["tests"]) for t, s in zip(totals, samples)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("env", choices=["math", "code"])
    parser.add_argument("file", type=Path)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    samples = [json.loads(l) for l in args.file.read_text().splitlines() if l.strip()]
    score = (lambda: score_math(samples)) if args.env == "math" else (lambda: score_code(samples, args.workers))
    rewards = score()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        score()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    engine = "math_verify" if args.env == "math" else "python3 unsandboxed"
    print(json.dumps({"engine": engine, "env": args.env, "samples": len(samples), "seconds": seconds,
                      "samples_per_s": len(samples) / seconds, "rewards": rewards}))


if __name__ == "__main__":
    sys.exit(main())
