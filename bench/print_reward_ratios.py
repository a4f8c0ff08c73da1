"""Reads JSON lines from `keel reward bench` and `bench/reward_reference.py`, Keel then the
reference for each environment, and prints samples/s side by side, the ratio, and how often
the two gave the same reward."""

import json
import os
import sys


def main():
    rows = [json.loads(line) for line in sys.stdin if line.strip()]
    print(f"host CPUs: {os.cpu_count()}")
    print(f"{'env':<8}{'engine':<24}{'samples':>9}{'seconds':>10}{'samples/s':>12}")
    for keel, ref in zip(rows[0::2], rows[1::2]):
        for r in (keel, ref):
            print(f"{r['env']:<8}{r['engine']:<24}{r['samples']:>9}{r['seconds']:>10.3f}{r['samples_per_s']:>12.1f}")
        ratio = keel["samples_per_s"] / ref["samples_per_s"]
        same = sum(abs(a - b) < 1e-9 for a, b in zip(keel["rewards"], ref["rewards"])) / len(keel["rewards"])
        print(f"{keel['env']:<8}{'ratio keel / reference':<24}{'':>9}{'':>10}{ratio:>12.2f}")
        print(f"{keel['env']:<8}{'same reward':<24}{'':>9}{'':>10}{same:>12.1%}")


if __name__ == "__main__":
    main()
