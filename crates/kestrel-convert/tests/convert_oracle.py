#!/usr/bin/env python3
"""Oracle for kestrel-convert's convert tests, written with llama.cpp's gguf-py.

llama.cpp's convert_hf_to_gguf.py needs torch (not installed here, nor in CI), so this
script redoes its steps for Llama, Qwen2, Qwen3 and Gemma 3 on top of gguf-py's own parts:
tensor names from gguf.get_tensor_name_map, special tokens / merges / chat template from
gguf.SpecialVocab, data from gguf.quants, the file from gguf.GGUFWriter; the model-specific
steps (Q/K permutation, Gemma norm shift and vocabulary trim, metadata keys, token list and
types) are transcribed from convert_hf_to_gguf.py and its conversion/ modules.

Commands:
  tokenizer GGUF DIR N       write DIR/tokenizer.json and tokenizer_config.json from a GGUF's
                             vocabulary (N > 0: only the first N ordinary tokens and merges,
                             added tokens renumbered after them); prints {"vocab_size": ...}
  expect DIR FTYPE PRE OUT   write what convert_hf_to_gguf.py --outtype FTYPE writes for the
                             checkpoint DIR (tokenizer.ggml.pre given as PRE)
  spm DIR KIND SEED          train a tiny SentencePiece BPE model (KIND llama: dummy prefix,
                             Llama 2 style; gemma: none) into DIR/tokenizer.model with
                             added_tokens.json and tokenizer_config.json (no tokenizer.json);
                             prints the vocabulary size, special ids, and random strings with
                             sentencepiece's ids for them
  compare A B                print {"metadata": [differences], "tensors": [differences]}
  check DIR FTYPE PRE OURS   expect into OURS + ".expected.gguf", then compare OURS with it
"""
import json
import math
import struct
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

ARCHES = {
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
    "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3,
}
FTYPES = {"f32": (gguf.LlamaFileType.ALL_F32, T.F32), "f16": (gguf.LlamaFileType.MOSTLY_F16, T.F16),
          "bf16": (gguf.LlamaFileType.MOSTLY_BF16, T.BF16), "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, T.Q8_0)}
QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def tokenizer(gguf_path, out_dir, n):
    r = gguf.GGUFReader(gguf_path)
    f = lambda k: r.fields[k].contents()
    tokens, types, merges = f("tokenizer.ggml.tokens"), f("tokenizer.ggml.token_type"), f("tokenizer.ggml.merges")
    n = int(n)
    vocab, added = {}, []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == 1 and (n <= 0 or len(vocab) < n):
            vocab[t] = len(vocab) if n > 0 else i
        elif ty in (3, 4):
            added.append((i, t, ty))
    if n > 0:
        merges = [m for m in merges if all(p in vocab for p in m.split(" ")) and m.replace(" ", "") in vocab]
        added = [(len(vocab) + k, t, ty) for k, (_, t, ty) in enumerate(added)]
    tok = {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": ty == 3} for i, t, ty in added],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_REGEX}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "byte_fallback": False,
                  "vocab": vocab, "merges": [m.split(" ") for m in merges]},
    }
    out = Path(out_dir)
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    by_text = {t: i for i, t, _ in added}
    cfg = {"add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
           "chat_template": f("tokenizer.chat_template"), "model_max_length": 32768}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    size = max([len(vocab)] + [i + 1 for i, _, _ in added])
    print(json.dumps({"vocab_size": size, "bos": by_text["<|endoftext|>"], "eos": by_text["<|im_end|>"]}))


def read_safetensors(path):
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = np.frombuffer(body[a:b], dtype=np.uint8)
        dt = info["dtype"]
        if dt == "BF16":
            arr = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)  # torch: bf16 -> f32
        elif dt == "F16":
            arr = raw.view("<f2")
        else:
            arr = raw.view("<f4")
        out[name] = arr.reshape(info["shape"])
    return out


def permute(w, n_head, n_head_kv):  # LlamaModel.permute
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def looks_special(t):
    return (t in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (t.startswith("<|") and t.endswith("|>"))
            or (t.startswith("<｜") and t.endswith("｜>")) or (t.startswith("<unused") and t.endswith(">")))


