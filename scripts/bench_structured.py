"""Tokens/s of a running `kestrel serve` with and without a JSON-schema constraint, at
several client counts: every client sends the same completion request (greedy, fixed
max_tokens) in a loop; the constrained run adds a schema whose output runs to max_tokens.

Usage: python3 scripts/bench_structured.py URL MODEL [CLIENTS...]   (default clients: 1 4)
"""

import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai

MAX_TOKENS = 64
REQUESTS_PER_CLIENT = 3
# A list of digits that never ends before max_tokens: both runs generate the same count.
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1000}
PROMPT = "A list of digits: [1, 2, 3"


def scheduler_totals(url):
    """(forward seconds, host seconds, steps) from the server's /metrics."""
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    vals = {}
    for line in text.splitlines():
        if line.startswith("kestrel_scheduler_seconds_total") or line.startswith("kestrel_steps_total"):
            name, value = line.rsplit(" ", 1)
            vals[name] = float(value)
    return (
        vals['kestrel_scheduler_seconds_total{phase="forward"}'],
        vals['kestrel_scheduler_seconds_total{phase="host"}'],
        vals["kestrel_steps_total"],
    )


def run(client, model, clients, constrained):
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": SCHEMA}}} if constrained else {}

    def one(_):
        tokens = 0
        for _ in range(REQUESTS_PER_CLIENT):
            r = client.completions.create(
                model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
            )
            assert r.choices[0].finish_reason == "length", r.choices[0]
            tokens += r.usage.completion_tokens
        return tokens

    start = time.time()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(one, range(clients)))
    return tokens / (time.time() - start)


def main():
    url, model = sys.argv[1], sys.argv[2]
    levels = [int(c) for c in sys.argv[3:]] or [1, 4]
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    run(client, model, 1, True)  # warm-up (builds the vocabulary trie once)
    for clients in levels:
        row = {"clients": clients}
        for kind, constrained in (("plain", False), ("constrained", True)):
            f0, h0, s0 = scheduler_totals(url)
            row[kind + "_tok_s"] = round(run(client, model, clients, constrained), 1)
            f1, h1, s1 = scheduler_totals(url)
            # The scheduler's time per step: the forward pass (the mask is computed beside
            # it) and its own host work (masking, sampling).
            row[kind + "_forward_ms_step"] = round(1e3 * (f1 - f0) / (s1 - s0), 2)
            row[kind + "_host_ms_step"] = round(1e3 * (h1 - h0) / (s1 - s0), 2)
        row["overhead_pct"] = round(100 * (1 - row["constrained_tok_s"] / row["plain_tok_s"]), 1)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
