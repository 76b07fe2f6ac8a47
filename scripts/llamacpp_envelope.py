#!/usr/bin/env python3
"""How far llama.cpp is from its own reference output when only its batch size changes.

The reference data (../shared/reference/*.llamacpp.json) was produced by llama.cpp
(llama-cpp-python 0.3.36, CPU) evaluating each 512-token text in one batch. This script
runs the same llama.cpp build on the same files, first with that batch size (which must
reproduce the reference to its printed precision: a check that this machine and build are
the reference's), then with batches of 1, 2 and 5 tokens (from 8 tokens up llama.cpp's CPU
path computes exactly as with 512; below, other kernels sum in other orders). It reports
the issue's fidelity measures of each of those runs against the reference: top-1
agreement, mean |Δ log-prob| over the reference's top-16, perplexity error, the largest
gap between llama.cpp's own top-1 and the reference's top-1 (and how many positions have
one over 0.25), and how many leading greedy tokens equal the reference's; and per text the
worst of each over the three runs.

That is the spread any second evaluation of these models shows, llama.cpp's included; the
fidelity test (crates/kestrel-engine/tests/fidelity.rs) holds Kestrel to it. Writes JSON.

usage: python3 scripts/llamacpp_envelope.py [OUT.json]    (~10 min on 2 cores)
needs: pip install llama-cpp-python==0.3.36 numpy; the two models (`kestrel pull`)
"""
import json
import os
import sys

import numpy as np
from llama_cpp import Llama

HERE = os.path.dirname(os.path.abspath(__file__))
REF = os.path.join(HERE, '..', '..', 'shared', 'reference')
HOME = os.environ.get('KESTREL_HOME', os.path.expanduser('~/.cache/kestrel'))
MODELS = ['gemma-3-270m', 'qwen2.5-coder-1.5b']
BATCHES = [1, 2, 5]


def log_softmax(rows):
    rows = np.asarray(rows, np.float64)
    rows = rows - rows.max(1, keepdims=True)
    return rows - np.log(np.exp(rows).sum(1, keepdims=True))


def load(model, n_batch):
    return Llama(os.path.join(HOME, 'models', model + '.gguf'), n_ctx=1024, n_threads=2,
                 n_batch=n_batch, n_ubatch=n_batch, logits_all=True, verbose=False)


def score(llm, text):
    ids = text['ids']
    llm.reset()
    llm.eval(ids)
    lp = log_softmax(llm.scores[:len(ids)])
    agree, diffs, gaps, nll = 0, [], [], []
    for i, pos in enumerate(text['positions']):
        top = pos['top_ids']
        diffs += [abs(lp[i][t] - l) for t, l in zip(top, pos['top_logprobs'])]
        agree += int(np.argmax(lp[i]) == top[0])
        if i > 0:
            gaps.append(lp[i].max() - lp[i][top[0]])
        nll.append(-lp[i][ids[i + 1]])
    ppl = float(np.exp(np.mean(nll)))
    return {
        'top1_agreement': agree / len(text['positions']),
        'mean_abs_logprob_diff': float(np.mean(diffs)),
        'max_abs_logprob_diff': float(np.max(diffs)),
        'ppl': ppl,
        'ppl_rel_err': abs(ppl - text['ppl']) / text['ppl'],
        'largest_top1_gap': float(np.max(gaps)),
        'top1_gaps_over_0.25': int(np.sum(np.array(gaps) > 0.25)),
    }


def greedy(llm, case):
    llm.reset()
    llm.eval(case['prompt_ids'])
    out = []
    for _ in range(len(case['greedy_ids'])):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        llm.eval([tok])
    same = 0
    for a, b in zip(out, case['greedy_ids']):
        if a != b:
            break
        same += 1
    return same


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    result = {'engine': 'llama.cpp (llama-cpp-python 0.3.36, CPU, 2 threads)',
              'note': 'runs with n_batch 1, 2, 5 measured against the n_batch=512 reference',
              'models': {}}
    for model in MODELS:
        ref = json.load(open(os.path.join(REF, f'{model}-q4_k_m.llamacpp.json')))
        same = load(model, 512)
        for name, text in ref['texts'].items():
            s = score(same, text)
            assert s['max_abs_logprob_diff'] < 1e-4, f'{model} {name}: this llama.cpp does not reproduce the reference ({s})'
        del same
        runs = {}
        for n_batch in BATCHES:
            llm = load(model, n_batch)
            run = {'texts': {}}
            for name, text in ref['texts'].items():
                run['texts'][name] = score(llm, text)
                print(model, n_batch, name, run['texts'][name], flush=True)
            run['greedy_leading_equal'] = [greedy(llm, c) for c in ref['greedy']]
            print(model, n_batch, 'greedy', run['greedy_leading_equal'], flush=True)
            runs[str(n_batch)] = run
            del llm
        worst = {}
        for name in ref['texts']:
            per = [r['texts'][name] for r in runs.values()]
            worst[name] = {
                'top1_agreement': min(p['top1_agreement'] for p in per),
                'mean_abs_logprob_diff': max(p['mean_abs_logprob_diff'] for p in per),
                'ppl_rel_err': max(p['ppl_rel_err'] for p in per),
                'largest_top1_gap': max(p['largest_top1_gap'] for p in per),
                'top1_gaps_over_0.25': max(p['top1_gaps_over_0.25'] for p in per),
            }
        result['models'][model] = {
            'runs_by_n_batch': runs,
            'worst': worst,
            'greedy_leading_equal_total_min': min(sum(r['greedy_leading_equal']) for r in runs.values()),
        }
    text = json.dumps(result, indent=1)
    if out_path:
        open(out_path, 'w').write(text + '\n')
    else:
        print(text)


if __name__ == '__main__':
    main()
