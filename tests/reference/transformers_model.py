"""A small randomly initialised model made by transformers (not `keel model init`), with the
tokenizer files of SRC (a `keel model init` directory, whose vocabulary size it takes), saved
in f32 as transformers saves it: what a user brings.

    python tests/reference/transformers_model.py SRC DST --arch llama|qwen2|qwen3 --hidden 64 --layers 2
"""

import argparse
import json
import os
import shutil

import torch
import transformers

parser = argparse.ArgumentParser()
parser.add_argument("src")
parser.add_argument("dst")
parser.add_argument("--arch", choices=["llama", "qwen2", "qwen3"], required=True)
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

source = json.load(open(os.path.join(args.src, "config.json")))
heads = max(2, args.hidden // 32)
shape = dict(
    vocab_size=source["vocab_size"],
    hidden_size=args.hidden,
    intermediate_size=args.hidden * 3,
    num_hidden_layers=args.layers,
    num_attention_heads=heads,
    num_key_value_heads=heads // 2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=args.arch != "llama",
    bos_token_id=source.get("bos_token_id"),
    eos_token_id=source.get("eos_token_id"),
    pad_token_id=source.get("pad_token_id"),
)
config_class, model_class = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}[args.arch]
if args.arch == "qwen3":
    shape["head_dim"] = args.hidden // heads
torch.manual_seed(args.seed)
model = model_class(config_class(**shape)).to(torch.float32)
os.makedirs(args.dst, exist_ok=True)
model.save_pretrained(args.dst, safe_serialization=True)
for name in os.listdir(args.src):
    if name.startswith("tokenizer") or name in ("special_tokens_map.json", "generation_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(args.src, name), os.path.join(args.dst, name))
print(f"{args.arch}, hidden {args.hidden}, {args.layers} layers, in {args.dst}")
