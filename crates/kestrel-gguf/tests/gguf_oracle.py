"""Oracle for kestrel-gguf tests, built on llama.cpp's gguf-py.

  gguf_oracle.py dump FILE...            print each FILE as parsed by gguf.GGUFReader
  gguf_oracle.py write FIRST COUNT DIR   write random GGUFs DIR/py-SEED.gguf with
                                         gguf.GGUFWriter for seeds FIRST.., then dump them

Output: a JSON list, one dump per file.

The dump: {"version", "alignment", "data_offset", "fields": [...], "tensors": [...]}.
Each field has its name, gguf-py's type list (ids) and its leaf values flattened (gguf-py
flattens nested arrays) as hex of their raw little-endian bytes, so floats compare bit for
bit. Tensors have name, dims (file order: dims[0] is the row length), type id, absolute
data offset and byte size.
"""

import json
import random
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

HEADER_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")


def dump(path):
    reader = GGUFReader(path)
    fields = []
    for field in reader.fields.values():
        if field.name in HEADER_FIELDS:
            continue
        leaves = [field.parts[i].tobytes().hex() for i in field.data]
        fields.append({"name": field.name, "types": [int(t) for t in field.types], "leaves": leaves})
    tensors = []
    for tensor in reader.tensors:
        tensors.append(
            {
                "name": tensor.name,
                "dims": [int(d) for d in tensor.shape],
                "type": int(tensor.tensor_type),
                "data_offset": int(tensor.data_offset),
                "n_bytes": int(tensor.n_bytes),
            }
        )
    version = int(reader.fields["GGUF.version"].parts[-1][0])
    return {
        "version": version,
        "alignment": int(reader.alignment),
        "data_offset": int(reader.data_offset),
        "fields": fields,
        "tensors": tensors,
    }


SCALARS = {
    GGUFValueType.UINT8: lambda r: r.randrange(0, 1 << 8),
    GGUFValueType.INT8: lambda r: r.randrange(-(1 << 7), 1 << 7),
    GGUFValueType.UINT16: lambda r: r.randrange(0, 1 << 16),
    GGUFValueType.INT16: lambda r: r.randrange(-(1 << 15), 1 << 15),
    GGUFValueType.UINT32: lambda r: r.randrange(0, 1 << 32),
    GGUFValueType.INT32: lambda r: r.randrange(-(1 << 31), 1 << 31),
    GGUFValueType.UINT64: lambda r: r.randrange(0, 1 << 64),
    GGUFValueType.INT64: lambda r: r.randrange(-(1 << 63), 1 << 63),
    GGUFValueType.FLOAT32: lambda r: float(np.float32(r.uniform(-1e6, 1e6))),
    GGUFValueType.FLOAT64: lambda r: r.uniform(-1e300, 1e300),
    GGUFValueType.BOOL: lambda r: r.random() < 0.5,
    GGUFValueType.STRING: lambda r: "".join(r.choice("abc xyzé€🦅\n\"") for _ in range(r.randrange(0, 12))),
}

TENSOR_TYPES = [
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.I8,
    GGMLQuantizationType.I32, GGMLQuantizationType.F64,
]


def write_random(seed, out):
    rng = random.Random(seed)
    writer = GGUFWriter(out, arch="oracle")
    if rng.random() < 0.5:
        writer.add_custom_alignment(rng.choice([1, 8, 64, 256]))
    for i in range(rng.randrange(1, 20)):
        vtype = rng.choice(list(SCALARS) + [GGUFValueType.ARRAY] * 4)
        key = f"oracle.key{i}.{vtype.name.lower()}"
        if vtype == GGUFValueType.ARRAY:
            if rng.random() < 0.2:
                # Nested: gguf-py infers INT32 for python ints.
                val = [[rng.randrange(-1000, 1000) for _ in range(rng.randrange(1, 4))] for _ in range(rng.randrange(1, 4))]
                writer.add_key_value(key, val, GGUFValueType.ARRAY)
            else:
                sub = rng.choice(list(SCALARS))
                val = [SCALARS[sub](rng) for _ in range(rng.randrange(1, 30))]
                writer.add_key_value(key, val, GGUFValueType.ARRAY, sub_type=sub)
        else:
            writer.add_key_value(key, SCALARS[vtype](rng), vtype)
    for i in range(rng.randrange(0, 8)):
        qtype = rng.choice(TENSOR_TYPES)
        block, type_size = GGML_QUANT_SIZES[qtype]
        row_blocks = rng.randrange(1, 4)
        outer = [rng.randrange(1, 4) for _ in range(rng.randrange(0, 3))]
        byte_shape = outer + [row_blocks * type_size]
        data = np.frombuffer(rng.randbytes(int(np.prod(byte_shape))), dtype=np.uint8).reshape(byte_shape)
        writer.add_tensor(f"t{i}.{qtype.name.lower()}", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dump(out)


def main():
    if sys.argv[1] == "dump":
        result = [dump(path) for path in sys.argv[2:]]
    elif sys.argv[1] == "write":
        first, count, out_dir = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
        result = [write_random(seed, f"{out_dir}/py-{seed}.gguf") for seed in range(first, first + count)]
    else:
        raise SystemExit(__doc__)
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
