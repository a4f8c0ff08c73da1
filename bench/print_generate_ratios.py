"""Reads JSON lines from `keel generate bench` and `bench/hf_generate.py`, alternating Keel
then transformers for each batch size, and prints them side by side with ratios."""

import json
import os
import sys


def main():
    model = sys.argv[1]
    rows = [json.loads(line) for line in sys.stdin if line.strip()]
    print(f"model: {model}   threads: {rows[0]['threads']}   host CPUs: {os.cpu_count()}")
    print(f"{'batch x prompt x decode':<26}{'engine':<24}{'TTFT s':>10}{'decode tok/s':>14}")
    for keel, ref in zip(rows[0::2], rows[1::2]):
        shape = f"{keel['batch']} x {keel['prompt_tokens']} x {keel['decode_tokens']}"
        for r in (keel, ref):
            print(f"{shape:<26}{r['engine']:<24}{r['ttft_s']:>10.3f}{r['decode_tokens_per_s']:>14.1f}")
        ttft = keel["ttft_s"] / ref["ttft_s"]
        decode = keel["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
        print(f"{shape:<26}{'ratio keel / hf':<24}{ttft:>10.2f}{decode:>14.2f}")
    print("(TTFT ratio below 1 and decode ratio above 1 favour Keel)")


if __name__ == "__main__":
    main()
