#!/usr/bin/env python3
"""Greedy agreement of a model's draft-mode output with llama.cpp's, per draft
KV precision (docs/model-core.md, "Draft KV fidelity").

    scripts/kv_fidelity.py model/tests/fixtures/greedy_qwen2_draft.jsonl f32,f16,int8 \
        [--draft-model FILE]

For each fixture line (made by scripts/llama_reference.py greedy) it runs
`tandem generate --mode draft --raw --max-tokens N --json --prompt P --draft-kv KV`
and prints, per precision, how many prompts agree in full and, for the others,
`@i (m)`: the first differing step and llama.cpp's top-2 margin there.
Arguments after the precisions go to `tandem generate`. TANDEM (default
target/debug/tandem) names the binary.
"""
import json
import os
import subprocess
import sys


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    fixture, kvs, extra = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
    tandem = os.environ.get("TANDEM", "target/debug/tandem")
    records = [json.loads(line) for line in open(fixture, encoding="utf-8") if line.strip()]
    for kv in kvs:
        agree, cells = 0, []
        for r in records:
            n = len(r["generated"])
            run = subprocess.run(
                [tandem, "generate", "--mode", "draft", "--raw", "--max-tokens", str(n),
                 "--json", "--prompt", r["prompt"], "--draft-kv", kv, *extra],
                capture_output=True, text=True, check=False)
            if run.returncode != 0:
                print(run.stderr[-800:], file=sys.stderr)
                return 1
            tokens = json.loads(run.stdout)["tokens"]
            first = next((i for i, (a, b) in enumerate(zip(tokens, r["generated"])) if a != b), None)
            if first is None and len(tokens) >= n:
                agree += 1
                cells.append("=")
            elif first is None:
                cells.append(f"stopped after {len(tokens)}")
            else:
                cells.append(f"@{first} ({r['margin'][first]:.2f})")
        print(f"{kv}: {agree}/{len(records)}  " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
