#!/usr/bin/env python3
"""llama.cpp's log-probs on the tiny synthetic models of the newer architectures (Qwen3-MoE,
gpt-oss, Phi-3, Mistral 3; with `hybrid`, the linear-attention hybrids Qwen3-Next, Qwen3.5
and Qwen3.5-MoE), and its own spread.

For each (architecture, weight type) below, `kestrel synth --arch A --preset tiny --type T
--seed S`
writes a model (the bytes depend only on the seed; their FNV-1a hash is recorded so the
test can tell when synth changed and this must be rerun). llama.cpp (llama-cpp-python
0.3.36, CPU) evaluates a fixed sequence of token ids in one batch: the top log-probs of
each position are the reference. It then evaluates the same ids in batches of 1, 2 and 5
tokens (other kernels, other orders of additions) and records how far those runs are
from its own reference (top-1 agreement, mean |Δ log-prob| over the reference's top
tokens): the spread any second evaluation shows, which the test
(crates/kestrel-engine/tests/arch_fidelity.rs) holds Kestrel to.

usage: python3 scripts/tiny_archs_reference.py [KESTREL_BIN] [OUT.json] [hybrid]
  defaults: target/release/kestrel, crates/kestrel-engine/tests/data/tiny_archs.llamacpp.json
  (hybrid: the hybrids' cases, default output .../hybrid_archs.llamacpp.json)
needs: pip install llama-cpp-python==0.3.36 numpy  (~1 min on 2 cores)
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from llama_cpp import Llama

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, '..')
CASES = [('qwen3moe', t) for t in ['q8_0', 'q4_k_m', 'iq4_nl', 'iq4_xs', 'mxfp4']] + [
    ('gpt-oss', t) for t in ['q8_0', 'mxfp4']] + [('phi3', 'q4_k_m'), ('mistral3', 'q4_k_m')]
# (Q8_0 files of the hybrids are not among them yet: there Kestrel departs from llama.cpp
# by 0.02-0.06 mean |Δ| on some seeds, exactly up to one position and a step after it,
# which is not explained; see crates/kestrel-engine/tests/arch_fidelity.rs.)
HYBRID_CASES = [('qwen3next', 'f16'), ('qwen3next', 'q4_k_m'), ('qwen35', 'q4_k_m'),
                ('qwen35moe', 'q4_k_m')]
SEED = 29
N_IDS = 64
TOP = 8
BATCHES = [1, 2, 5]


def fnv1a(data: bytes) -> str:
    h = 0xcbf29ce484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f'{h:016x}'


def log_softmax(rows):
    rows = np.asarray(rows, np.float64)
    rows = rows - rows.max(1, keepdims=True)
    return rows - np.log(np.exp(rows).sum(1, keepdims=True))


def evaluate(path, ids, n_batch):
    llm = Llama(path, n_ctx=256, n_threads=2, n_batch=n_batch, n_ubatch=n_batch,
                logits_all=True, verbose=False)
    llm.eval(ids)
    lp = log_softmax(llm.scores[:len(ids)])
    del llm
    return lp


def spread(lp, ref):
    agree, diffs = 0, []
    for i, pos in enumerate(ref):
        diffs += [abs(lp[i][t] - l) for t, l in zip(pos['top_ids'], pos['top_logprobs'])]
        agree += int(np.argmax(lp[i]) == pos['top_ids'][0])
    return {'top1_agreement': agree / len(ref), 'mean_abs_logprob_diff': float(np.mean(diffs))}


def main():
    hybrid = len(sys.argv) > 3 and sys.argv[3] == 'hybrid'
    kestrel = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, 'target/release/kestrel')
    name = 'hybrid_archs' if hybrid else 'tiny_archs'
    out = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != '-' else os.path.join(
        ROOT, f'crates/kestrel-engine/tests/data/{name}.llamacpp.json')
    seed = SEED
    ids = [int(t) for t in np.random.RandomState(seed).randint(0, 512, N_IDS)]
    result = {'seed': seed, 'ids': ids, 'top': TOP, 'models': {}}
    with tempfile.TemporaryDirectory() as tmp:
        for arch, ty in (HYBRID_CASES if hybrid else CASES):
            path = os.path.join(tmp, f'{arch}-{ty}.gguf')
            subprocess.run([kestrel, 'synth', '--arch', arch, '--preset', 'tiny',
                            '--type', ty, '--seed', str(seed), '-o', path], check=True,
                           capture_output=True)
            with open(path, 'rb') as f:
                digest = fnv1a(f.read())
            lp = evaluate(path, ids, N_IDS)
            ref = []
            for row in lp[:-1]:
                top = np.argsort(-row, kind='stable')[:TOP]
                ref.append({'top_ids': [int(t) for t in top],
                            'top_logprobs': [float(row[t]) for t in top]})
            runs = {f'batch{b}': spread(evaluate(path, ids, b), ref) for b in BATCHES}
            worst = {
                'top1_agreement': min(r['top1_agreement'] for r in runs.values()),
                'mean_abs_logprob_diff': max(r['mean_abs_logprob_diff'] for r in runs.values()),
            }
            # How peaked the predictions are: a flat model would make top-1 meaningless.
            top1_p = float(np.mean(np.exp(lp[:-1].max(1))))
            print(f'{arch} {ty}: llama.cpp spread {worst}, mean top-1 probability {top1_p:.3f}')
            result['models'][f'{arch}/{ty}'] = {'fnv1a': digest, 'positions': ref, 'spread': runs,
                                    'worst': worst, 'mean_top1_prob': top1_p}
    with open(out, 'w') as f:
        json.dump(result, f, indent=None, separators=(',', ':'))
        f.write('\n')
    print('wrote', out)


if __name__ == '__main__':
    main()
