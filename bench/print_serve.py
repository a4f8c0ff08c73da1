"""Reads JSON lines from `keel generate serve-bench` (one per request rate) and, optionally,
one from `bench/hf_serve.py`, and prints them as `vllm bench serve` does, with the ratio of
Keel's unlimited-rate throughput to transformers' offline batch throughput."""

import json
import sys


def ms(stats, key):
    value = stats[key]
    return "-" if value is None else f"{value:.2f}"


def main():
    rows = [json.loads(line) for line in sys.stdin if line.strip()]
    keel = [r for r in rows if r["engine"] == "keel-serve-bench"]
    ref = next((r for r in rows if r["engine"] != "keel-serve-bench"), None)
    for r in keel:
        print(f"============ Serving benchmark: rate {r['request_rate']} req/s, "
              f"concurrency {r['max_concurrency'] or 'unlimited'} ============")
        print(f"{'prompts x input / output tokens:':<40}{r['num_prompts']} x {r['input_len']} / {r['output_len']}")
        print(f"{'successful / failed requests:':<40}{r['completed']} / {r['failed']}")
        print(f"{'benchmark duration (s):':<40}{r['duration_s']:.2f}")
        print(f"{'request throughput (req/s):':<40}{r['requests_per_s']:.2f}")
        print(f"{'output token throughput (tok/s):':<40}{r['output_tokens_per_s']:.1f}")
        print(f"{'total token throughput (tok/s):':<40}{r['total_tokens_per_s']:.1f}")
        for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL")):
            s = r[name]
            print(f"{label + ' mean / median / p99 (ms):':<40}{ms(s, 'mean_ms')} / {ms(s, 'median_ms')} / {ms(s, 'p99_ms')}")
    if ref is not None:
        print(f"============ Reference: {ref['engine']}, offline batches of {ref['batch']} ============")
        print(f"{'duration (s):':<40}{ref['duration_s']:.2f}")
        print(f"{'request throughput (req/s):':<40}{ref['requests_per_s']:.2f}")
        print(f"{'output token throughput (tok/s):':<40}{ref['output_tokens_per_s']:.1f}")
        unlimited = [r for r in keel if r["request_rate"] == "inf"]
        if unlimited:
            ratio = unlimited[0]["output_tokens_per_s"] / ref["output_tokens_per_s"]
            print(f"{'keel / transformers output tok/s:':<40}{ratio:.2f}  (above 1 favours Keel)")


if __name__ == "__main__":
    main()
