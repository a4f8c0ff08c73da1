"""transformers' batched greedy `generate` measured as `keel generate bench` measures Keel's
generator: the same prompts (B rows of P token ids), time to the first token of every row
(`generate` with one new token), then decode tokens/s over the remaining D − 1 tokens of a
full run. Median of timed runs after a warm-up. Prints one JSON line."""

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int)
    p.add_argument("--dtype", default="f32")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    model.generation_config.eos_token_id = None
    vocab = model.config.vocab_size
    ids = torch.tensor([[((row * args.prompt_tokens + i) * 37 + 5) % vocab for i in range(args.prompt_tokens)]
                        for row in range(args.batch)], device=args.device)

    def timed(new_tokens):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, pad_token_id=0)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(args.decode_tokens)
    ttft = statistics.median(timed(1) for _ in range(args.repeats))
    total = statistics.median(timed(args.decode_tokens) for _ in range(args.repeats))
    print(json.dumps({
        "engine": "transformers " + __import__("transformers").__version__,
        "batch": args.batch, "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
        "dtype": args.dtype, "threads": torch.get_num_threads(), "ttft_s": ttft,
        "decode_tokens_per_s": args.batch * (args.decode_tokens - 1) / (total - ttft),
    }))


if __name__ == "__main__":
    main()
