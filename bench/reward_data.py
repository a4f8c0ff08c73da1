"""Writes the samples `bench/reward-throughput` scores: DIR/math.jsonl (model answers against
ground truths in many forms, about half of them wrong) and DIR/code.jsonl (Python programs,
some wrong, each with stdin/stdout tests). Deterministic for a seed.

    python bench/reward_data.py DIR [--math N] [--code N] [--seed S]
"""

import argparse
import json
import random
from fractions import Fraction
from pathlib import Path

FILLER = (
    "Let me work through this carefully. First I restate the problem, then I simplify the "
    "expression step by step and check the arithmetic once more before answering. "
)


def math_pair(rng):
    """(model answer in LaTeX, ground truth, whether they are equal)."""
    kind = rng.choice(["int", "frac", "decimal", "sqrt", "percent", "expr", "interval", "tuple"])
    right = rng.random() < 0.5
    if kind == "int":
        a = rng.randint(-999, 99999)
        shown = f"{a:,}".replace(",", "{,}") if abs(a) >= 1000 and rng.random() < 0.5 else str(a)
        return (shown if right else str(a + rng.choice([-1, 1, 10]))), str(a)
    if kind == "frac":
        p, q = rng.randint(1, 50), rng.randint(2, 50)
        f = Fraction(p, q)
        truth = f"\\frac{{{f.numerator}}}{{{f.denominator}}}"
        forms = [f"\\dfrac{{{p}}}{{{q}}}", f"{p}/{q}", f"\\tfrac{{{p * 2}}}{{{q * 2}}}"]
        return (rng.choice(forms) if right else f"\\frac{{{p + 1}}}{{{q}}}"), truth
    if kind == "decimal":
        a = Fraction(rng.randint(1, 9999), 100)
        truth = f"{float(a):.2f}"
        return (f"{float(a):.4f}" if right else f"{float(a) + 0.5:.2f}"), truth
    if kind == "sqrt":
        k, n = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7])
        truth = f"{k}\\sqrt{{{n}}}"
        return (f"\\sqrt{{{k * k * n}}}" if right else f"{k + 1}\\sqrt{{{n}}}"), truth
    if kind == "percent":
        a = rng.randint(1, 99)
        return (f"{a}\\%" if right else f"{a + 1}\\%"), f"{a}\\%"
    if kind == "expr":
        a = rng.randint(1, 9)
        truth = f"x^2 - {a * a}"
        return (f"(x-{a})(x+{a})" if right else f"(x-{a})^2"), truth
    if kind == "interval":
        a, b = sorted(rng.sample(range(-20, 20), 2))
        truth = f"({a}, {b}]"
        return (f"\\left({a},{b}\\right]" if right else f"[{a}, {b}]"), truth
    a, b = rng.randint(-9, 9), rng.randint(-9, 9)
    return (f"({a}, {b})" if right else f"({b + 1}, {a})"), f"({a}, {b})"


PROGRAMS = {
    "sum": ("print(sum(map(int, input().split())))", lambda xs: str(sum(xs))),
    "max": ("print(max(map(int, input().split())))", lambda xs: str(max(xs))),
    "sorted": ("print(*sorted(map(int, input().split())))", lambda xs: " ".join(map(str, sorted(xs)))),
    "count": ("print(len(input().split()))", lambda xs: str(len(xs))),
}
WRONG = {
    "sum": "print(sum(map(int, input().split())) + 1)",
    "max": "print(min(map(int, input().split())))",
    "sorted": "print(*map(int, input().split()))",
    "count": "xs = input().split()\nprint(len(xs) - (len(xs) > 3))",
}


def code_sample(rng):
    name = rng.choice(sorted(PROGRAMS))
    program, solve = PROGRAMS[name]
    if rng.random() < 0.3:
        program = WRONG[name]
    tests = []
    for _ in range(3):
        xs = [rng.randint(-50, 50) for _ in range(rng.randint(1, 6))]
        tests.append({"stdin": " ".join(map(str, xs)) + "\n", "stdout": solve(xs) + "\n"})
    response = f"Here is the program.\n```python\n{program}\n```\n"
    return {"messages": [{"role": "user", "content": f"Write `{name}`."}, {"role": "assistant", "content": response}],
            "metadata": {"tests": tests}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path)
    parser.add_argument("--math", type=int, default=2000)
    parser.add_argument("--code", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    args.dir.mkdir(parents=True, exist_ok=True)
    with open(args.dir / "math.jsonl", "w") as f:
        for _ in range(args.math):
            answer, truth = math_pair(rng)
            response = FILLER + f"So the final answer is $\\boxed{{{answer}}}$."
            sample = {"messages": [{"role": "user", "content": "Solve it."}, {"role": "assistant", "content": response}],
                      "metadata": {"ground_truth": truth}}
            f.write(json.dumps(sample) + "\n")
    with open(args.dir / "code.jsonl", "w") as f:
        for _ in range(args.code):
            f.write(json.dumps(code_sample(rng)) + "\n")


if __name__ == "__main__":
    main()
