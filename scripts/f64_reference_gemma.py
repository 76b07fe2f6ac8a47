#!/usr/bin/env python3
"""Exact (float64) forward pass of a Gemma 3 GGUF over a sequence of token ids: the oracle
of crates/kestrel-engine/tests/gemma_exact.rs, independent of llama.cpp and of Kestrel.

Written from Hugging Face's Gemma 3 definition, on gguf-py's dequantized weights: embeddings
times sqrt(n_embd); RMSNorm (the GGUF's norm weights already hold transformers' 1 + w);
Q/K norms per head; NeoX RoPE with base 10,000 on the sliding-window layers and the file's
base (and linear scaling, where the file states one) on every sixth, global, layer; queries
times 1/sqrt(query_pre_attn_scalar, or the head size); causal attention over at most
`sliding_window` keys (distance < window) on the local layers; post-attention and post-FFN
norms; GELU with the tanh approximation. Everything in f64 except the cached keys and
values, which are rounded to f16 as both engines' default caches hold them (KV16=0: not).

Writes, for the chosen positions, the 16 most likely next tokens after ids[0..=i] and their
log-softmax (the schema of ../shared/reference/*.llamacpp.json's `positions`).

usage: python3 scripts/f64_reference_gemma.py MODEL.gguf IDS.json OUT.json [EVERY]
       (positions 0, EVERY, 2·EVERY, ... and the last 64; EVERY defaults to 1)
needs: pip install gguf numpy   (~30 s for 600 ids on 2 cores)
"""
import json
import os
import sys

import gguf
import numpy as np

model, ids_path, out_path = sys.argv[1:4]
every = int(sys.argv[4]) if len(sys.argv) > 4 else 1
ids = np.asarray(json.load(open(ids_path)), np.int64)
n = len(ids)
kv16 = os.environ.get('KV16', '1') != '0'

r = gguf.GGUFReader(model)
T = {t.name: t for t in r.tensors}


def meta(key, default=None):
    f = r.fields.get(key)
    return default if f is None else f.contents()


arch = meta('general.architecture')
if arch != 'gemma3':
    sys.exit(f'{model}: architecture {arch!r}, not gemma3')
d = meta('gemma3.embedding_length')
n_layer = meta('gemma3.block_count')
n_head = meta('gemma3.attention.head_count')
n_kv = meta('gemma3.attention.head_count_kv', n_head)
hd = meta('gemma3.attention.key_length', d // n_head)
eps = meta('gemma3.attention.layer_norm_rms_epsilon')
base = meta('gemma3.rope.freq_base', 10000.0)
window = meta('gemma3.attention.sliding_window')
scalar = meta('gemma3.attention.query_pre_attn_scalar', hd)
scaling = meta('gemma3.rope.scaling.type')
factor = meta('gemma3.rope.scaling.factor', 1.0) if scaling is not None else 1.0
if scaling not in (None, 'linear', 'none'):
    sys.exit(f'rope scaling {scaling!r} is not covered here')


def weight(name):
    t = T[name]
    a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
    return a.reshape([int(x) for x in reversed(t.shape)]) if len(t.shape) > 1 else a.reshape(-1)


def rms(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(v, b, scale):
    half = hd // 2
    theta = (np.arange(n)[:, None] / scale) * b ** (-2.0 * np.arange(half) / hd)
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = v[..., :half], v[..., half:]
    return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], -1)


def f16(a):
    return a.astype(np.float16).astype(np.float64) if kv16 else a


def gelu_tanh(v):
    return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))


emb = T['token_embd.weight']
table = gguf.quants.dequantize(emb.data, emb.tensor_type).reshape(-1, d)
x = table[ids].astype(np.float64) * np.sqrt(d)
dist = np.arange(n)[:, None] - np.arange(n)[None, :]
for il in range(n_layer):
    p = f'blk.{il}.'
    local = window is not None and (il + 1) % 6 != 0
    h = rms(x, weight(p + 'attn_norm.weight'))
    q = (h @ weight(p + 'attn_q.weight').T).reshape(n, n_head, hd)
    k = (h @ weight(p + 'attn_k.weight').T).reshape(n, n_kv, hd)
    v = (h @ weight(p + 'attn_v.weight').T).reshape(n, n_kv, hd)
    q = rms(q, weight(p + 'attn_q_norm.weight'))
    k = rms(k, weight(p + 'attn_k_norm.weight'))
    b, scale = (10000.0, 1.0) if local else (base, factor)
    q = rope(q, b, scale) / np.sqrt(scalar)
    k, v = f16(rope(k, b, scale)), f16(v)
    allowed = (dist >= 0) & (dist < window if local else True)
    att = np.empty((n, n_head, hd))
    for head in range(n_head):
        g = head // (n_head // n_kv)
        s = np.where(allowed, q[:, head] @ k[:, g].T, -np.inf)
        e = np.exp(s - s.max(1, keepdims=True))
        att[:, head] = (e / e.sum(1, keepdims=True)) @ v[:, g]
    o = att.reshape(n, -1) @ weight(p + 'attn_output.weight').T
    x = x + rms(o, weight(p + 'post_attention_norm.weight'))
    h = rms(x, weight(p + 'ffn_norm.weight'))
    f = gelu_tanh(h @ weight(p + 'ffn_gate.weight').T) * (h @ weight(p + 'ffn_up.weight').T)
    x = x + rms(f @ weight(p + 'ffn_down.weight').T, weight(p + 'post_ffw_norm.weight'))

wanted = sorted(set(range(0, n, every)) | set(range(max(0, n - 64), n)))
h = rms(x[wanted], weight('output_norm.weight'))
head = weight('output.weight') if 'output.weight' in T else table
out = []
for c in range(0, len(wanted), 32):
    logits = h[c:c + 32] @ head.T.astype(np.float64)
    m = logits.max(1, keepdims=True)
    lp = logits - (m + np.log(np.exp(logits - m).sum(1, keepdims=True)))
    top = np.argsort(-lp, 1)[:, :16]
    for i, row in enumerate(lp):
        out.append({'pos': wanted[c + i], 'top_ids': top[i].tolist(),
                    'top_logprobs': row[top[i]].tolist()})
json.dump({'model': os.path.basename(model), 'n': n, 'positions': out}, open(out_path, 'w'))
