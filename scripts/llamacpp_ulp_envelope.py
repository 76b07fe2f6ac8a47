#!/usr/bin/env python3
"""How far llama.cpp moves from its own reference when one tensor moves by a unit in the
last place: the sensitivity of a model under llama.cpp's CPU numerics (8-bit activations).

The reference (../shared/reference/*.llamacpp.json) is llama.cpp (llama-cpp-python 0.3.36,
CPU) scoring each 512-token text in one batch. This script runs the same build the same
way, but through ggml's graph callback multiplies one tensor of the first layer — its
normalized input, `attn_norm-0` — by (1 + u), u uniform in ±1.2e-7 (about one f32 unit in
the last place), and scores the texts as scripts/llamacpp_envelope.py does: top-1 agreement,
mean |Δ log-prob| over the reference's top-16, perplexity error, largest top-1 gap.
Any second implementation differs from llama.cpp by at least this much in every tensor
(another order of additions), so this is the floor of agreement with llama.cpp that no
implementation below bit-identity can beat. A run without the perturbation must reproduce
the reference (checked).

With `--embeddings`: Gemma-3-270M's last-token, L2-normalized embeddings
(`Llama(embedding=True).embed`, what crates/kestrel-server/tests/embeddings_client.py
compares) of six random texts from that test's word list, the lowest cosine between each
vector and its perturbed versions.

usage: python3 scripts/llamacpp_ulp_envelope.py [SEEDS]   (default 3; ~3 min on 2 cores)
       python3 scripts/llamacpp_ulp_envelope.py --embeddings [TEXT_SEED]
needs: pip install llama-cpp-python==0.3.36 numpy; the two models (`kestrel pull`)
"""
import ctypes
import json
import os
import sys

import numpy as np
import llama_cpp.llama_cpp as LL

HERE = os.path.dirname(os.path.abspath(__file__))
REF = os.path.join(HERE, '..', '..', 'shared', 'reference')
HOME = os.environ.get('KESTREL_HOME', os.path.expanduser('~/.cache/kestrel'))
MODELS = ['gemma-3-270m', 'qwen2.5-coder-1.5b']
TARGET = b'attn_norm-0'
EPS = 1.2e-7


class Tensor(ctypes.Structure):
    """The head of ggml's `struct ggml_tensor` (ggml.h), up to its name."""
    _fields_ = [('type', ctypes.c_int), ('buffer', ctypes.c_void_p),
                ('ne', ctypes.c_int64 * 4), ('nb', ctypes.c_size_t * 4),
                ('op', ctypes.c_int), ('op_params', ctypes.c_int32 * 16),
                ('flags', ctypes.c_int32), ('src', ctypes.c_void_p * 10),
                ('view_src', ctypes.c_void_p), ('view_offs', ctypes.c_size_t),
                ('data', ctypes.c_void_p), ('name', ctypes.c_char * 64)]


state = {'rng': None, 'hits': 0}


def callback(t, ask, _user):
    tt = ctypes.cast(t, ctypes.POINTER(Tensor)).contents
    if ask:
        return state['rng'] is not None and tt.name == TARGET
    ne = list(tt.ne)
    n = ne[0] * ne[1] * ne[2] * ne[3]
    # f32 and contiguous, as ggml's rms_norm · weight product is.
    assert tt.type == 0 and tt.nb[1] == 4 * ne[0], 'unexpected tensor layout'
    a = np.ctypeslib.as_array(ctypes.cast(tt.data, ctypes.POINTER(ctypes.c_float)), shape=(n,))
    a *= (1 + state['rng'].uniform(-EPS, EPS, n)).astype(np.float32)
    state['hits'] += 1
    return True


CALLBACK = LL.ggml_backend_sched_eval_callback(callback)
_default_params = LL.llama_context_default_params


def _params():
    p = _default_params()
    p.cb_eval = CALLBACK
    return p


LL.llama_context_default_params = _params
from llama_cpp import Llama  # noqa: E402  (after the hook)
from llamacpp_envelope import log_softmax, score  # noqa: E402  (the same scoring)


WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which "
    "this be or has had not but their one two new first after also who they its been "
    "river kestrel falcon hovered above 1987 42 3.14 café naïve 東京 Ελλάδα 🦅 "
    "def fn() => {x: [1, 2]} // # ; -- ... !? \"quoted\" (paren) snake_case CamelCase"
).split()


def embeddings(text_seed):
    import random
    llm = Llama(os.path.join(HOME, 'models', 'gemma-3-270m.gguf'), n_ctx=512, n_threads=2,
                n_batch=512, n_ubatch=512, embedding=True, pooling_type=3, verbose=False)
    rng, lowest = random.Random(text_seed), 1.0
    for _ in range(6):
        text = ' '.join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
        state['rng'] = None
        a = np.asarray(llm.embed(text, normalize=True), np.float64).reshape(-1)
        cos = []
        for seed in range(3):
            state['rng'], state['hits'] = np.random.default_rng(seed), 0
            b = np.asarray(llm.embed(text, normalize=True), np.float64).reshape(-1)
            assert state['hits'] == 1, f'{TARGET} seen {state["hits"]} times'
            cos.append(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)))
        lowest = min(lowest, min(cos))
        print(f'{len(text.split())} words: cosines', ' '.join(f'{c:.5f}' for c in cos), flush=True)
    print(f'lowest cosine {lowest:.5f}')


def main():
    if sys.argv[1:2] == ['--embeddings']:
        embeddings(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
        return
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for model in MODELS:
        ref = json.load(open(os.path.join(REF, f'{model}-q4_k_m.llamacpp.json')))
        llm = Llama(os.path.join(HOME, 'models', model + '.gguf'), n_ctx=1024, n_threads=2,
                    n_batch=512, n_ubatch=512, logits_all=True, verbose=False)
        for name, text in ref['texts'].items():
            state['rng'] = None
            s = score(llm, text)
            assert s['max_abs_logprob_diff'] < 1e-4, f'{model} {name}: no reproduction ({s})'
            for seed in range(seeds):
                state['rng'], state['hits'] = np.random.default_rng(seed), 0
                s = score(llm, text)
                assert state['hits'] == 1, f'{TARGET} seen {state["hits"]} times'
                print(model, name, f'seed {seed}:', ' '.join(
                    f'{k} {v:.4f}' if isinstance(v, float) else f'{k} {v}' for k, v in s.items()),
                    flush=True)
        del llm


if __name__ == '__main__':
    main()
