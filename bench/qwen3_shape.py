"""A randomly initialised Qwen3 model of a real model's shape, for benchmarks on a GPU where no
model can be downloaded: `0.6b` is Qwen3-0.6B's (hidden 1024, 28 layers, 16 query and 8 KV
heads of 128, intermediate 3072, vocabulary 151,936, tied embeddings), `tiny` a small one of
the same form for trying a script on the CPU. Saved in bf16 by transformers, with the
tokenizer files (and special token ids) of SRC, a `keel model init` directory, whose BPE
vocabulary is filled up to the model's with tokens `x<id>`: no merge makes them, so text
encodes as before, but every id the model can draw decodes to text (a server streams a
chunk per token, as it would for a real model, and a benchmark times every token).

    python bench/qwen3_shape.py SRC DST [--shape 0.6b|tiny]
"""

import argparse
import json
import os
import shutil

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=4096),
}

parser = argparse.ArgumentParser()
parser.add_argument("src")
parser.add_argument("dst")
parser.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
args = parser.parse_args()

source = json.load(open(os.path.join(args.src, "config.json")))
config = Qwen3Config(
    **SHAPES[args.shape],
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=source.get("bos_token_id"),
    eos_token_id=source.get("eos_token_id"),
    pad_token_id=source.get("pad_token_id"),
    torch_dtype="bfloat16",
)
torch.manual_seed(0)
model = Qwen3ForCausalLM(config).to(torch.bfloat16)
os.makedirs(args.dst, exist_ok=True)
model.save_pretrained(args.dst, safe_serialization=True)
for name in os.listdir(args.src):
    if name.startswith("tokenizer") or name in ("special_tokens_map.json", "generation_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(args.src, name), os.path.join(args.dst, name))
tokenizer_path = os.path.join(args.dst, "tokenizer.json")
tokenizer = json.load(open(tokenizer_path))
if tokenizer["model"]["type"] == "BPE":
    vocab = tokenizer["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in tokenizer.get("added_tokens", [])}
    for token_id in range(config.vocab_size):
        if token_id not in taken:
            vocab[f"x{token_id}"] = token_id
    json.dump(tokenizer, open(tokenizer_path, "w"), ensure_ascii=False)
print(f"{args.shape}-shaped Qwen3, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, in {args.dst}")
