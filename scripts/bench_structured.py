"""Tokens/s of a running `kestrel serve` with and without a JSON-schema constraint, at
several client counts: every client sends the same completion request (greedy, fixed
max_tokens) in a loop; the constrained run adds a schema whose output runs to max_tokens,
so both generate the same number of tokens. Rounds alternate the two kinds (and which goes
first), so a slow spell of a loaded machine hits both; each row reports the median
tokens/s of each kind with its spread (min-max over rounds) and the overhead of the
medians, plus the median of the rounds' paired overheads.

Usage: python3 scripts/bench_structured.py URL MODEL [--clients 1 64] [--rounds 5]
           [--requests 2] [--max-tokens 64]
Serve with `--max-seqs` at least the largest client count. Needs only the Python standard
library (the GPU host has no pip).
"""

import argparse
import json
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

# A list of digits that never ends before max_tokens: both runs generate the same count.
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1000}
PROMPT = "A list of digits: [1, 2, 3"


def scheduler_totals(url):
    """(forward seconds, host seconds, mask seconds, mask-wait seconds, steps) from the
    server's /metrics."""
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    vals = {}
    for line in text.splitlines():
        if line.startswith("kestrel_scheduler_seconds_total") or line.startswith("kestrel_steps_total"):
            name, value = line.rsplit(" ", 1)
            vals[name] = float(value)
    return (
        vals['kestrel_scheduler_seconds_total{phase="forward"}'],
        vals['kestrel_scheduler_seconds_total{phase="host"}'],
        vals.get('kestrel_scheduler_seconds_total{phase="masks"}', 0.0),
        vals.get('kestrel_scheduler_seconds_total{phase="mask_wait"}', 0.0),
        vals["kestrel_steps_total"],
    )


def complete(url, body):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as resp:
        return json.load(resp)


def run(args, clients, constrained):
    """Tokens/s of `clients` clients each sending `args.requests` requests, and the
    scheduler's forward, host, mask (beside the forward) and mask-wait (the part of the
    forward spent waiting for the masks) milliseconds per step meanwhile."""
    body = {"model": args.model, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "d", "schema": SCHEMA}}

    def one(_):
        tokens = 0
        for _ in range(args.requests):
            r = complete(args.url, body)
            assert r["choices"][0]["finish_reason"] == "length", r["choices"][0]
            tokens += r["usage"]["completion_tokens"]
        return tokens

    f0, h0, m0, w0, s0 = scheduler_totals(args.url)
    start = time.time()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(one, range(clients)))
    secs = time.time() - start
    f1, h1, m1, w1, s1 = scheduler_totals(args.url)
    steps = max(s1 - s0, 1)
    per_step = [1e3 * (b - a) / steps for a, b in ((f0, f1), (h0, h1), (m0, m1), (w0, w1))]
    return (tokens / secs, *per_step)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("model")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 64])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=2, help="requests per client and round")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    # Wait for the server to finish loading (the port answers before the model is loaded).
    for _ in range(600):
        try:
            urllib.request.urlopen(args.url + "/health", timeout=5)
            break
        except OSError:
            time.sleep(1)
    run(args, 1, True)  # warm-up (builds the vocabulary trie once)
    run(args, 1, False)
    for clients in args.clients:
        got = {"plain": [], "constrained": []}
        per_step = {"plain": [], "constrained": []}
        for r in range(args.rounds):
            order = [("plain", False), ("constrained", True)]
            if r % 2:
                order.reverse()
            for kind, constrained in order:
                tps, *split = run(args, clients, constrained)
                got[kind].append(tps)
                per_step[kind].append(split)
        med = {k: statistics.median(v) for k, v in got.items()}
        paired = [100 * (1 - c / p) for p, c in zip(got["plain"], got["constrained"])]
        row = {"clients": clients, "rounds": args.rounds}
        for k in ("plain", "constrained"):
            row[k + "_tok_s"] = round(med[k], 1)
            row[k + "_min_max"] = [round(min(got[k]), 1), round(max(got[k]), 1)]
            # The scheduler's time per step: the forward pass (the masks are computed beside
            # it, then applied by the sampler), its own host work, and the masks' preparation.
            row[k + "_forward_ms_step"] = round(statistics.median(x[0] for x in per_step[k]), 2)
            row[k + "_host_ms_step"] = round(statistics.median(x[1] for x in per_step[k]), 2)
            row[k + "_masks_ms_step"] = round(statistics.median(x[2] for x in per_step[k]), 2)
            row[k + "_mask_wait_ms_step"] = round(statistics.median(x[3] for x in per_step[k]), 3)
        row["overhead_pct"] = round(100 * (1 - med["constrained"] / med["plain"]), 1)
        row["paired_overhead_pct_median"] = round(statistics.median(paired), 1)
        row["paired_overhead_pct"] = [round(x, 1) for x in paired]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
