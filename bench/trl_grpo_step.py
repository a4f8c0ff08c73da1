"""TRL's GRPOTrainer on the same GRPO step as bench/grpo-step: the arithmetic task's
`What is A op B?` prompts as one user message through the model's chat template, PROMPTS
prompts x GENERATIONS sampled completions per optimiser step, up to 16 new tokens at
temperature 1 / top-p 1, a clipped policy-gradient loss (dapo = token-level mean, Keel's
`token_level_loss`) with a k3 KL penalty to a reference model at Keel's default beta, AdamW at
Keel's default lr / weight decay, constant schedule, grad-norm clip 1, f32 on the CPU with
THREADS threads. Rewards: 1 when the last number in the completion equals the answer.

Each optimiser step is timed by a TrainerCallback (on_step_begin -> on_step_end, plus the
wall time between consecutive step ends); model.generate and the reward function are timed
too. Step 1 is warm-up and left out. Nothing is downloaded. Prints one JSON line."""

import argparse
import contextlib
import json
import os
import random
import re
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

# Keel's run-spec defaults (shared/keel-protocol/src/training.rs, run.rs).
KEEL_KL_BETA = 0.01  # ClippedPgConfig::reference_policy_kl_penalty
KEEL_LR = 5e-6  # OptimizerConfig::lr
KEEL_WEIGHT_DECAY = 0.01  # OptimizerConfig::weight_decay
KEEL_MAX_GRAD_NORM = 1.0  # TrainingConfig::max_grad_norm
KEEL_EPSILON = 0.2  # ClippedPgConfig::ratio_clip_min / ratio_clip_max
KEEL_TEMPERATURE = 1.0  # GenerationSpec::temperature
KEEL_TOP_P = 1.0  # GenerationSpec::top_p

MASK64 = (1 << 64) - 1


def held_out(a, op, b):
    """Keel's held-out tenth of the problem space (services/orchestrator/src/data.rs)."""
    rotated = ((b << 29) | (b >> 35)) & MASK64
    z = ((a * 0x9E3779B97F4A7C15) & MASK64) ^ rotated ^ ord(op)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) % 10 == 0


def arithmetic(size, max_operand, operations, seed):
    """Keel's arithmetic train split (same question text and answer; Python's RNG, so not
    the same draws). Conversational prompts: TRL applies the chat template."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < size:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice(operations)
        if held_out(a, op, b):
            continue
        value = a + b if op == "+" else a - b if op == "-" else a * b
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} {op} {b}?"}], "answer": str(value)})
    return rows


NUMBER = re.compile(r"-?\d+")
reward_seconds = [0.0]


def arithmetic_reward(completions, answer, **_):
    """1.0 when the completion's last integer (inside \\boxed{} or not) is the answer."""
    start = time.perf_counter()
    rewards = []
    for completion, expected in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = NUMBER.findall(text)
        rewards.append(1.0 if numbers and numbers[-1] == expected else 0.0)
    reward_seconds[0] += time.perf_counter() - start
    return rewards


class StepTimer(TrainerCallback):
    """Seconds per optimiser step (on_step_begin -> on_step_end), the wall time between step
    ends, and how much of each step went to model.generate and the reward function."""

    def __init__(self):
        self.steps = []  # (step s, wall s or None, generation s, reward s)
        self.generation = 0.0
        self.began = self.last_end = None

    def timed_generate(self, generate):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return generate(*args, **kwargs)
            finally:
                self.generation += time.perf_counter() - start

        return wrapper

    def on_step_begin(self, args, state, control, **kwargs):
        self.generation = 0.0
        reward_seconds[0] = 0.0
        self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        end = time.perf_counter()
        wall = end - self.last_end if self.last_end is not None else None
        self.steps.append((end - self.began, wall, self.generation, reward_seconds[0]))
        self.last_end = end


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--micro-batch", type=int, default=32, help="Keel's training.micro_batch_size")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    rows = args.prompts * args.generations
    # One optimiser step = one generation round of `rows` completions, split into micro
    # batches like Keel's (training.micro_batch_size 32 of global_batch_size rows).
    micro = min(args.micro_batch, rows)
    if rows % micro:
        raise SystemExit(f"{rows} rows do not split into micro batches of {micro}")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset = Dataset.from_list(arithmetic(max(2000, rows * args.steps), 20, "+-", args.seed))
    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="trl-grpo-step-") as out:
        config = GRPOConfig(
            output_dir=out,
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,  # TRL defaults it to on
            activation_checkpointing=False,  # its transformers 5 name
            model_init_kwargs={"dtype": "float32"},
            seed=args.seed,
            max_steps=args.steps,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=rows // micro,
            num_generations=args.generations,
            max_completion_length=args.max_new_tokens,
            temperature=KEEL_TEMPERATURE,
            top_p=KEEL_TOP_P,
            beta=KEEL_KL_BETA,
            epsilon=KEEL_EPSILON,
            loss_type="dapo",
            num_iterations=1,
            learning_rate=KEEL_LR,
            weight_decay=KEEL_WEIGHT_DECAY,
            max_grad_norm=KEEL_MAX_GRAD_NORM,
            lr_scheduler_type="constant",
            warmup_steps=0,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(
            model=args.model,
            reward_funcs=arithmetic_reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
        )
        trainer.model.generate = timer.timed_generate(trainer.model.generate)
        with contextlib.redirect_stdout(sys.stderr):  # the trainer's log lines; stdout is the JSON line
            trainer.train()

    measured = timer.steps[1:] or timer.steps
    walls = [w for _, w, _, _ in timer.steps[1:] if w is not None]
    print(json.dumps({
        "engine": "trl",
        "trl_version": trl.__version__,
        "torch_version": torch.__version__.split("+")[0],
        "steps": len(measured),
        "first_step": len(timer.steps) - len(measured) + 1,
        "prompts": args.prompts,
        "generations": args.generations,
        "micro_batch": micro,
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "beta": KEEL_KL_BETA,
        "lr": KEEL_LR,
        "temperature": KEEL_TEMPERATURE,
        "step_s": mean([s for s, _, _, _ in measured]),
        "wall_step_s": mean(walls),
        "generation_s": mean([g for _, _, g, _ in measured]),
        "reward_s": mean([r for _, _, _, r in measured]),
        "warmup_step_s": timer.steps[0][0] if timer.steps else None,
    }))


if __name__ == "__main__":
    main()
