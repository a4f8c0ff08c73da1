"""Reference computations with Hugging Face transformers, for Keel's parity tests.

Every subcommand prints one JSON document on stdout.

  make-model VARIANT OUT [--dtype float32|bfloat16]   random model of a named variant
  make-models OUT VARIANT...                          several, each in OUT/VARIANT (one process)
  router-loss MODEL INPUT.jsonl                       an MoE model's load-balancing loss over the
                                                     sequences as one right-padded batch
  score MODEL INPUT.jsonl [--temperature T] [--adapter DIR]
                                                     per-token logprobs, one sequence at a time
                                                     (with PEFT LoRA adapters on top when given)
  score-many JOBS.json                                `score` of each {model, input, temperature, adapter}
                                                     in one process: {"results": [logprobs, ...]}
  render MODEL MESSAGES.json [--add-generation-prompt] chat template through the tokenizer
  inspect-many JOBS.json                              per {model, messages, text, sequences}: the
                                                     template rendered without and with the
                                                     generation prompt, `text`'s ids, and the
                                                     sequences' logprobs (one process)
  tokenize MODEL TEXT                                 token ids (add_special_tokens=False)
  generate MODEL IDS.json --max-new-tokens N          greedy `generate`, eos ignored
  render-template TEMPLATE.jinja MESSAGES.json VARS.json [--add-generation-prompt]
"""

import argparse
import json
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=211,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

# The newer families' configs default to pad ids beyond a tiny vocabulary.
FAMILY = dict(COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# Each variant exercises one thing Keel must reproduce. (llama3-rope: with head_dim 16 and
# theta 5e5 the wavelengths are 6.3, 32.4, 167, ...: with an original context of 64 they fall
# in all three bands — kept, smoothed and scaled.)
VARIANTS = {
    "llama3-rope": lambda: transformers.LlamaConfig(
        **COMMON,
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64),
    ),
    "llama-tied": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=True),
    "llama-bias": lambda: transformers.LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True),
    "llama-head-dim": lambda: transformers.LlamaConfig(**COMMON, head_dim=24),
    "llama-linear-rope": lambda: transformers.LlamaConfig(
        **COMMON, rope_scaling=dict(rope_type="linear", factor=2.0)),
    "qwen2-bias": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3-qk-norm": lambda: transformers.Qwen3Config(**COMMON, head_dim=16),
    "qwen3-head-dim": lambda: transformers.Qwen3Config(**{**COMMON, "num_key_value_heads": 1}, head_dim=32),
    "mistral-window": lambda: transformers.MistralConfig(**COMMON, sliding_window=6),
    # Mixtures of experts: top-k weights as the softmax gives them (Qwen3-MoE's default), a
    # dense layer among the sparse ones; renormalised top-k weights; Mixtral with a window.
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 3}, head_dim=16, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=False),
    "qwen3-moe-norm": lambda: transformers.Qwen3MoeConfig(
        **COMMON, num_experts=5, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=True,
        output_router_logits=True, router_aux_loss_coef=0.02),
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=6),
    # The families whose differences are configuration of Keel's one decoder
    # (`Block`, rotary variants): each variant turns on what its family changes, with
    # windows shorter than the test's sequences and soft-caps small enough to bite.
    "gemma2": lambda: transformers.Gemma2Config(
        **{**FAMILY, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
        attn_logit_softcapping=4.0, final_logit_softcapping=2.5),
    "gemma3": lambda: (transformers.Gemma3TextConfig(
        **{**FAMILY, "num_hidden_layers": 4}, head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        tie_word_embeddings=False), "Gemma3ForCausalLM"),
    # LongRoPE with short factors (every sequence within the original context; a window on
    # every layer) and with long ones (every scored sequence past it), three quarters of each
    # head rotating.
    "phi3-longrope-short": lambda: transformers.Phi3Config(
        **FAMILY, rope_parameters=_longrope(), original_max_position_embeddings=64, sliding_window=6,
        tie_word_embeddings=False),
    "phi3-longrope-long": lambda: transformers.Phi3Config(
        **FAMILY, rope_parameters=_longrope(), original_max_position_embeddings=4, tie_word_embeddings=True),
    "olmo2": lambda: transformers.Olmo2Config(**FAMILY),
    "olmo3": lambda: transformers.Olmo3Config(**{**FAMILY, "num_hidden_layers": 4}, sliding_window=6),
    "glm4": lambda: transformers.Glm4Config(**FAMILY, head_dim=16, partial_rotary_factor=0.5, attention_bias=True),
    "granite": lambda: transformers.GraniteConfig(
        **FAMILY, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.05,
        logits_scaling=8.0, attention_bias=True, mlp_bias=True),
    "smollm3": lambda: transformers.SmolLM3Config(**{**FAMILY, "num_hidden_layers": 4}, no_rope_layer_interval=2),
}


