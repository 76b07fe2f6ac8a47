#!/usr/bin/env python3
"""llama.cpp's generation speed after DEPTH tokens in the cache (llama-bench's `-d`),
through llama-cpp-python: DEPTH random tokens are evaluated once (untimed), then each
repetition times N single-token steps and truncates the cache back to DEPTH, as
`kestrel bench -d DEPTH -p 0 -n N` does. One untimed warm-up repetition first.

usage: tg_depth_llamacpp.py MODEL DEPTH N REPS TYPE   (TYPE: f16, q8_0, q4_0, bf16)
"""
import random
import statistics
import sys
import time

import llama_cpp

GGML = {"f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}

model, depth, n, reps, name = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
t = GGML[name]
llm = llama_cpp.Llama(model_path=model, n_ctx=depth + n + 16, n_batch=512, n_threads=2,
                      flash_attn=True, type_k=t, type_v=t, verbose=False)
rng = random.Random(1)
vocab = llm.n_vocab()
llm.eval([rng.randrange(vocab) for _ in range(depth)])
rates = []
for rep in range(reps + 1):
    llm.n_tokens = depth  # the next eval drops the cache beyond DEPTH
    ids = [rng.randrange(vocab) for _ in range(n)]
    start = time.perf_counter()
    for tok in ids:
        llm.eval([tok])
    secs = time.perf_counter() - start
    if rep > 0:
        rates.append(n / secs)
print(f"llama.cpp tg{n} @ d{depth} ({name} cache): {statistics.mean(rates):.2f} t/s "
      f"(runs: {', '.join(f'{r:.2f}' for r in rates)})", flush=True)
