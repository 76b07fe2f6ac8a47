"""Generates tests/data/llamacpp_fuzz.<model>.json: llama.cpp's own tokenization of
random strings, detokenization of random id sequences, its full token->piece table
(as a digest) and its special-token settings, for the tests in tests/llamacpp_fuzz.rs.

Needs llama-cpp-python (the reference data was made with 0.3.36) and the model files:

    pip install llama-cpp-python==0.3.36
    python3 gen_llamacpp_fixture.py ~/.cache/kestrel/models/qwen2.5-coder-1.5b.gguf qwen2.5-coder-1.5b
    python3 gen_llamacpp_fixture.py ~/.cache/kestrel/models/gemma-3-270m.gguf gemma-3-270m

Only the vocabulary is loaded (vocab_only), so this runs in seconds. Optional third and
fourth arguments: number of random strings (default 400) and seed, for larger local runs.
"""
import ctypes
import hashlib
import json
import os
import random
import struct
import sys

import llama_cpp

FRAGMENTS = [
    # words, case, contractions
    "the", "The", "THE", "quick", "brown", "hello", "World", "don", "'t", "'s", "'S", "'ll",
    "'LL", "'re", "'Ve", "'m", "'d", "'x", "I'm", "it's", "naïve", "Zürich", "façade",
    # scripts
    "日本語", "のテキスト", "中文", "한국어", "русский", "Ελληνικά", "עברית", "العربية", "हिन्दी",
    "ไทย", "ქართული", "Ǆemal", "ǅ", "ﬁ", "ß", "İ", "ﷺ", "e\u0301", "a\u0308\u0301", "\u0301",
    # digits and numbers
    "0", "1", "12", "123", "1234", "12345678", "3.14", "1e-9", "-42", "٣٤٥", "Ⅻ", "½", "²", "①",
    # punctuation and symbols
    ",", ".", "!", "?", "...", "-", "--", "_", "(", ")", "[", "]", "{", "}", "\"", "'", "`", "$",
    "+", "=", "<", ">", "^", "~", "|", "@", "#", "%", "&", "*", "/", "\\", ":", ";", "->", "=>",
    "!=", "::", "//", "/*", "*/", "<=", ">=", "€", "£", "©", "™", "∑", "∫", "√", "≠", "≤", "→",
    "🤖", "🚀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "😀😃", "\U0001F600", "𓀀", "𒀀", "𐌰",
    # whitespace of every kind
    " ", " ", " ", "  ", "   ", "    ", "\n", "\n\n", "\n\n\n", "\r", "\r\n", "\t", "\t\t",
    " \n", "\n ", " \t ", "\u000b", "\u000c", "\u0085", "\u00a0", "\u1680", "\u2003", "\u2028",
    "\u3000", "\u200b", "\ufeff", "\u00ad",
    # markup, special-token texts of both vocabularies, near misses
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|fim_prefix|>", "<|file_sep|>",
    "<tool_call>", "</tool_call>", "<|im_start", "im_end|>", "<|", "|>",
    "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
    "<unused0>", "<unused123>", "[multimodal]", "<start_of_image>", "<s>", "</s>", "<b>",
    "<table>", "<h1>", "</div>", "<0x41>", "▁", "▁▁", "Ġ", "Ċ",
    # code
    "fn main() {", "def f(x):", "    return x", "print(\"hi\")", "#include <stdio.h>",
    "https://example.com/a?b=c&d=1#e", "user@example.com",
]


def random_code_point(rng):
    """Any scalar value, mostly from the BMP (unassigned and private-use ones included)."""
    while True:
        cp = rng.randrange(0x20, 0x10000) if rng.random() < 0.8 else rng.randrange(0x10000, 0x110000)
        if not 0xD800 <= cp <= 0xDFFF:
            return chr(cp)


def random_text(rng):
    n = rng.randrange(0, 25)
    parts = []
    for _ in range(n):
        r = rng.random()
        if r < 0.8:
            parts.append(rng.choice(FRAGMENTS))
        elif r < 0.95:
            parts.append(random_code_point(rng))
        else:
            parts.append(rng.choice(FRAGMENTS) * rng.randrange(2, 6))
    return "".join(parts)


def tokenize(llm, text, add_special, parse_special):
    return list(llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special))


def piece(vocab, token, special):
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    return buf.raw[:n]


def detokenize(vocab, ids, special):
    arr = (llama_cpp.llama_token * len(ids))(*ids)
    size = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, special)
    if n < 0:
        size = -n
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, special)
    return buf.raw[:n]


def piece_digest(vocab, n_vocab, special):
    h = hashlib.sha256()
    for t in range(n_vocab):
        p = piece(vocab, t, special)
        h.update(struct.pack("<I", len(p)))
        h.update(p)
    return h.hexdigest()


def main():
    path, model = sys.argv[1], sys.argv[2]
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    n_strings = int(sys.argv[3]) if len(sys.argv) > 3 else 400
    rng = random.Random(int(sys.argv[4]) if len(sys.argv) > 4 else 20240601)

    encode_cases = []
    for _ in range(n_strings):
        text = random_text(rng)
        encode_cases.append({
            "text": text,
            "ids_special": tokenize(llm, text, True, True),
            "ids_plain": tokenize(llm, text, False, False),
            "ids_special_no_bos": tokenize(llm, text, False, True),
            "ids_plain_bos": tokenize(llm, text, True, False),
        })

    # Random id sequences, biased towards special and low (byte-like) ids.
    special_ids = [t for t in range(n_vocab)
                   if llama_cpp.llama_vocab_get_attr(vocab, t) & (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
                                                                  | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED)]
    decode_cases = []
    for i in range(300):
        ids = []
        for _ in range(rng.randrange(0, 12)):
            r = rng.random()
            if r < 0.2:
                ids.append(rng.choice(special_ids))
            elif r < 0.5:
                ids.append(rng.randrange(0, 1024))
            else:
                ids.append(rng.randrange(0, n_vocab))
        special = i % 2 == 0
        decode_cases.append({
            "ids": ids,
            "special": special,
            "bytes_hex": detokenize(vocab, ids, special).hex(),
        })

    def opt(t):
        return None if t < 0 else t

    fixture = {
        "model": model,
        "generator": "llama-cpp-python " + llama_cpp.__version__,
        "n_vocab": n_vocab,
        "bos": opt(llama_cpp.llama_vocab_bos(vocab)),
        "eos": opt(llama_cpp.llama_vocab_eos(vocab)),
        "eot": opt(llama_cpp.llama_vocab_eot(vocab)),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
        "eog": [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)],
        "control": [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_control(vocab, t)],
        "piece_digest_special": piece_digest(vocab, n_vocab, True),
        "piece_digest_plain": piece_digest(vocab, n_vocab, False),
        "encode": encode_cases,
        "detokenize": decode_cases,
    }
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, f"llamacpp_fuzz.{model}.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, separators=(",", ":"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
