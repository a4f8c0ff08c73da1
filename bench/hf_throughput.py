"""transformers' prefill and decode tokens/s, measured as `keel model bench` measures Keel:
the same token ids and shapes, greedy decoding with the KV cache, median of timed runs after
one warm-up. Prints one JSON line."""

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM


def one_run(model, args, vocab):
    ids = [(i * 37 + 5) % vocab for i in range(args.batch * args.prompt_tokens)]
    prompt = torch.tensor(ids).view(args.batch, args.prompt_tokens)
    start = time.perf_counter()
    out = model(prompt, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    prefill = time.perf_counter() - start
    past = out.past_key_values
    start = time.perf_counter()
    for _ in range(args.decode_tokens):
        out = model(nxt, past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return prefill, time.perf_counter() - start


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    with torch.no_grad():
        one_run(model, args, vocab)
        runs = [one_run(model, args, vocab) for _ in range(args.repeats)]
    prefill = statistics.median(r[0] for r in runs)
    decode = statistics.median(r[1] for r in runs)
    print(json.dumps({
        "engine": "transformers " + __import__("transformers").__version__,
        "batch": args.batch, "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
        "dtype": "f32", "threads": torch.get_num_threads(),
        "prefill_tokens_per_s": args.batch * args.prompt_tokens / prefill,
        "decode_tokens_per_s": args.batch * args.decode_tokens / decode,
    }))


if __name__ == "__main__":
    main()
