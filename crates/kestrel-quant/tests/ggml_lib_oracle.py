#!/usr/bin/env python3
"""Oracle for kestrel-quant's codebook quantizers: llama.cpp's own C quantizers
(`ggml_quantize_chunk` of the libggml-base that llama-cpp-python ships), through ctypes.

usage: ggml_lib_oracle.py TYPE_ID ROW_LEN IN_F32 OUT ...   (any number of quadruples)
       ggml_lib_oracle.py --imatrix TYPE_ID ROW_LEN IN_F32 IMATRIX_F32 OUT ...
                           (quintuples: ROW_LEN importance weights, as llama-quantize
                           passes them with --imatrix)
Exits with status 3 when llama-cpp-python is not installed (the test then skips).
"""
import ctypes
import glob
import os
import sys

import numpy as np

try:
    import llama_cpp
except ImportError:
    sys.exit(3)


def main(argv):
    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), 'lib')
    ggml = ctypes.CDLL(sorted(glob.glob(os.path.join(lib_dir, 'libggml-base.so*')))[0])
    quantize = ggml.ggml_quantize_chunk
    quantize.restype = ctypes.c_size_t
    quantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    row_size = ggml.ggml_row_size
    row_size.restype = ctypes.c_size_t
    row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    weighted = argv[:1] == ['--imatrix']
    if weighted:
        argv = argv[1:]
    step = 5 if weighted else 4
    for i in range(0, len(argv), step):
        ty, row_len, src, dst = int(argv[i]), int(argv[i + 1]), argv[i + 2], argv[i + step - 1]
        values = np.ascontiguousarray(np.fromfile(src, dtype='<f4'))
        imatrix = None
        if weighted:
            weights = np.ascontiguousarray(np.fromfile(argv[i + 3], dtype='<f4'))
            assert len(weights) == row_len
            imatrix = weights.ctypes.data
        rows = len(values) // row_len
        out = np.zeros(rows * row_size(ty, row_len), np.uint8)
        quantize(ty, values.ctypes.data, out.ctypes.data, 0, rows, row_len, imatrix)
        out.tofile(dst)


if __name__ == '__main__':
    main(sys.argv[1:])
