"""Drives a running Kestrel server's structured output, tool calls and API extras with the
official OpenAI Python client, validating every output.

Usage: python3 features_client.py BASE_URL API_KEY MODEL GROUP MODEL_PATH
GROUP `structured`: json_schema on every schema of data/schemas.json (each output is
validated with `jsonschema`), json_object, the `regex` and `grammar` extensions,
logit_bias, n = 2, the developer role, unknown fields, /v1/models/{id}, /tokenize and
/detokenize. GROUP `tools`: tool calls with `auto`, `required` and a named function, parallel
calls, streaming tool-call deltas, and a call and its result in the history rendered as
transformers renders the model's template.
Exits non-zero (with the failing check) if anything differs from what the API promises.
"""

import json
import os
import re
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_PATH = None


def post(url, key, path, body):
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": "bearer " + key},
    )
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())


def expect_error(call, exc, param=None):
    try:
        call()
    except exc as e:
        if param is not None:
            assert e.body.get("param") == param, e.body
        return
    raise AssertionError(f"expected {exc.__name__}")


def structured(url, key, model, client):
    schemas = json.load(open(os.path.join(HERE, "data", "schemas.json")))
    assert len(schemas) >= 30

    def one(case):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": case["prompt"] + " Answer in JSON."}],
            max_tokens=60,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": case["name"], "schema": case["schema"], "strict": True},
            },
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", (case["name"], c.finish_reason, c.message.content)
        value = json.loads(c.message.content)
        jsonschema.validate(value, case["schema"])
        return case["name"], value

    with ThreadPoolExecutor(8) as pool:
        for name, value in pool.map(one, schemas):
            print(f"  {name}: {json.dumps(value)}")

    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "developer", "content": "Answer in JSON."}, {"role": "user", "content": "A cat."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a complete object needs no more than the budget here, but a prefix must still be one
        assert r.choices[0].message.content.startswith("{"), r.choices[0].message.content

    r = client.completions.create(
        model=model, prompt="Code:", max_tokens=10, temperature=0, extra_body={"regex": "[0-9]{3}-[a-z]{2}"}
    )
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].text), r.choices[0].text
    assert r.choices[0].finish_reason == "stop"

    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Is water wet?"}],
        max_tokens=5,
        temperature=0,
        extra_body={"grammar": 'start: "yes" | "no"'},
    )
    assert r.choices[0].message.content in ("yes", "no"), r.choices[0].message.content

    # logit_bias: -100 bans the greedy first token, +100 forces another one.
    prompt = "The capital of France is"
    base = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    first = json.loads(base.model_dump_json())["choices"][0]["token_ids"][0]
    banned = client.completions.create(
        model=model, prompt=prompt, max_tokens=1, temperature=0, logit_bias={str(first): -100}
    )
    assert json.loads(banned.model_dump_json())["choices"][0]["token_ids"][0] != first
    forced_id = post(url, key, "/tokenize", {"content": " Berlin"})["tokens"][0]
    forced = client.completions.create(
        model=model, prompt=prompt, max_tokens=1, temperature=0, logit_bias={str(forced_id): 100}
    )
    assert json.loads(forced.model_dump_json())["choices"][0]["token_ids"] == [forced_id]

    # n = 2: two choices, seeded, usage summed.
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say something."}], max_tokens=8, n=2, seed=7
    )
    assert [c.index for c in r.choices] == [0, 1], r.choices
    assert r.usage.completion_tokens == sum(
        len(json.loads(r.model_dump_json())["choices"][i]["token_ids"]) for i in range(2)
    )

    # Unknown fields are refused by name; documented harmless ones pass.
    expect_error(
        lambda: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=1, extra_body={"frobnicate": 1}
        ),
        openai.BadRequestError,
        "frobnicate",
    )
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=1, user="u1")
    expect_error(
        lambda: client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=1,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        ),
        openai.BadRequestError,
    )

    assert client.models.retrieve(model).id == model
    expect_error(lambda: client.models.retrieve("no-such-model"), openai.NotFoundError)

    toks = post(url, key, "/tokenize", {"content": "Hello world", "with_pieces": True})["tokens"]
    assert "".join(t["piece"] for t in toks) == "Hello world", toks
    text = post(url, key, "/detokenize", {"tokens": [t["id"] for t in toks]})["content"]
    assert text == "Hello world", text


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def check_calls(calls, names):
    assert calls, "no tool calls"
    for c in calls:
        assert c.type == "function" and c.id, c
        assert c.function.name in names, c.function.name
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])


def tools(url, key, model, client):
    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    r = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER, TIME], max_tokens=40, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", (c.finish_reason, c.message)
    check_calls(c.message.tool_calls, {"get_weather"})

    chat = [{"role": "user", "content": "Tell me a one-line joke."}]
    r = client.chat.completions.create(
        model=model, messages=chat, tools=[WEATHER, TIME], tool_choice="required", max_tokens=40, temperature=0
    )
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    check_calls(r.choices[0].message.tool_calls, {"get_weather", "get_time"})

    r = client.chat.completions.create(
        model=model,
        messages=chat,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    check_calls(r.choices[0].message.tool_calls, {"get_time"})
    assert len(r.choices[0].message.tool_calls) == 1

    r = client.chat.completions.create(
        model=model, messages=chat, tools=[WEATHER], tool_choice="none", max_tokens=10, temperature=0
    )
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls"

    # Streaming: the call arrives as tool_calls deltas in OpenAI's shape.
    stream = client.chat.completions.create(
        model=model, messages=ask, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0, stream=True
    )
    calls, finish = {}, None
    for chunk in stream:
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                if d.function:
                    entry["name"] += d.function.name or ""
                    entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls", finish
    assert calls and all(c["id"] and c["name"] == "get_weather" for c in calls.values()), calls
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), PARAMS["get_weather"])

    # The call and its result in the history: the template renders both, the model answers.
    history = ask + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21, "sky": "sunny"}'},
    ]
    r = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], max_tokens=1, temperature=0)
    # Oracle: the prompt is the model's template rendered by jinja2 the way transformers
    # does (the call's arguments as an object), tokenized by the server.
    want = render_hf(history, [WEATHER])
    assert "<tool_response>" in want and '"city": "Paris"' in want, want
    n_want = len(post(url, key, "/tokenize", {"content": want})["tokens"])
    assert r.usage.prompt_tokens == n_want, (r.usage.prompt_tokens, n_want, want)


def render_hf(messages, tools):
    """The GGUF's chat template rendered as transformers renders it."""
    import gguf
    import jinja2.sandbox

    reader = gguf.GGUFReader(MODEL_PATH)
    field = reader.fields["tokenizer.chat_template"]
    source = bytes(field.parts[field.data[0]]).decode()
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    msgs = json.loads(json.dumps(messages))
    for m in msgs:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return env.from_string(source).render(messages=msgs, tools=tools, add_generation_prompt=True)


def main() -> None:
    global MODEL_PATH
    url, key, model, group, MODEL_PATH = sys.argv[1:6]
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    {"structured": structured, "tools": tools}[group](url, key, model, client)
    print(f"features ({group}): all checks passed")


if __name__ == "__main__":
    main()