def expect(d, ftype_name, pre, out):
    d = Path(d)
    hp = json.loads((d / "config.json").read_text())
    march = ARCHES[hp["architectures"][0]]
    arch = gguf.MODEL_ARCH_NAMES[march]
    ftype, default_qtype = FTYPES[ftype_name]
    n_layer = hp["num_hidden_layers"]
    w = gguf.GGUFWriter(out, arch)
    w.add_type("model")
    w.add_name(d.resolve().name)
    # gguf.Metadata.load: sampling defaults from generation_config.json
    gen_path = d / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    if "top_k" in gen:
        w.add_sampling_top_k(gen["top_k"])
    if "top_p" in gen:
        w.add_sampling_top_p(gen["top_p"])
    if "min_p" in gen:
        w.add_sampling_min_p(gen["min_p"])
    if "temperature" in gen:
        w.add_sampling_temp(gen["temperature"])
    if "repetition_penalty" in gen:
        w.add_sampling_penalty_repeat(gen["repetition_penalty"])
    # TextModel.set_gguf_parameters
    w.add_block_count(n_layer)
    if "max_position_embeddings" in hp:
        w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    if "intermediate_size" in hp:
        w.add_feed_forward_length(hp["intermediate_size"])
    if "num_attention_heads" in hp:
        w.add_head_count(hp["num_attention_heads"])
    if "num_key_value_heads" in hp:
        w.add_head_count_kv(hp["num_key_value_heads"])
    rope = dict(hp.get("rope_parameters", hp.get("rope_scaling")) or {})
    if "rope_theta" not in rope and "rope_theta" in hp:
        rope["rope_theta"] = hp["rope_theta"]
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope["type"]
    if "rope_theta" in rope:
        w.add_rope_freq_base(rope["rope_theta"])
    local = hp.get("local_rope_theta", hp.get("rope_local_base_freq"))
    if local is not None:
        w.add_rope_freq_base_swa(local)
    if "rms_norm_eps" in hp:
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if "head_dim" in hp:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    w.add_file_type(ftype)
    if arch == "llama":
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])
    if arch == "gemma3":
        w.add_context_length(hp.get("max_position_embeddings", 131072))
        w.add_head_count(hp.get("num_attention_heads", 8))
        w.add_layer_norm_rms_eps(hp.get("rms_norm_eps", 1e-6))
        w.add_key_length(hp.get("head_dim", 256))
        w.add_value_length(hp.get("head_dim", 256))
        w.add_rope_freq_base(rope.get("rope_theta", 1_000_000.0))
        if hp.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        if hp.get("sliding_window_pattern") != 1:
            w.add_sliding_window(hp["sliding_window"])
        w.add_head_count_kv(hp.get("num_key_value_heads", 4))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    n_vocab_real = None
    if arch in ("llama", "gemma3") and (d / "tokenizer.model").is_file():
        # LlamaModel.set_vocab / Gemma3Model.set_vocab -> _set_vocab_sentencepiece
        tcfg_path = d / "tokenizer_config.json"
        tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.is_file() else {}
        if arch == "llama" and tcfg.get("add_prefix_space") is not None:
            w.add_add_space_prefix(tcfg["add_prefix_space"])
        tokens, scores, toktypes = create_vocab_sentencepiece(d, hp)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(toktypes)
        gguf.SpecialVocab(d, n_vocab=len(tokens)).add_to_gguf(w)
        if arch == "gemma3":
            w.add_add_space_prefix(False)
        n_vocab_real = len(tokens)
    else:
        n_vocab_real = vocab_gpt2(w, d, hp, pre)
    tensors(w, d, hp, arch, march, n_layer, rope, default_qtype, n_vocab_real)


