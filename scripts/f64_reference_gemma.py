#!/usr/bin/env python3
"""Exact (float64) forward pass of Gemma-3-270M at position 0, from gguf-py's dequantized
weights: the oracle behind the fidelity note in crates/kestrel-engine/tests/fidelity.rs.

Prints llama.cpp's reference top-8 log-probs after the first token (BOS) next to the exact
ones. Kestrel (f32) agrees with the exact values to ~1e-4; llama.cpp differs by up to 0.2
because its CPU path rounds activations to 8 bits. Set MODE=q8 to emulate that rounding.

usage: python3 scripts/f64_reference_gemma.py [MODEL.gguf] [REFERENCE_DIR]   (~1 min)
"""
import gguf, numpy as np, json, os, sys
home = os.environ.get('KESTREL_HOME', os.path.expanduser('~/.cache/kestrel'))
model = sys.argv[1] if len(sys.argv) > 1 else os.path.join(home, 'models', 'gemma-3-270m.gguf')
refdir = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'reference')
r = gguf.GGUFReader(model)
T = {t.name: t for t in r.tensors}
def W(name):
    t = T[name]
    a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
    return a.reshape([int(x) for x in reversed(t.shape)]) if len(t.shape) > 1 else a.reshape(-1)
d=640; nh=4; hd=256; eps=1e-6
def rms(x, w): return x / np.sqrt((x*x).mean() + eps) * w
emb = T['token_embd.weight']
# dequantize only row 2 (BOS)
row_bytes = 640//32*34
raw = np.array(emb.data).reshape(-1)
x = gguf.quants.dequantize(raw[2*row_bytes:3*row_bytes].reshape(1,-1) if raw.ndim==1 else emb.data[2:3], emb.tensor_type).astype(np.float64).reshape(-1)
x = x * np.sqrt(d)
MODE=os.environ.get('MODE','')
def q8_0(x):
    x=x.astype(np.float32).reshape(-1,32)
    amax=np.abs(x).max(1,keepdims=True); d=amax/127; idd=np.where(d>0,1/np.where(d>0,d,1),0)
    q=np.round(x*idd)  # numpy round half even; close enough
    d16=d.astype(np.float16).astype(np.float64)
    return (q*d16).reshape(-1)
def q8_k(x):
    x=x.astype(np.float32).reshape(-1,256); out=[]
    for b in x:
        i=np.argmax(np.abs(b)); mx=b[i]
        isc=np.float32(-127.0)/mx if mx!=0 else 0
        q=np.clip(np.round(isc*b),-128,127)
        out.append(q*(np.float32(1)/isc) if mx!=0 else q*0)
    return np.concatenate(out).astype(np.float64)
def mm(name, h):
    t=T[name]; w=W(name)
    if 'q8' in MODE:
        tt=t.tensor_type.name
        if tt in ('Q5_0','Q8_0','Q4_0'): h=q8_0(h)
        elif tt in ('Q4_K','Q6_K'): h=q8_k(h)
    return w@h
def gelu16(v):
    if 'g16' not in MODE: return gelu(v)
    x16=v.astype(np.float16).astype(np.float64)
    r=gelu(x16).astype(np.float16).astype(np.float64)
    return np.where(v<=-10,0,np.where(v>=10,v,r))
def gelu(v): return 0.5*v*(1+np.tanh(0.7978845608*(v+0.044715*v**3)))
for il in range(18):
    p=f'blk.{il}.'
    h = rms(x, W(p+'attn_norm.weight'))
    v = mm(p+'attn_v.weight', h)   # [256]
    # single position: attention output = v for each head (kv heads=1)
    att = np.tile(v, nh)
    o = mm(p+'attn_output.weight', att)
    o = rms(o, W(p+'post_attention_norm.weight'))
    x = x + o
    h = rms(x, W(p+'ffn_norm.weight'))
    g = mm(p+'ffn_gate.weight', h); u = mm(p+'ffn_up.weight', h)
    f = mm(p+'ffn_down.weight', gelu16(g)*u)
    f = rms(f, W(p+'post_ffw_norm.weight'))
    x = x + f
h = rms(x, W('output_norm.weight'))
E = gguf.quants.dequantize(emb.data, emb.tensor_type).astype(np.float64).reshape(-1, d)
logits = E @ (q8_0(h) if 'q8' in MODE else h)
m = logits.max(); lp = logits - (m + np.log(np.exp(logits-m).sum()))
ref = json.load(open(os.path.join(refdir, 'gemma-3-270m-q4_k_m.llamacpp.json')))
p0 = ref['texts']['gpl3']['positions'][0]
print('ids', ref['texts']['gpl3']['ids'][:3])
print('theirs', list(zip(p0['top_ids'][:8], p0['top_logprobs'][:8])))
print('f64, 8-bit activations' if 'q8' in MODE else 'f64   ', [(i, round(lp[i],5)) for i in p0['top_ids'][:8]])
