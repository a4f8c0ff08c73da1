"""A PyTorch eager training step on the same model and batch as `keel train bench`:
transformers' model in f32, next-token cross-entropy over every token, backward,
`clip_grad_norm_(1.0)`, `torch.optim.AdamW` (lr 1e-5, weight decay 0.01), zero_grad. Median
of timed steps after one warm-up, and of its parts: forward (with the loss), backward, and the
optimiser (clipping, step, zero_grad). With `--group N --prompt-len P` every N consecutive rows
begin with the same P tokens, as a GRPO group's samples do. Prints one JSON line."""

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
    p.add_argument("--group", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=0)
    args = p.parse_args()
    if args.dtype != "f32":
        raise SystemExit("the reference loop runs f32 only")
    if args.threads:
        torch.set_num_threads(args.threads)
    micro = args.micro_batch or args.batch
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).train()
    vocab = model.config.vocab_size
    # `keel train bench`'s ids: the first `prompt_len` tokens of a row are its group's.
    def token(row, i):
        source = row // args.group * args.group if i < args.prompt_len else row
        return (source * args.seq_len + i) * 37 % vocab

    ids = torch.tensor(
        [[token(row, i) for i in range(args.seq_len)] for row in range(args.batch)],
        device=args.device,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    tokens = args.batch * (args.seq_len - 1)

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def step():
        forward = backward = 0.0
        start = time.perf_counter()
        for chunk in ids.split(micro):
            began = time.perf_counter()
            logits = model(chunk).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, vocab), chunk[:, 1:].reshape(-1), reduction="sum"
            ) / tokens
            sync()
            forward += time.perf_counter() - began
            began = time.perf_counter()
            loss.backward()
            sync()
            backward += time.perf_counter() - began
        began = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        sync()
        now = time.perf_counter()
        return now - start, forward, backward, now - began

    step()
    timed = [step() for _ in range(args.repeats)]
    median = statistics.median(t[0] for t in timed)
    parts = {name: statistics.median(t[i] for t in timed) for i, name in enumerate(["forward", "backward", "optimizer"], 1)}
    print(json.dumps({
        "engine": "torch " + torch.__version__.split("+")[0] + " eager",
        "batch": args.batch, "micro_batch": micro, "seq_len": args.seq_len, "dtype": args.dtype,
        "threads": torch.get_num_threads(), "step_seconds": median,
        "forward_seconds": parts["forward"], "backward_seconds": parts["backward"],
        "optimizer_seconds": parts["optimizer"], "group": args.group, "prompt_len": args.prompt_len,
        "tokens_per_s": args.batch * args.seq_len / median,
    }))


if __name__ == "__main__":
    main()
