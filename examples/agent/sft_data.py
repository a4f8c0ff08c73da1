"""SFT conversations for the agent demo, in the example agent's format (examples/agent/agent.py).

Each is a multiplication `What is A * B?` (operands 0 to --max-operand) from the `train` split
of Keel's `arithmetic` dataset (the same fixed hash of each problem, so none is a validation
or test problem of a run with `split: validation` or `split: test`), after the agent's system
prompt. A share of them (--tool-share) call the calculator
(`<tool_call>{"name": "calculator", ...}</tool_call>`, the tool's answer, then
`\\boxed{product}`); the others answer at once with the right product. A small model cannot
multiply two-digit numbers in its head, and a model trained on this mostly answers at once:
what GRPO through the agent has to find is when the tool pays.

    python3 examples/agent/sft_data.py --out FILE [--count 8000] [--tool-share 0.3] [--seed 1]
"""

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(__file__))
from agent import SYSTEM  # noqa: E402

MASK = (1 << 64) - 1


def split_of(a, op, b):
    """The split of problem (a, op, b), as Keel's `arithmetic` dataset cuts the problem space:
    a splitmix64 of the problem, a quarter each validation and test, half train."""
    z = ((a * 0x9E3779B97F4A7C15) & MASK) ^ (((b << 29) | (b >> 35)) & MASK) ^ ord(op)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return {0: "validation", 1: "test"}.get((z ^ (z >> 31)) % 4, "train")


def conversation(a, b, call_tool):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} * {b}?"}]
    if call_tool:
        call = {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}
        messages.append({"role": "assistant", "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"})
        messages.append({"role": "tool", "content": str(a * b)})
    messages.append({"role": "assistant", "content": f"\\boxed{{{a * b}}}"})
    return {"messages": messages}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    parser.add_argument("--count", type=int, default=8000)
    parser.add_argument("--tool-share", type=float, default=0.3)
    parser.add_argument("--max-operand", type=int, default=99)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if not 0.0 <= args.tool_share <= 1.0:
        parser.error(f"--tool-share: a share from 0 to 1, not {args.tool_share}")
    if args.count < 1 or args.max_operand < 1:
        parser.error("--count and --max-operand: 1 or more")
    train = [(a, b) for a in range(args.max_operand + 1) for b in range(args.max_operand + 1)
             if split_of(a, "*", b) == "train"]
    rng = random.Random(args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    written = args.out + ".tmp"
    with open(written, "w") as f:
        for _ in range(args.count):
            a, b = rng.choice(train)
            f.write(json.dumps(conversation(a, b, rng.random() < args.tool_share)) + "\n")
    os.replace(written, args.out)


if __name__ == "__main__":
    main()
