#!/usr/bin/env python3
"""Time llama.cpp through llama-cpp-python the way `kestrel bench` times Kestrel.

ppN: N random token ids evaluated as one batch from an empty cache.
tgN: N single-token evaluations from an empty cache.
One untimed warm-up per test, then REPS timed repetitions; prints mean ± stddev tok/s.

usage: bench_llamacpp.py MODEL.gguf [--threads 2] [-p 128] [-n 64] [-r 3] [--json]
"""
import argparse
import json
import random
import statistics
import time

import llama_cpp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("-p", type=int, default=128)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    llm = llama_cpp.Llama(
        model_path=a.model,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        n_ctx=max(512, a.p + a.n + 8),
        n_batch=max(512, a.p),
        verbose=False,
    )
    rng = random.Random(1234)
    vocab = llm.n_vocab()

    def once(n_prompt, n_gen):
        llm.reset()
        prompt = [rng.randrange(vocab) for _ in range(n_prompt)]
        gen = [rng.randrange(vocab) for _ in range(n_gen)]
        t0 = time.perf_counter()
        if prompt:
            llm.eval(prompt)
        for tok in gen:
            llm.eval([tok])
        return time.perf_counter() - t0

    rows = []
    for n_prompt, n_gen in [(a.p, 0), (0, a.n)]:
        if n_prompt + n_gen == 0:
            continue
        once(n_prompt, n_gen)
        ts = [(n_prompt + n_gen) / once(n_prompt, n_gen) for _ in range(a.r)]
        sd = statistics.stdev(ts) if len(ts) > 1 else 0.0
        rows.append({"n_prompt": n_prompt, "n_gen": n_gen, "n_threads": a.threads,
                     "avg_ts": statistics.mean(ts), "stddev_ts": sd, "samples_ts": ts,
                     "backends": "CPU", "engine": "llama-cpp-python " + llama_cpp.__version__})
    if a.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
            print(f"llama.cpp {test}: {r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} t/s ({a.threads} threads)")


if __name__ == "__main__":
    main()
