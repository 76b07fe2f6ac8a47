#!/usr/bin/env python3
"""The code-edit workload on llama-cpp-python, for comparison with `kestrel bench --prompts`:
greedy, the same prompts and token budget, with or without llama-cpp-python's prompt-lookup
drafter (LlamaPromptLookupDecoding). Prints one JSON object with the same totals as
Kestrel's (generation tokens/s from the first generated token to the last).

python3 bench_llama_cpp.py MODEL.gguf code_edits.jsonl [-n 128] [--lookup] [--threads 2]
"""

import argparse
import json
import time

from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("prompts")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--lookup", action="store_true")
    ap.add_argument("--num-pred-tokens", type=int, default=10)
    ap.add_argument("--max-ngram-size", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    draft = (
        LlamaPromptLookupDecoding(
            max_ngram_size=a.max_ngram_size, num_pred_tokens=a.num_pred_tokens
        )
        if a.lookup
        else None
    )
    llm = Llama(
        a.model,
        n_ctx=4096,
        n_threads=a.threads,
        n_batch=256,
        draft_model=draft,
        # llama-cpp-python verifies drafts from the logits of every position.
        logits_all=a.lookup,
        verbose=False,
    )
    tasks = [json.loads(line) for line in open(a.prompts) if line.strip()]
    # End of generation as Kestrel's tokenizer sees it for ChatML models.
    eog = {llm.token_eos()}
    for text in (b"<|im_end|>", b"<|endoftext|>"):
        eog.update(llm.tokenize(text, add_bos=False, special=True))
    total = {"prompt_tokens": 0, "prompt_s": 0.0, "gen_tokens": 0, "gen_s": 0.0, "runs": 0}
    for task in tasks:
        ids = llm.tokenize(task["prompt"].encode(), add_bos=False, special=True)
        start = time.perf_counter()
        first = None
        n = 0
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            now = time.perf_counter()
            first = first or now
            n += 1
            if token in eog or n == a.n:
                break
        end = time.perf_counter()
        total["prompt_tokens"] += len(ids)
        total["prompt_s"] += first - start
        total["gen_tokens"] += n
        total["gen_s"] += end - first
        total["runs"] += 1
        print(json.dumps({"name": task["name"], "gen_tokens": n, "gen_s": end - first}), flush=True)
    total["gen_ts"] = (total["gen_tokens"] - total["runs"]) / total["gen_s"]
    total["lookup"] = a.lookup
    print(json.dumps({"total": total}))


if __name__ == "__main__":
    main()