def _longrope():
    """Phi-3 LongRoPE parameters for COMMON's heads (16 dims, 12 rotating: 6 factors each)."""
    return {"rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0]}


def make_model(variant, out, dtype, seed):
    torch.manual_seed(seed)
    config = VARIANTS[variant]()
    if isinstance(config, tuple):
        config, architecture = config
    else:
        architecture = type(config).__name__.replace("Config", "ForCausalLM")
    config.architectures = [architecture]
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    # Weights far from the default init so that every tensor visibly matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "Gemma" in architecture:
                # Gemma's norms apply 1 + w.
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
            else:
                p.normal_(0.0, 0.15)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    return {"variant": variant, "architectures": config.architectures}


def score(model_dir, input_path, temperature, adapter=None):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    rows = []
    with open(input_path) as f, torch.no_grad():
        for line in f:
            ids = json.loads(line)["token_ids"]
            logits = model(torch.tensor([ids])).logits[0].float() / temperature
            lp = torch.log_softmax(logits, dim=-1)
            token_lp = [0.0] + [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
            rows.append(token_lp)
    return {"logprobs": rows}


def inspect(model, messages, text, sequences):
    tok = AutoTokenizer.from_pretrained(model)
    rendered = [tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=g) for g in (False, True)]
    ids = tok.encode(text, add_special_tokens=False)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="eager").eval()
    rows = []
    with torch.no_grad():
        for seq in sequences:
            lp = torch.log_softmax(net(torch.tensor([seq])).logits[0].float(), dim=-1)
            rows.append([0.0] + [lp[i - 1, seq[i]].item() for i in range(1, len(seq))])
    return {"rendered": rendered, "ids": ids, "logprobs": rows}


def router_loss(model_dir, input_path):
    """transformers' load-balancing loss (`aux_loss`) of a right-padded batch, padding masked."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    rows = [json.loads(line)["token_ids"] for line in open(input_path)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_router_logits=True)
    return {"aux_loss": out.aux_loss.item()}


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("make-model")
    p.add_argument("variant", choices=sorted(VARIANTS))
    p.add_argument("out")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("make-models")
    p.add_argument("out")
    p.add_argument("variants", nargs="+", choices=sorted(VARIANTS))
    p = sub.add_parser("inspect-many")
    p.add_argument("jobs")
    p = sub.add_parser("score-many")
    p.add_argument("jobs")
    p = sub.add_parser("score")
    p.add_argument("model")
    p.add_argument("input")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--adapter")
    p = sub.add_parser("router-loss")
    p.add_argument("model")
    p.add_argument("input")
    p = sub.add_parser("render")
    p.add_argument("model")
    p.add_argument("messages")
    p.add_argument("--add-generation-prompt", action="store_true")
    p = sub.add_parser("tokenize")
    p.add_argument("model")
    p.add_argument("text")
    p = sub.add_parser("generate")
    p.add_argument("model")
    p.add_argument("ids")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p = sub.add_parser("render-template")
    p.add_argument("template")
    p.add_argument("messages")
    p.add_argument("vars")
    p.add_argument("--add-generation-prompt", action="store_true")
    args = parser.parse_args()

    if args.cmd == "make-model":
        result = make_model(args.variant, args.out, args.dtype, args.seed)
    elif args.cmd == "make-models":
        result = {"models": [make_model(v, f"{args.out}/{v}", "float32", 0) for v in args.variants]}
    elif args.cmd == "inspect-many":
        result = {"results": [inspect(**job) for job in json.load(open(args.jobs))]}
    elif args.cmd == "score-many":
        jobs = json.load(open(args.jobs))
        result = {"results": [score(j["model"], j["input"], j.get("temperature", 1.0), j.get("adapter"))["logprobs"]
                              for j in jobs]}
    elif args.cmd == "score":
        result = score(args.model, args.input, args.temperature, args.adapter)
    elif args.cmd == "router-loss":
        result = router_loss(args.model, args.input)
    elif args.cmd == "render":
        tok = AutoTokenizer.from_pretrained(args.model)
        messages = json.load(open(args.messages))
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=args.add_generation_prompt)
        result = {"text": text}
    elif args.cmd == "generate":
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        ids = torch.tensor([json.load(open(args.ids))])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                                 pad_token_id=0)
        result = {"token_ids": out[0, ids.shape[1]:].tolist()}
    elif args.cmd == "tokenize":
        tok = AutoTokenizer.from_pretrained(args.model)
        result = {"ids": tok.encode(args.text, add_special_tokens=False)}
    else:
        # The same Jinja2 set-up transformers uses, on a bare template.
        from transformers.utils.chat_template_utils import _compile_jinja_template
        template = _compile_jinja_template(open(args.template).read())
        messages = json.load(open(args.messages))
        variables = json.load(open(args.vars))
        text = template.render(messages=messages, add_generation_prompt=args.add_generation_prompt, **variables)
        result = {"text": text}
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
