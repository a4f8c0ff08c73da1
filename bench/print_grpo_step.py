"""Prints a GRPO run's step-time breakdown: bench/grpo-step pipes the run's metrics and its
event stream (SSE) here. The wall time between consecutive step records includes what the
step timer does not see (recording in Postgres, checkpoint uploads)."""

import json
import sys
from datetime import datetime

PHASES = ["generation", "reward_calculation", "policy_and_reference_logprobs", "policy_training", "weight_sync"]


def main(metrics_file, events_file, label):
    with open(metrics_file) as f:
        series = {m["name"]: dict(m["points"]) for m in json.load(f)["metrics"]}
    step_times = []
    with open(events_file) as f:
        for line in f:
            if line.startswith("data:"):
                record = json.loads(line[5:])
                if record["event"]["kind"] == "step":
                    at = datetime.fromisoformat(record["at"].replace("Z", "+00:00"))
                    step_times.append((record["event"]["step"], at))
    total = series["timing/train/total_step_time"]
    steps = [s for s in sorted(total) if s > 1] or sorted(total)

    def mean(name):
        return sum(series["timing/train/" + name][s] for s in steps) / len(steps)

    whole = mean("total_step_time")
    wall = [(b[1] - a[1]).total_seconds() for a, b in zip(step_times, step_times[1:]) if b[0] in steps]
    wall_mean = sum(wall) / len(wall) if wall else whole
    print(f"GRPO step, {label}, steps {steps[0]}-{steps[-1]} (step 1 is warm-up and left out)")
    print("%-36s%10s%10s" % ("phase", "s/step", "share"))
    for name in PHASES:
        print("%-36s%10.3f%10.1f%%" % (name, mean(name), 100 * mean(name) / wall_mean))
    inside = whole - sum(mean(name) for name in PHASES)
    between = wall_mean - whole
    print("%-36s%10.3f%10.1f%%" % ("overhead inside the step timer", inside, 100 * inside / wall_mean))
    print("%-36s%10.3f%10.1f%%" % ("overhead between steps (recording)", between, 100 * between / wall_mean))
    print("%-36s%10.3f%10.1f%%" % ("wall time per step", wall_mean, 100.0))
    print("orchestration overhead: %.1f%% of the step" % (100 * (inside + between) / wall_mean))
    tps = series.get("performance/generation_tokens_per_second")
    if tps:
        print("generation tokens/s: %.0f" % (sum(tps[s] for s in steps) / len(steps)))


if __name__ == "__main__":
    main(*sys.argv[1:4])
