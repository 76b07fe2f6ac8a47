#!/usr/bin/env python3
"""Write a random-weight Hugging Face Llama checkpoint (BF16 safetensors, sharded, with
config.json and a small byte-level BPE tokenizer) for timing `kestrel convert`.

usage: synth_hf_checkpoint.py DIR [--layers N] [--hidden H] [--ff F] [--heads A] [--kv-heads B]
                              [--vocab V] [--seed S]
Defaults are Llama-3-8B's shape (32 layers, 4096, 14336, 32/8 heads, 128256 tokens).
Needs only numpy.
"""
import argparse
import json
import struct
from pathlib import Path

import numpy as np

LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def bf16(rng, shape, std):
    """Random N(0, std) values as BF16 bits (truncated f32), generated in chunks."""
    n = int(np.prod(shape))
    out = np.empty(n, dtype=np.uint16)
    for i in range(0, n, 1 << 24):
        x = rng.standard_normal(min(1 << 24, n - i), dtype=np.float32) * np.float32(std)
        out[i:i + len(x)] = (x.view(np.uint32) >> 16).astype(np.uint16)
    return out


def save(path, tensors):
    header, offset = {}, 0
    for name, (shape, data) in tensors.items():
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for _, data in tensors.values():
            data.tofile(f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ff", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    hd = a.hidden // a.heads
    weight_map = {}

    def shard(name, tensors):
        save(d / name, tensors)
        weight_map.update({t: name for t in tensors})

    shard("model-embed.safetensors", {"model.embed_tokens.weight": ((a.vocab, a.hidden), bf16(rng, (a.vocab, a.hidden), 0.02))})
    for l in range(a.layers):
        pre = f"model.layers.{l}."
        shapes = {
            "input_layernorm.weight": (a.hidden,),
            "self_attn.q_proj.weight": (a.heads * hd, a.hidden),
            "self_attn.k_proj.weight": (a.kv_heads * hd, a.hidden),
            "self_attn.v_proj.weight": (a.kv_heads * hd, a.hidden),
            "self_attn.o_proj.weight": (a.hidden, a.heads * hd),
            "post_attention_layernorm.weight": (a.hidden,),
            "mlp.gate_proj.weight": (a.ff, a.hidden),
            "mlp.up_proj.weight": (a.ff, a.hidden),
            "mlp.down_proj.weight": (a.hidden, a.ff),
        }
        shard(f"model-layer{l:03d}.safetensors",
              {pre + n: (s, bf16(rng, s, 1.0 if "norm" in n else 0.02)) for n, s in shapes.items()})
    shard("model-head.safetensors", {
        "model.norm.weight": ((a.hidden,), bf16(rng, (a.hidden,), 1.0)),
        "lm_head.weight": ((a.vocab, a.hidden), bf16(rng, (a.vocab, a.hidden), 0.02)),
    })
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": a.hidden, "intermediate_size": a.ff,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "num_hidden_layers": a.layers,
        "vocab_size": a.vocab, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    }
    (d / "config.json").write_text(json.dumps(config, indent=1))
    letters = "abcdefghijklmnopqrstuvwxyz"
    tokenizer = {
        "added_tokens": [{"id": 0, "content": "<|begin_of_text|>", "special": True},
                         {"id": 1, "content": "<|end_of_text|>", "special": True}],
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "model": {"type": "BPE", "vocab": {c: i + 2 for i, c in enumerate(letters)}, "merges": ["a b"]},
    }
    (d / "tokenizer.json").write_text(json.dumps(tokenizer))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True}))


if __name__ == "__main__":
    main()
