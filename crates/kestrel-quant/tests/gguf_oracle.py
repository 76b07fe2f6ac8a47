#!/usr/bin/env python3
"""Oracle for kestrel-quant's tests: llama.cpp's gguf-py quantizers and dequantizers.

Commands (all binary data little-endian):
  quantize TYPE IN_F32 OUT ...        gguf.quants.quantize of raw f32 values -> raw block bytes
  dequantize TYPE IN OUT_F32 ...      gguf.quants.dequantize of raw block bytes -> raw f32
                                      (both take any number of TYPE IN OUT triples)
  can-quantize TYPE...                prints the given type names that gguf.quants can quantize
TYPE is a GGMLQuantizationType name (F32, Q4_0, Q4_K, ...).
"""
import sys

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants


def qtype(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name]


def quantize(name: str, src: str, dst: str) -> None:
    values = np.fromfile(src, dtype="<f4")
    out = quants.quantize(values.reshape(1, -1), qtype(name))
    np.ascontiguousarray(out).view(np.uint8).tofile(dst)


def dequantize(name: str, src: str, dst: str) -> None:
    data = np.fromfile(src, dtype=np.uint8)
    out = quants.dequantize(data.reshape(1, -1), qtype(name))
    np.ascontiguousarray(out, dtype="<f4").tofile(dst)


def can_quantize(names: list[str]) -> None:
    for name in names:
        ty = qtype(name)
        block_size, _ = quants.GGML_QUANT_SIZES[ty]
        try:
            quants.quantize(np.zeros((1, block_size), dtype=np.float32), ty)
        except NotImplementedError:
            continue
        print(name)


def main(argv: list[str]) -> None:
    cmd, args = argv[1], argv[2:]
    if cmd in ("quantize", "dequantize"):
        if len(args) % 3 != 0:
            sys.exit(f"{cmd} takes TYPE IN OUT triples")
        run = quantize if cmd == "quantize" else dequantize
        for i in range(0, len(args), 3):
            run(*args[i : i + 3])
    elif cmd == "can-quantize":
        can_quantize(args)
    else:
        sys.exit(f"unknown command {cmd!r}\n{__doc__}")


if __name__ == "__main__":
    main(sys.argv)
