#!/usr/bin/env python3
"""llama.cpp's perplexity of a text's first window with the KV cache in each given type
(through llama-cpp-python; flash attention on, which llama.cpp needs for a quantized V
cache), scored as `kestrel perplexity` scores it: every position predicts the next token.

usage: kv_ppl_llamacpp.py MODEL TEXT WINDOW TYPE [TYPE...]   (TYPE: f16, q8_0, q4_0, bf16)
"""
import math
import sys

import llama_cpp
import numpy as np

GGML = {"f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}

model, text, window = sys.argv[1], sys.argv[2], int(sys.argv[3])
for name in sys.argv[4:]:
    t = GGML[name]
    llm = llama_cpp.Llama(model_path=model, n_ctx=window, n_batch=512, n_threads=2,
                          logits_all=True, flash_attn=True, type_k=t, type_v=t, verbose=False)
    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
    ids = llm.tokenize(open(text, "rb").read(), add_bos=add_bos, special=False)[:window]
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
    m = logits.max(axis=1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
    nll = -logp[np.arange(len(ids) - 1), ids[1:]].mean()
    print(f"{name}: perplexity over {len(ids)} tokens: {math.exp(nll):.4f}", flush=True)
    del llm