def create_vocab_sentencepiece(d, hp):
    """TextModel._create_vocab_sentencepiece, verbatim but for logging."""
    from sentencepiece import SentencePieceProcessor
    SentencePieceTokenTypes = gguf.TokenType
    tokenizer = SentencePieceProcessor()
    tokenizer.LoadFromFile(str(d / "tokenizer.model"))
    vocab_size = hp.get("vocab_size_per_layer_input") or hp.get("vocab_size") or tokenizer.vocab_size()
    tokens = [f"[PAD{i}]".encode("utf-8") for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    toktypes = [SentencePieceTokenTypes.UNUSED] * vocab_size
    for token_id in range(tokenizer.vocab_size()):
        if token_id >= vocab_size:
            break
        piece = tokenizer.IdToPiece(token_id)
        text = piece.encode("utf-8")
        score = tokenizer.GetScore(token_id)
        toktype = SentencePieceTokenTypes.NORMAL
        if tokenizer.IsUnknown(token_id):
            toktype = SentencePieceTokenTypes.UNKNOWN
        elif tokenizer.IsControl(token_id):
            toktype = SentencePieceTokenTypes.CONTROL
        elif tokenizer.IsUnused(token_id):
            toktype = SentencePieceTokenTypes.UNUSED
        elif tokenizer.IsByte(token_id):
            toktype = SentencePieceTokenTypes.BYTE
        tokens[token_id] = text
        scores[token_id] = score
        toktypes[token_id] = toktype
    added_tokens_file = d / 'added_tokens.json'
    if added_tokens_file.is_file():
        added_tokens_json = json.loads(added_tokens_file.read_text(encoding="utf-8"))
        for key in added_tokens_json:
            token_id = added_tokens_json[key]
            if token_id >= vocab_size:
                continue
            tokens[token_id] = key.encode("utf-8")
            scores[token_id] = -1000.0
            toktypes[token_id] = SentencePieceTokenTypes.USER_DEFINED
    tokenizer_config_file = d / 'tokenizer_config.json'
    if tokenizer_config_file.is_file():
        tokenizer_config_json = json.loads(tokenizer_config_file.read_text(encoding="utf-8"))
        added_tokens_decoder = tokenizer_config_json.get("added_tokens_decoder", {})
        for token_id, token_data in added_tokens_decoder.items():
            token_id = int(token_id)
            token = token_data["content"]
            if token_id >= vocab_size:
                continue
            if token_data.get("special") or looks_special(token):
                toktypes[token_id] = SentencePieceTokenTypes.CONTROL
            else:
                token = token.replace(b"\xe2\x96\x81".decode("utf-8"), " ")
                toktypes[token_id] = SentencePieceTokenTypes.USER_DEFINED
            scores[token_id] = -1000.0
            tokens[token_id] = token.encode("utf-8")
    if vocab_size > len(tokens):
        pad_count = vocab_size - len(tokens)
        for i in range(1, pad_count + 1):
            tokens.append(bytes(f"[PAD{i}]", encoding="utf-8"))
            scores.append(-1000.0)
            toktypes.append(SentencePieceTokenTypes.UNUSED)
    return tokens, scores, toktypes


def vocab_gpt2(w, d, hp, pre):
    # _set_vocab_gpt2 / get_vocab_base, reading tokenizer.json as AutoTokenizer would
    tok = json.loads((d / "tokenizer.json").read_text())
    reverse = {i: t for t, i in tok["model"]["vocab"].items()}
    added = {a["id"]: a for a in tok["added_tokens"]}
    vocab_size = hp.get("vocab_size", len(reverse) + len(added))
    tokens, toktypes = [], []
    for i in range(vocab_size):
        if i in added:
            t = added[i]["content"]
            if added[i]["special"] or looks_special(t):
                toktypes.append(gguf.TokenType.CONTROL)
            else:
                t = t.replace("\u2581", " ")
                toktypes.append(gguf.TokenType.USER_DEFINED)
            tokens.append(t)
        elif i in reverse:
            tokens.append(reverse[i])
            toktypes.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            toktypes.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    gguf.SpecialVocab(d, load_merges=True).add_to_gguf(w)
    return len(tok["model"]["vocab"]) + len(tok["added_tokens"])


def tensors(w, d, hp, arch, march, n_layer, rope, default_qtype, n_vocab_real):
    # tensors (ModelBase.prepare_tensors with the model classes' modify_tensors)
    tmap = gguf.get_tensor_name_map(march, n_layer)
    weights = {}
    for f in sorted(d.glob("*.safetensors")):
        weights.update(read_safetensors(f))
    if arch == "llama" and str(rope.get("rope_type", "")).lower() == "llama3":
        base = rope.get("rope_theta", 10000.0)
        dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
        freqs = (1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)
        factor, lo, hi = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
        old = rope.get("original_max_position_embeddings", 8192)
        lo_w, hi_w = old / lo, old / hi
        fs = []
        for fr in freqs:
            wl = np.float32(2 * math.pi) / fr
            if wl < hi_w:
                fs.append(1)
            elif wl > lo_w:
                fs.append(factor)
            else:
                s = (old / wl - lo) / (hi - lo)
                fs.append(1 / ((1 - s) / factor + s))
        w.add_tensor("rope_freqs.weight", np.array(fs, dtype=np.float32), raw_dtype=T.F32)
    for name in sorted(weights):
        data = weights[name]
        if name.endswith(".rotary_emb.inv_freq"):
            continue
        if arch == "llama":
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                data = permute(data, hp["num_attention_heads"], hp["num_attention_heads"])
            if name.endswith(("k_proj.weight", "k_proj.bias")):
                data = permute(data, hp["num_attention_heads"], hp.get("num_key_value_heads"))
        if arch == "gemma3":
            if "embed_tokens.weight" in name:
                data = data[:n_vocab_real]
            if name.endswith("norm.weight"):
                data = (data + data.dtype.type(1.0)).astype(data.dtype)
        new_name = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new_name is not None, name
        qtype = default_qtype
        if data.ndim <= 1 or new_name.endswith("_norm.weight") or not new_name.endswith(".weight"):
            qtype = T.F32
        try:
            q = gguf.quants.quantize(np.ascontiguousarray(data), qtype)
        except gguf.QuantError:
            qtype = T.F16
            q = gguf.quants.quantize(np.ascontiguousarray(data), qtype)
        w.add_tensor(new_name, q, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


SPM_TEXT = """The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!
def tokenize(text): return [t for t in text.split() if t]  # 42 tokens, 3.14 seconds
Über Straße naïve café — 東京 and 北京 are cities; 2024-01-15 at 09:30.
    indented   spaces	tabs and newlines
<html><body class="x">Hello, world!</body></html>
Sphinx of black quartz, judge my vow. How vexingly quick daft zebras jump.
"""


def spm(d, kind, seed):
    import io
    import random
    import sentencepiece as sp
    d = Path(d)
    rnd = random.Random(int(seed))
    lines = SPM_TEXT.splitlines() * 4
    words = " ".join(SPM_TEXT.split()).split(" ")
    lines += [" ".join(rnd.choice(words) for _ in range(rnd.randint(3, 12))) for _ in range(300)]
    buf = io.BytesIO()
    sp.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, model_type="bpe", vocab_size=rnd.randint(440, 500),
        byte_fallback=True, character_coverage=0.98, split_digits=True, bos_id=1, eos_id=2, unk_id=0,
        pad_id=3 if kind == "gemma" else -1, add_dummy_prefix=(kind == "llama"),
        remove_extra_whitespaces=False, normalization_rule_name="identity", allow_whitespace_only_pieces=True,
        user_defined_symbols=["<tool>"], control_symbols=["<ctl>"], hard_vocab_limit=False, minloglevel=2)
    (d / "tokenizer.model").write_bytes(buf.getvalue())
    proc = sp.SentencePieceProcessor(model_proto=buf.getvalue())
    n = proc.vocab_size()
    (d / "added_tokens.json").write_text(json.dumps({"<extra_0>": n, "<|im_start|>": n + 1}))
    cfg = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
           "added_tokens_decoder": {str(n + 1): {"content": "<|im_start|>", "special": True},
                                    "1": {"content": "<s>", "special": True},
                                    str(n + 50): {"content": "<far>", "special": True}}}
    if kind == "llama":
        cfg["add_prefix_space"] = True
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tf = d / "tokenizer.json"
    if tf.exists():
        tf.unlink()
    alphabet = sorted(set(SPM_TEXT)) + ["é", "ß", "€", "😀", "Ω", "\u0301", "  ", "\n\n"]
    strings = [rnd.choice(lines)[: rnd.randint(1, 60)] for _ in range(40)]
    strings += ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 30))) for _ in range(40)]
    strings = [t for t in strings if t.strip()]
    print(json.dumps({"n_tokens": n + 2, "bos": proc.bos_id(), "eos": proc.eos_id(),
                      "cases": [[t, proc.encode(t)] for t in strings]}))


