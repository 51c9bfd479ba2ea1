#!/usr/bin/env python3
"""How fast can prompt lookup make greedy decoding on this machine? A replay.

For the first N prompts of a set, take the target's own greedy output (`tandem
generate --mode target --json`) and the prompt's tokens (`tandem tokenize`),
then replay lookup rounds against that output: propose what followed the
latest earlier occurrence of the longest 2..4-token suffix (as
`tandem_model::proposer::NgramIndex` does), accept the common prefix, add the
target's token. Each round costs one target forward over its rows, priced from
the forward times measured here (`--ms`, from `tandem bench --models target
--engines tandem --spec-prompts 0`, "forward ms" row); prefill costs
`--prefill-ms` per prompt token for both engines. It prints the end-to-end
ratio against target-only:

- `lookup kN`: lookup's whole offer of up to N tokens, as `--proposer lookup`;
- `oracle kN`: every round proposes the length that turns out best given how
  much of the offer the target accepts: no chooser (auto's included) can beat
  it with these proposals.

Outputs are cached in --work. Used for docs/benchmarks.md ("How far lookup can
go on this machine"). Needs only the standard library.
"""

import argparse
import json
import os
import subprocess

MIN_NGRAM, MAX_NGRAM = 2, 4


def cost(ms, rows):
    """Interpolated forward time of `rows` rows (ms), linear between points."""
    pts = sorted(ms.items())
    for (a, ta), (b, tb) in zip(pts, pts[1:]):
        if a <= rows <= b:
            return ta + (tb - ta) * (rows - a) / (b - a)
    (a, ta), (b, tb) = pts[-2], pts[-1]
    return tb + (tb - ta) / (b - a) * (rows - b)


def propose(history, k):
    """Lookup's offer after `history` (a rescan: fine for a replay)."""
    n_hist = len(history)
    for n in range(min(MAX_NGRAM, n_hist - 1), MIN_NGRAM - 1, -1):
        suffix = history[n_hist - n:]
        for start in range(n_hist - 1, n - 1, -1):
            if history[start - n:start] == suffix:
                return history[start:min(n_hist, start + k)]
    return []


def replay(prompt, output, k, ms, oracle):
    """Decode milliseconds of one generation with lookup rounds."""
    history, t, total = list(prompt) + [output[0]], 1, 0.0
    while t < len(output):
        block = propose(history, min(k, len(output) - t))
        accepted = 0
        while accepted < len(block) and block[accepted] == output[t + accepted]:
            accepted += 1
        if oracle:
            length = max(range(len(block) + 1),
                         key=lambda n: (min(accepted, n) + 1) / cost(ms, n + 1))
            accepted = min(accepted, length)
            block = block[:length]
        total += cost(ms, len(block) + 1)
        new = output[t:t + accepted + 1]
        history += new
        t += len(new)
    return total


def cached(path, argv, stdin=None):
    if not os.path.exists(path):
        out = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=True)
        with open(path, "w") as f:
            f.write(out.stdout)
    with open(path) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tandem", default="target/release/tandem")
    ap.add_argument("--prompts", default="prompts/editing.jsonl")
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--work", default="/tmp/lookup-bound")
    ap.add_argument("--ms", required=True,
                    help="target forward ms per rows, e.g. 1:27.1,2:31.3,3:41.1,5:52.3,9:87.7,17:168.8")
    ap.add_argument("--prefill-ms", type=float, required=True,
                    help="target prefill ms per prompt token (1000 / prefill/s)")
    ap.add_argument("--k", default="2,4,8,16")
    args = ap.parse_args()
    ms = {int(a): float(b) for a, b in (p.split(":") for p in args.ms.split(","))}
    os.makedirs(args.work, exist_ok=True)
    with open(args.prompts) as f:
        prompts = [json.loads(line) for line in f if line.strip()][:args.count]
    runs = []
    for i, p in enumerate(prompts):
        out = cached(f"{args.work}/out{i:02d}.json",
                     [args.tandem, "generate", "--mode", "target", "--json",
                      "--max-tokens", str(p.get("max_tokens", 256)), "--prompt", p["prompt"]])
        toks = cached(f"{args.work}/prompt{i:02d}.json", [args.tandem, "tokenize"], p["prompt"])
        runs.append((toks, out["tokens"]))
    base = sum(len(pr) * args.prefill_ms + (len(o) - 1) * cost(ms, 1) for pr, o in runs)
    print(f"{len(runs)} prompts, {sum(len(o) for _, o in runs)} tokens; "
          "end-to-end tok/s ratio against target-only (prefill included):")
    for k in (int(x) for x in args.k.split(",")):
        for oracle in (False, True):
            spec = sum(len(pr) * args.prefill_ms + replay(pr, o, k, ms, oracle) for pr, o in runs)
            print(f"  {'oracle' if oracle else 'lookup'} k{k}: {base / spec:.3f}")


if __name__ == "__main__":
    main()
