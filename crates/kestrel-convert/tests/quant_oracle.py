#!/usr/bin/env python3
"""Oracles for kestrel-convert's quantize tests: llama.cpp's gguf-py and llama-quantize.

Commands (print one JSON object on stdout):
  gguf-py IN OUT              requantize, with gguf.quants, every tensor of IN whose type OUT
                              changed to one gguf-py can quantize; report which differ from OUT
  llama-quantize IN OUT FTYPE run llama.cpp's quantizer (llama_cpp.llama_model_quantize, the
                              code of llama-quantize) with LLAMA_FTYPE id FTYPE; exits 3 with
                              a notice when llama_cpp is not importable
  llama-quantize IN OUT FTYPE IMATRIX
                              the same with an importance matrix (GGUF or legacy .dat), read
                              and normalized here as llama.cpp's imatrix-loader.cpp and
                              llama-quantize's load_imatrix do, passed as params.imatrix
  compare IN OURS THEIRS      per tensor: both types, whether the bytes are equal, and the
                              x^2-weighted RMS error of each file against IN's values
"""
import ctypes
import json
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, quants

# Types gguf.quants can quantize (its K-quants only dequantize).
PY_QUANTIZABLE = {T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}


def tensors(path):
    return {t.name: t for t in GGUFReader(path).tensors}


def values(t):
    """A tensor's values as f32 rows (row length = ne0)."""
    ne0 = int(t.shape[0])
    return quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(-1, ne0).astype(np.float32)


def raw(t):
    return np.ascontiguousarray(t.data).view(np.uint8).tobytes()


def gguf_py(inp, out):
    src, dst = tensors(inp), tensors(out)
    compared, mismatches = [], []
    for name, t in dst.items():
        s = src[name]
        if t.tensor_type == s.tensor_type or t.tensor_type not in PY_QUANTIZABLE:
            continue
        expected = quants.quantize(values(s), t.tensor_type)
        compared.append(name)
        if np.ascontiguousarray(expected).view(np.uint8).tobytes() != raw(t):
            mismatches.append(name)
    print(json.dumps({"compared": compared, "mismatches": mismatches}))


def load_imatrix(path):
    """name -> f32 weights, as llama-quantize computes them from the file."""
    import struct
    with open(path, "rb") as f:
        head = f.read(4)
    out = {}
    if head == b"GGUF":
        sums, counts = {}, {}
        for t in GGUFReader(path).tensors:
            data = np.asarray(t.data, dtype=np.float32).reshape(-1)
            if t.name.endswith(".in_sum2"):
                sums[t.name[:-len(".in_sum2")]] = data
            elif t.name.endswith(".counts"):
                counts[t.name[:-len(".counts")]] = data
        for name, s in sums.items():
            c = np.array([np.float32(int(np.round(float(v)))) for v in counts[name]], dtype=np.float32)
            ne0 = len(s) // len(c)
            e = np.ones(len(s), np.float32)
            for j, cnt in enumerate(c):
                if cnt > 0:
                    e[j * ne0:(j + 1) * ne0] = s[j * ne0:(j + 1) * ne0] / cnt
            out[name] = e
        return out
    with open(path, "rb") as f:
        data = f.read()
    at = 0

    def i32():
        nonlocal at
        v = struct.unpack_from("<i", data, at)[0]
        at += 4
        return v
    for _ in range(i32()):
        n = i32()
        name = data[at:at + n].split(b"\0")[0].decode()
        at += n
        ncall, nval = i32(), i32()
        vals = np.frombuffer(data, dtype="<f4", count=nval, offset=at).astype(np.float32)
        at += 4 * nval
        out[name] = vals / np.float32(ncall) if ncall > 0 else vals.copy()
    return out


def llama_quantize(inp, out, ftype, imatrix=None):
    try:
        import llama_cpp
    except ImportError as e:
        print(f"SKIP: llama_cpp is not importable ({e})", file=sys.stderr)
        sys.exit(3)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(ftype)
    params.allow_requantize = True
    params.nthread = 2
    keep = []
    if imatrix is not None:
        entries = load_imatrix(imatrix)
        arr = (llama_cpp.llama_model_imatrix_data * (len(entries) + 1))()
        for i, (name, w) in enumerate(entries.items()):
            w = np.ascontiguousarray(w, dtype=np.float32)
            keep.append(w)
            arr[i].name = name.encode()
            arr[i].data = w.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr[i].size = len(w)
        arr[len(entries)].name = None
        keep.append(arr)
        params.imatrix = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    rc = llama_cpp.llama_model_quantize(inp.encode(), out.encode(), params)
    if rc != 0:
        sys.exit(f"llama_model_quantize returned {rc}")
    print(json.dumps({"ok": True}))


def wrms(x, q):
    w = x * x
    return float(np.sqrt(np.sum(w * (x - q) ** 2) / max(np.sum(w), 1e-30)))


def compare(inp, ours, theirs):
    src, a, b = tensors(inp), tensors(ours), tensors(theirs)
    rows = []
    for name in sorted(src):
        x = values(src[name])
        ta, tb = a[name], b[name]
        rows.append({
            "name": name,
            "ours": ta.tensor_type.name,
            "theirs": tb.tensor_type.name,
            "equal": ta.tensor_type == tb.tensor_type and raw(ta) == raw(tb),
            "ours_wrms": wrms(x, values(ta)),
            "theirs_wrms": wrms(x, values(tb)),
        })
    extra = sorted(set(a) ^ set(b))
    print(json.dumps({"tensors": rows, "name_mismatch": extra}))


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    {"gguf-py": gguf_py, "llama-quantize": llama_quantize, "compare": compare}[cmd](*args)
