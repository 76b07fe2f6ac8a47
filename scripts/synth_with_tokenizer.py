#!/usr/bin/env python3
"""A `kestrel synth` model with a real model's tokenizer: the synthetic file's hyper-parameters
and tensors, every `tokenizer.*` key of the real file (the vocabulary sizes must agree), and
optionally another sliding window. Servers then accept text, chat and grammars (constrained
decoding needs a tokenizer) on a file small enough to carry to a GPU host.

    kestrel synth --arch gemma3 --layers 18 --embd 128 --ff 256 --heads 4 --kv-heads 1 \\
        --head-dim 256 --vocab 262144 --ctx 32768 --type q4_0 -o synth.gguf
    python3 scripts/synth_with_tokenizer.py synth.gguf gemma-3-270m.gguf out.gguf --sliding-window 512

Needs gguf-py (`pip install gguf`).
"""
import argparse

import gguf


def main():
    p = argparse.ArgumentParser()
    p.add_argument("synth")
    p.add_argument("real")
    p.add_argument("out")
    p.add_argument("--sliding-window", type=int)
    args = p.parse_args()
    rs, rr = gguf.GGUFReader(args.synth), gguf.GGUFReader(args.real)
    arch = rs.fields["general.architecture"].contents()
    vocab = len(rr.fields["tokenizer.ggml.tokens"].data)
    rows = {t.name: t.shape for t in rs.tensors}.get("token_embd.weight")
    if rows is not None and int(rows[-1]) != vocab:
        raise SystemExit(f"the synthetic model has {int(rows[-1])} token rows, the tokenizer {vocab} tokens")
    w = gguf.GGUFWriter(args.out, arch)

    def copy(field):
        t = field.types[0]
        sub = field.types[-1] if t == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), t, sub_type=sub)

    window = f"{arch}.attention.sliding_window"
    for f in rs.fields.values():
        if f.name == "general.architecture" or f.name.startswith(("GGUF.", "tokenizer.")):
            continue
        if f.name == window and args.sliding_window is not None:
            continue
        copy(f)
    if args.sliding_window is not None:
        w.add_key_value(window, args.sliding_window, gguf.GGUFValueType.UINT32)
    for f in rr.fields.values():
        if f.name.startswith("tokenizer."):
            copy(f)
    for t in rs.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in rs.tensors:
        w.write_tensor_data(t.data)
    w.close()


if __name__ == "__main__":
    main()