def fields(r):
    out = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        out[k] = (int(f.types[0]) if f.types else None, f.contents())
    return out


def compare(a, b):
    ra, rb = gguf.GGUFReader(a), gguf.GGUFReader(b)
    fa, fb = fields(ra), fields(rb)
    meta = []
    for k in sorted(set(fa) | set(fb)):
        if fa.get(k) != fb.get(k):
            short = lambda v: str(v)[:200]
            meta.append({"key": k, "a": short(fa.get(k)), "b": short(fb.get(k))})
    ta = {t.name: t for t in ra.tensors}
    tb = {t.name: t for t in rb.tensors}
    tens = []
    for n in sorted(set(ta) | set(tb)):
        x, y = ta.get(n), tb.get(n)
        if x is None or y is None:
            tens.append({"name": n, "why": "missing in " + ("a" if x is None else "b")})
        elif x.tensor_type != y.tensor_type or list(x.shape) != list(y.shape):
            tens.append({"name": n, "why": f"{x.tensor_type.name}{list(x.shape)} vs {y.tensor_type.name}{list(y.shape)}"})
        elif np.ascontiguousarray(x.data).tobytes() != np.ascontiguousarray(y.data).tobytes():
            tens.append({"name": n, "why": "bytes differ"})
    print(json.dumps({"metadata": meta, "tensors": tens, "n_tensors": len(ta), "n_keys": len(fa)}))


def check(d, ftype_name, pre, ours):
    expected = ours + ".expected.gguf"
    expect(d, ftype_name, pre, expected)
    compare(ours, expected)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    {"tokenizer": tokenizer, "expect": expect, "compare": compare, "check": check, "spm": spm}[cmd](*args)
