"""SFT conversations for the agent demo (bench/agent-demo), in the example agent's format.

Each is a multiplication of two numbers from 2 to 99, the agent's system prompt and the
question as the arithmetic dataset asks it; half of them call the calculator
(`<tool_call>{"name": "calculator", ...}</tool_call>`, the tool's answer, then
`\\boxed{product}`), the other half answer at once. A small model cannot multiply two-digit
numbers in its head, so GRPO through the agent has something to find: calling the tool.

    python3 bench/agent_demo_data.py --out DIR [--count 4000] [--seed 1]
"""

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "agent"))
from agent import SYSTEM  # noqa: E402


def conversation(rng):
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} * {b}?"}]
    if rng.random() < 0.5:
        call = {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}
        messages.append({"role": "assistant", "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"})
        messages.append({"role": "tool", "content": str(a * b)})
    messages.append({"role": "assistant", "content": f"\\boxed{{{a * b}}}"})
    return {"messages": messages}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sft.jsonl"), "w") as f:
        for _ in range(args.count):
            f.write(json.dumps(conversation(rng)) + "\n")
