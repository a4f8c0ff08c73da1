"""Reads JSON lines from `keel model bench` and `bench/hf_throughput.py`, alternating Keel
then transformers for each shape, and prints them side by side with Keel/transformers ratios."""

import json
import os
import sys


def main():
    model = sys.argv[1]
    rows = [json.loads(line) for line in sys.stdin if line.strip()]
    print(f"model: {model}   threads: {rows[0]['threads']}   host CPUs: {os.cpu_count()}")
    print(f"{'batch x prompt x decode':<26}{'engine':<24}{'prefill tok/s':>14}{'decode tok/s':>14}")
    for keel, ref in zip(rows[0::2], rows[1::2]):
        shape = f"{keel['batch']} x {keel['prompt_tokens']} x {keel['decode_tokens']}"
        for r in (keel, ref):
            print(f"{shape:<26}{r['engine']:<24}{r['prefill_tokens_per_s']:>14.1f}{r['decode_tokens_per_s']:>14.1f}")
        prefill = keel["prefill_tokens_per_s"] / ref["prefill_tokens_per_s"]
        decode = keel["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
        print(f"{shape:<26}{'ratio keel / hf':<24}{prefill:>14.2f}{decode:>14.2f}")


if __name__ == "__main__":
    main()
