#!/usr/bin/env python3
"""Predict `--spec ngram`'s speed-up over plain decoding from greedy outputs and the measured
costs of verification steps, without running speculation.

Greedy speculation is lossless, so the tokens are the plain greedy ones; which drafts the
prompt lookup proposes, how many are accepted and how long each round's step is follow from
them alone. This replays the engine's loop (`kestrel-engine/src/spec/generate.rs`), drafter
(`ngram.rs`, sizes 2..=4) and length control (`control.rs`: its constants are copied below;
keep them in step), charging each step its cost in single-token steps (`kestrel bench
--verify`), and prints the predicted ratio with the acceptance, mean accepted length and
step sizes (which match `bench --spec ngram`'s exactly when the replay is right).

    # greedy outputs of the tasks (any backend: the ids are what matter), then the replay
    python3 spec_sim.py gen MODEL w20.jsonl greedy.json [-n 96]
    python3 spec_sim.py replay greedy.json 2:1.39 3:1.62 5:2.16 8:2.69 [--draft-max 7]

Costs not given are interpolated linearly between those given (1 is 1.0). The host's own
time per step is not in the costs: measured ratios came out ~5% below the prediction.
"""

import json
import subprocess
import sys

# control.rs
SPEC_DECAY, PLAIN_DECAY, REFRESH_ROUNDS, PROBE_ROUNDS, OFF_STEPS, GROW = 0.875, 0.5, 16, 8, 4, 3
NGRAM_MIN, NGRAM_MAX = 2, 4  # the CLI's --ngram-min / --ngram-max defaults


class Rate:
    def __init__(self):
        self.secs = self.tokens = 0.0

    def add(self, decay, secs, tokens):
        self.secs = decay * self.secs + secs
        self.tokens = decay * self.tokens + tokens

    def per_token(self):
        return self.secs / self.tokens if self.tokens > 0 else None


class Control:
    def __init__(self, lo, hi):
        self.min, self.max = max(1, lo), max(hi, lo)
        self.len, self.plain, self.spec = self.min, Rate(), Rate()
        self.rounds = self.since_plain = self.off = self.times_off = 0

    def draft_len(self):
        unmeasured = self.plain.per_token() is None and self.rounds >= PROBE_ROUNDS
        if unmeasured or self.off > 0 or self.since_plain >= REFRESH_ROUNDS:
            return 0
        return self.len

    def record_plain(self, secs):
        self.plain.add(PLAIN_DECAY, secs, 1)
        self.since_plain = 0
        self.off = max(0, self.off - 1)

    def record_round(self, drafted, accepted, secs):
        grown = self.len + GROW if accepted >= drafted else accepted + 1
        self.len = max(self.min, min(self.max, grown))
        self.spec.add(SPEC_DECAY, secs, accepted + 1)
        self.rounds += 1
        self.since_plain += 1
        spec, plain = self.spec.per_token(), self.plain.per_token()
        if spec is not None and plain is not None and self.rounds >= PROBE_ROUNDS and spec > plain:
            self.off = OFF_STEPS << min(self.times_off, 4)
            self.rounds, self.spec, self.len = 0, Rate(), self.min
            self.times_off += 1


def lookup(context, k):
    n_ctx = len(context)
    for n in range(min(NGRAM_MAX, n_ctx - 1), NGRAM_MIN - 1, -1):
        suffix = context[n_ctx - n:]
        for start in range(n_ctx - n - 1, -1, -1):
            if context[start:start + n] == suffix:
                return context[start + n:min(start + n + k, n_ctx)]
    return []


def replay(tasks, cost, draft_max=7, max_tokens=96, verify_max=8):
    spent = tokens = drafted = accepted = rounds = plain = 0
    sizes = {}
    for t in tasks:
        prompt, ids = t["prompt_ids"], t["ids"]
        c = Control(1, draft_max)
        k = 1  # the first token comes with the prefill
        while k < len(ids):
            history = prompt + ids[:k]  # evaluated tokens, then the pending one
            room = min(max_tokens - k - 1, verify_max - 1)
            want = min(c.draft_len(), room)
            draft = lookup(history, want) if want >= c.min else []
            if len(draft) < c.min:
                draft = []
            if not draft:
                c.record_plain(cost[1])
                spent += cost[1]
                plain += 1
                emitted = 1
            else:
                a = 0
                while a < len(draft) and k + a < len(ids) and draft[a] == ids[k + a]:
                    a += 1
                size = len(draft) + 1
                c.record_round(len(draft), a, cost[size])
                spent += cost[size]
                sizes[size] = sizes.get(size, 0) + 1
                drafted, accepted, rounds = drafted + len(draft), accepted + a, rounds + 1
                emitted = a + 1
            k += emitted
            tokens += emitted
    return {
        "predicted_ratio": round(tokens / spent, 3),
        "acceptance": round(accepted / max(1, drafted), 4),
        "mean_accepted": round(accepted / max(1, rounds), 3),
        "verification_steps": rounds,
        "plain_steps": plain,
        "steps_by_tokens": dict(sorted(sizes.items())),
    }


def costs(args):
    given = {1: 1.0}
    for a in args:
        t, c = a.split(":")
        given[int(t)] = float(c)
    known = sorted(given)
    out = {}
    for t in range(1, known[-1] + 1):
        lo = max(k for k in known if k <= t)
        hi = min(k for k in known if k >= t)
        out[t] = given[lo] if lo == hi else given[lo] + (given[hi] - given[lo]) * (t - lo) / (hi - lo)
    return out


def gen(model, workload, out_path, n):
    tasks = []
    for line in open(workload):
        if not line.strip():
            continue
        task = json.loads(line)
        with open("/tmp/spec_sim_prompt.txt", "w") as f:
            f.write(task["prompt"])
        run = ["kestrel", "run", "-m", model, "--temp", "0", "-n", str(n), "--json", "-f", "/tmp/spec_sim_prompt.txt"]
        d = json.loads(subprocess.run(run, capture_output=True, text=True, check=True).stdout)
        tasks.append({"name": task.get("name", ""), "prompt_ids": d["prompt_ids"], "ids": d["ids"]})
        print(task.get("name", ""), len(d["prompt_ids"]), len(d["ids"]), file=sys.stderr)
    json.dump(tasks, open(out_path, "w"))


def main():
    a = sys.argv[1:]
    if a[:1] == ["gen"] and len(a) >= 4:
        n = int(a[a.index("-n") + 1]) if "-n" in a else 96
        gen(a[1], a[2], a[3], n)
    elif a[:1] == ["replay"] and len(a) >= 2:
        draft_max = 7
        if "--draft-max" in a:
            i = a.index("--draft-max")
            draft_max = int(a[i + 1])
            del a[i:i + 2]
        cost = costs(a[2:])
        if max(cost) < 8:
            sys.exit("give the cost of 8-token steps (e.g. 8:2.69)")
        print(json.dumps(replay(json.load(open(a[1])), cost, draft_max)))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
