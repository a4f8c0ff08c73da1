"""Reads JSON lines from `keel generate serve-bench` (one per request rate) and, optionally,
one from `bench/hf_serve.py`, and prints them as `vllm bench serve` does, with the ratio of
Keel's unlimited-rate throughput to transformers' offline batch throughput. With
`--published vllm`, also a table of Keel's figures beside vLLM 0.19's published ones for
Qwen3-0.6B in bf16 on one H100 80GB (512-token prompts, 128-token outputs)."""

import json
import sys

# vLLM 0.19's published serving figures for Qwen/Qwen3-0.6B, bf16, one H100 80GB,
# 512 in / 128 out: time per output token at 16 requests/s, requests/s at an unlimited rate.
VLLM_TPOT_AT_16_MS = 2.39
VLLM_REQUESTS_PER_S_UNLIMITED = 94.9


def ms(stats, key):
    value = stats[key]
    return "-" if value is None else f"{value:.2f}"


def published_vllm(keel):
    """Keel's figures beside vLLM's published ones, as a markdown table."""
    at16 = next((r for r in keel if str(r["request_rate"]) in ("16", "16.0")), None)
    unlimited = next((r for r in keel if r["request_rate"] == "inf"), None)
    print()
    print("| figure (512 in / 128 out) | Keel, this run | vLLM 0.19, published (H100 80GB) | vLLM's lead (times faster) |")
    print("|---|---|---|---|")
    if at16 is not None and at16["tpot"]["mean_ms"] is not None:
        tpot = at16["tpot"]["mean_ms"]
        print(f"| TPOT at 16 req/s, mean (ms) | {tpot:.2f} (median {ms(at16['tpot'], 'median_ms')}) | "
              f"{VLLM_TPOT_AT_16_MS} | {tpot / VLLM_TPOT_AT_16_MS:.2f} |")
    if unlimited is not None:
        rps = unlimited["requests_per_s"]
        print(f"| requests/s, unlimited rate | {rps:.1f} | {VLLM_REQUESTS_PER_S_UNLIMITED} | "
              f"{VLLM_REQUESTS_PER_S_UNLIMITED / rps:.2f} |")
        print(f"| output tokens/s, unlimited rate | {unlimited['output_tokens_per_s']:.0f} | "
              f"{VLLM_REQUESTS_PER_S_UNLIMITED * 128:.0f} | "
              f"{VLLM_REQUESTS_PER_S_UNLIMITED * 128 / unlimited['output_tokens_per_s']:.2f} |")
    print("\nThe lead: Keel's time per token over vLLM's, vLLM's throughput over Keel's; above 1, vLLM is faster.")


def main():
    published = sys.argv[sys.argv.index("--published") + 1] if "--published" in sys.argv else "none"
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
    if published == "vllm":
        published_vllm(keel)


if __name__ == "__main__":
    main()
