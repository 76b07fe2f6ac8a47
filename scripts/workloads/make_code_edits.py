#!/usr/bin/env python3
"""Writes code_edits.jsonl: code-editing tasks whose answers largely copy their input
(rename a variable, add type hints, add a docstring, convert to a dataclass), built from
functions and classes of the Python standard library (PSF licence, see README.md), each
prompt chat-templated for Qwen2.5-Coder-Instruct (ChatML). Deterministic: the same Python
version gives the same file. Run: python3 make_code_edits.py > code_edits.jsonl
"""

import ast
import importlib
import inspect
import json
import sys
import textwrap

SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

FUNCTIONS = [
    "textwrap.dedent", "textwrap.indent", "shlex.join", "shlex.quote", "fnmatch.translate",
    "posixpath.normpath", "posixpath.relpath", "posixpath.commonpath", "difflib.get_close_matches",
    "heapq.nsmallest", "bisect.insort_right", "colorsys.rgb_to_hls", "colorsys.hls_to_rgb",
    "calendar.monthrange", "statistics.median_grouped", "statistics.mode", "html.escape",
    "base64.b32encode", "urllib.parse.urldefrag", "urllib.parse.parse_qsl", "glob.escape",
    "string.capwords", "copy.deepcopy", "ntpath.splitdrive", "json.decoder.py_scanstring",
    "difflib.IS_CHARACTER_JUNK", "os.path.expanduser", "tokenize.detect_encoding",
    "textwrap.shorten", "shutil.copyfileobj", "calendar.isleap", "statistics.fmean",
    "json.dumps", "base64.b64encode", "difflib.unified_diff", "operator.length_hint",
    "colorsys.rgb_to_hsv", "heapq.merge", "fnmatch.filter", "string.Formatter.vformat",
]

CLASSES = [
    "inspect.BlockFinder", "csv.DictWriter", "zipfile._SharedFile", "tracemalloc.Statistic",
    "plistlib._DumbXMLWriter", "graphlib._NodeInfo",
]


def resolve(dotted):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def chat(user):
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )


def first_local(source):
    """A parameter or assigned name of the function, to rename."""
    fn = ast.parse(source).body[0]
    params = [a.arg for a in fn.args.args if a.arg not in ("self", "cls")]
    return params[0] if params else None


def tasks():
    out = []
    kinds = ["rename", "hints", "docstring"]
    for dotted in FUNCTIONS:
        try:
            source = textwrap.dedent(inspect.getsource(resolve(dotted)))
        except (AttributeError, ImportError, TypeError, OSError):
            continue
        lines = source.count("\n")
        if not 5 <= lines <= 60:
            continue
        kind = kinds[len(out) % len(kinds)]
        if kind == "rename":
            old = first_local(source)
            if old is None:
                kind = "hints"
            else:
                instruction = (
                    f"Rename the parameter `{old}` to `{old}_in` everywhere in this function. "
                    "Reply with the complete updated function in one Python code block."
                )
        if kind == "hints":
            instruction = (
                "Add type hints to the parameters and the return value of this function. "
                "Reply with the complete updated function in one Python code block."
            )
        if kind == "docstring":
            instruction = (
                "Add a Google-style docstring to this function (replace any existing one), "
                "keeping the code unchanged. Reply with the complete updated function in one "
                "Python code block."
            )
        out.append((f"{kind}:{dotted}", f"{instruction}\n\n```python\n{source}```"))
    for dotted in CLASSES:
        try:
            source = textwrap.dedent(inspect.getsource(resolve(dotted)))
        except (AttributeError, ImportError, TypeError, OSError):
            continue
        if source.count("\n") > 80:
            continue
        instruction = (
            "Convert this class to a dataclass (from dataclasses import dataclass), keeping "
            "its methods. Reply with the complete updated class in one Python code block."
        )
        out.append((f"dataclass:{dotted}", f"{instruction}\n\n```python\n{source}```"))
    return out


def main():
    for name, user in tasks():
        print(json.dumps({"name": name, "prompt": chat(user)}))
    print(f"python {sys.version.split()[0]}", file=sys.stderr)


if __name__ == "__main__":
    main()
