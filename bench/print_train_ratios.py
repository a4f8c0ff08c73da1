"""Reads JSON lines from `keel train bench` and `bench/hf_train_throughput.py`, alternating
Keel then PyTorch for each shape, and prints them side by side with Keel/PyTorch ratios;
then Keel's mixed-length runs (`batching` rows, packed, dynamic) with each one's real
tokens/s as a ratio to padded rows."""

import json
import os
import sys


def main():
    model = sys.argv[1]
    lines = [json.loads(line) for line in sys.stdin if line.strip()]
    rows = [r for r in lines if r.get("min_len", r["seq_len"]) == r["seq_len"] and r.get("batching", "rows") == "rows"]
    mixed = [r for r in lines if r not in rows]
    print(f"model: {model}   threads: {lines[0]['threads']}   host CPUs: {os.cpu_count()}")
    print("step s and its parts: forward (with the loss), backward, optimiser (clipping, step); medians")
    print(f"{'batch x seq (micro)':<30}{'engine':<26}{'step s':>10}{'tokens/s':>12}{'forward':>10}{'backward':>10}{'optim':>10}")
    part = lambda r, name: f"{r[name]:>10.3f}" if name in r else f"{'-':>10}"
    for keel, ref in zip(rows[0::2], rows[1::2]):
        shape = f"{keel['batch']} x {keel['seq_len']} ({keel['micro_batch']})"
        if keel.get("group", 1) > 1:
            shape += f" {keel['group']}/{keel['prompt_len']}"
        for r in (keel, ref):
            parts = "".join(part(r, n) for n in ["forward_seconds", "backward_seconds", "optimizer_seconds"])
            print(f"{shape:<30}{r['engine']:<26}{r['step_seconds']:>10.3f}{r['tokens_per_s']:>12.1f}{parts}")
        ratio = keel["tokens_per_s"] / ref["tokens_per_s"]
        print(f"{shape:<30}{'ratio keel / torch':<26}{'':>10}{ratio:>12.2f}")
    if any(r.get("group", 1) > 1 for r in rows):
        print("(G/P: every G rows begin with the same P tokens, as a GRPO group's samples do)")
    padded = None
    for r in mixed:
        if r["batching"] == "rows":
            padded = r
            print(f"\nmixed lengths {r['min_len']}..{r['seq_len']}, {r['batch']} sequences, {r['tokens']} tokens, "
                  f"budget {r['micro_batch']} rows x {r['seq_len']} tokens")
        shape = f"keel {r['batching']}"
        ratio = r["tokens_per_s"] / padded["tokens_per_s"] if padded else float("nan")
        computed = r.get("computed_tokens")
        cost = f", computes {computed} positions (x{computed / r['tokens']:.2f} the real tokens)" if computed else ""
        print(f"{shape:<24}{'':<26}{r['step_seconds']:>10.3f}{r['tokens_per_s']:>12.1f}   x{ratio:.2f} of padded{cost}")


if __name__ == "__main__":
    main()
