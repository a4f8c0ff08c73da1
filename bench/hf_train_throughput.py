"""A PyTorch eager training step on the same model and batch as `keel train bench`:
transformers' model in f32, next-token cross-entropy over every token, backward,
`clip_grad_norm_(1.0)`, `torch.optim.AdamW` (lr 1e-5, weight decay 0.01), zero_grad. Median
of timed steps after one warm-up. Prints one JSON line."""

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
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int)
    p.add_argument("--dtype", default="f32")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    if args.dtype != "f32":
        raise SystemExit("the reference loop runs f32 only")
    if args.threads:
        torch.set_num_threads(args.threads)
    micro = args.micro_batch or args.batch
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).train()
    vocab = model.config.vocab_size
    ids = torch.tensor(
        [[(row * args.seq_len + i) * 37 % vocab for i in range(args.seq_len)] for row in range(args.batch)],
        device=args.device,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    tokens = args.batch * (args.seq_len - 1)

    def step():
        start = time.perf_counter()
        for chunk in ids.split(micro):
            logits = model(chunk).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, vocab), chunk[:, 1:].reshape(-1), reduction="sum"
            ) / tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step()
    median = statistics.median(step() for _ in range(args.repeats))
    print(json.dumps({
        "engine": "torch " + torch.__version__.split("+")[0] + " eager",
        "batch": args.batch, "micro_batch": micro, "seq_len": args.seq_len, "dtype": args.dtype,
        "threads": torch.get_num_threads(), "step_seconds": median,
        "tokens_per_s": args.batch * args.seq_len / median,
    }))


if __name__ == "__main__":
    main()
