"""transformers' batched greedy `generate` on the prompts `keel generate serve-bench` sent
(`--save-prompts`): the reference for `bench/serve` on the CPU. transformers has no server,
so it runs as an offline batch job, the fastest way it can: the prompts in batches of
`--batch` (the generator's `max_num_seqs`), every row generating exactly `--output-len`
tokens. Its requests/s and output tokens/s therefore bound what a server built on it could
do at an unlimited request rate. Prints one JSON line."""

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int)
    p.add_argument("--dtype", default="f32")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    model.generation_config.eos_token_id = None
    with open(args.prompts) as f:
        prompts = json.load(f)
    if len({len(p) for p in prompts}) != 1:
        raise SystemExit("hf_serve.py: the prompts must all have the same length")

    def run(rows):
        ids = torch.tensor(rows, device=args.device)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.output_len,
                           min_new_tokens=args.output_len, pad_token_id=0)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    run(prompts[:1])  # warm-up
    start = time.perf_counter()
    for i in range(0, len(prompts), args.batch):
        run(prompts[i:i + args.batch])
    duration = time.perf_counter() - start
    print(json.dumps({
        "engine": f"transformers {__import__('transformers').__version__} generate", "num_prompts": len(prompts),
        "input_len": len(prompts[0]), "output_len": args.output_len, "batch": args.batch, "duration_s": duration,
        "requests_per_s": len(prompts) / duration, "output_tokens_per_s": len(prompts) * args.output_len / duration,
        "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
