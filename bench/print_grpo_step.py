"""Prints a GRPO run's step-time breakdown: bench/grpo-step pipes the run's metrics and its
event stream (SSE) here. The wall time between consecutive step records includes what the
step timer does not see (recording in Postgres, checkpoint uploads). Given the JSON line of
bench/trl_grpo_step.py too, it then prints Keel's mean step time next to TRL GRPOTrainer's
on the same step, and the ratio Keel / TRL (below 1 favours Keel). With `--sweep STATE MB...`
it prints both sides' step times at each micro batch and names each side's best."""

import json
import sys
from datetime import datetime

PHASES = ["generation", "reward_calculation", "policy_and_reference_logprobs", "policy_training", "weight_sync"]


def main(metrics_file, events_file, label, trl_file=None, engine_file=None):
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
    if trl_file:
        with open(trl_file) as f:
            trl = json.loads(f.read().strip().splitlines()[-1])
        print_comparison(whole, wall_mean, mean("generation"), trl)
    if engine_file:
        with open(engine_file) as f:
            bench = json.loads(f.read().strip().splitlines()[-1])
        # All sequences' time: to the first token of every one, then the rest of the tokens.
        alone = bench["ttft_s"] + bench["batch"] * (bench["decode_tokens"] - 1) / bench["decode_tokens_per_s"]
        print()
        print(
            "generation in the stack vs `keel generate bench` (%d sequences x %d prompt tokens x %d new): "
            "%.3f s vs %.3f s, ratio %.2f"
            % (bench["batch"], bench["prompt_tokens"], bench["decode_tokens"], mean("generation"), alone,
               mean("generation") / alone)
        )


def print_comparison(keel_step, keel_wall, keel_generation, trl):
    """Keel's step timer, wall time and generation phase next to TRL's (step timer:
    on_step_begin -> on_step_end; wall: between step ends; generation: model.generate)."""
    print()
    print(
        f"Keel vs TRL {trl['trl_version']} GRPOTrainer (same model and task, micro batch "
        f"{trl['micro_batch']}, {trl['threads']} threads, TRL steps {trl['first_step']}-"
        f"{trl['first_step'] + trl['steps'] - 1})"
    )
    print("%-36s%10s%10s%12s" % ("", "keel s", "trl s", "keel / trl"))
    rows = [
        ("step time", keel_step, trl["step_s"]),
        ("wall time per step", keel_wall, trl.get("wall_step_s")),
        ("generation", keel_generation, trl.get("generation_s")),
    ]
    for name, keel, ref in rows:
        if ref is None:
            print("%-36s%10.3f%10s%12s" % (name, keel, "-", "-"))
        else:
            print("%-36s%10.3f%10.3f%12.2f" % (name, keel, ref, keel / ref))


def keel_step(metrics_file):
    """Keel's mean step time (step timer), step 1 left out."""
    with open(metrics_file) as f:
        series = {m["name"]: dict(m["points"]) for m in json.load(f)["metrics"]}
    total = series["timing/train/total_step_time"]
    steps = [s for s in sorted(total) if s > 1] or sorted(total)
    return sum(total[s] for s in steps) / len(steps)


def sweep(state, micro_batches):
    """Both sides' step time at every micro batch (to stderr, beside the other tables), and
    each side's best micro batch (to stdout: "KEEL TRL")."""
    keel = {m: keel_step(f"{state}/metrics-mb{m}.json") for m in micro_batches}
    trl = {}
    for m in micro_batches:
        with open(f"{state}/trl-mb{m}.json") as f:
            trl[m] = json.loads(f.read().strip().splitlines()[-1])["step_s"]
    err = sys.stderr
    print("GRPO step time (s) at each micro batch, step 1 left out", file=err)
    print("%-14s%10s%10s" % ("micro batch", "keel", "trl"), file=err)
    for m in micro_batches:
        print("%-14s%10.3f%10.3f" % (m, keel[m], trl[m]), file=err)
    best_keel, best_trl = min(keel, key=keel.get), min(trl, key=trl.get)
    print(
        "each at its best: Keel %.3f s (micro batch %s), TRL %.3f s (micro batch %s): Keel %.2fx as fast as TRL"
        % (keel[best_keel], best_keel, trl[best_trl], best_trl, trl[best_trl] / keel[best_keel]),
        file=err,
    )
    print(best_keel, best_trl)


if __name__ == "__main__":
    if sys.argv[1] == "--sweep":
        sweep(sys.argv[2], sys.argv[3:])
    else:
        main(*sys.argv[1:6])
