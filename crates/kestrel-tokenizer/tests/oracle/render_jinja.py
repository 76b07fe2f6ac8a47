"""Oracle for chat templates: renders with Python's jinja2 the way Hugging Face
transformers' apply_chat_template does (sandboxed, trim_blocks, lstrip_blocks,
loopcontrols, raise_exception, a json.dumps-based tojson).

Reads {"template": str, "cases": [{messages, tools, add_generation_prompt, bos_token,
eos_token}]} as JSON on stdin; writes a JSON list with, per case, {"ok": rendered} or
{"error": message}.
"""
import json
import sys

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def main():
    job = json.load(sys.stdin)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(job["template"])
    results = []
    for case in job["cases"]:
        try:
            results.append({"ok": template.render(
                messages=case["messages"],
                tools=case.get("tools"),
                add_generation_prompt=case["add_generation_prompt"],
                bos_token=case["bos_token"],
                eos_token=case["eos_token"],
            )})
        except Exception as e:  # noqa: BLE001 - the message is compared, not the type
            results.append({"error": str(e)})
    json.dump(results, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
