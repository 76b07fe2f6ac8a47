"""Generates tests/data/llamacpp_chat_builtins.json: llama.cpp's built-in chat formats
(llama_chat_apply_template with the names chatml, gemma, llama3) on a few conversations,
for tests/chat.rs. Needs llama-cpp-python (0.3.36 made the committed file):

    python3 gen_llamacpp_chat_fixture.py
"""
import ctypes
import json
import os

import llama_cpp

CONVERSATIONS = [
    [("user", "Hi!")],
    [("system", "You are terse."), ("user", "What is 2+2?")],
    [("system", "  Be brief. "), ("user", " Hi!\n"), ("assistant", "Hello. How can I help?"),
     ("user", "Tell me a joke.")],
    [("user", "Traduis « bonjour » en 日本語.\nMerci!"), ("assistant", "こんにちは 🤖")],
    [("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")],
]


def apply(name, messages, add_assistant):
    arr = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for i, (role, content) in enumerate(messages):
        r = ctypes.create_string_buffer(role.encode())
        c = ctypes.create_string_buffer(content.encode())
        keep += [r, c]
        arr[i].role = ctypes.cast(r, ctypes.c_char_p)
        arr[i].content = ctypes.cast(c, ctypes.c_char_p)
    size = 8192
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(name.encode(), arr, len(messages), add_assistant, buf, size)
    assert 0 <= n <= size, n
    return buf.raw[:n].decode()


def main():
    cases = []
    for name in ["chatml", "gemma", "llama3"]:
        for messages in CONVERSATIONS:
            for add_assistant in [True, False]:
                cases.append({
                    "template": name,
                    "messages": [{"role": r, "content": c} for r, c in messages],
                    "add_generation_prompt": add_assistant,
                    "rendered": apply(name, messages, add_assistant),
                })
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data",
                       "llamacpp_chat_builtins.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"generator": "llama-cpp-python " + llama_cpp.__version__, "cases": cases},
                  f, ensure_ascii=False, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
