#!/bin/bash
# Acceptance with and without a JSON schema on the real pair (docs/grammar.md,
# "Measured"): local speculative decoding, greedy, k = 4, the draft proposer,
# five prompts that ask for JSON, each without a grammar and with its schema.
# Prints: prompt#, free|schema, tokens, rounds, drafted, accepted, acceptance,
# mean accepted per round, tok/s, the start of the text.
# Usage: scripts/grammar_acceptance.sh [path/to/tandem]
set -euo pipefail
B=${1:-target/release/tandem}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
schemas=(
'{"type":"object","properties":{"name":{"type":"string","maxLength":20},"age":{"type":"integer"},"langs":{"type":"array","items":{"enum":["rust","c","go"]},"maxItems":3}},"required":["name","age","langs"],"additionalProperties":false}'
'{"type":"object","properties":{"country":{"type":"string"},"capital":{"type":"string"},"population_millions":{"type":"number"},"languages":{"type":"array","items":{"type":"string"},"maxItems":4}},"required":["country","capital","population_millions","languages"],"additionalProperties":false}'
'{"type":"object","properties":{"crates":{"type":"array","items":{"type":"object","properties":{"name":{"type":"string"},"purpose":{"type":"string","maxLength":60}},"required":["name","purpose"],"additionalProperties":false},"minItems":3,"maxItems":3}},"required":["crates"],"additionalProperties":false}'
'{"type":"object","properties":{"title":{"type":"string","maxLength":60},"severity":{"enum":["low","medium","high","critical"]},"component":{"type":"string"},"steps":{"type":"array","items":{"type":"string","maxLength":60},"maxItems":3}},"required":["title","severity","component","steps"],"additionalProperties":false}'
'{"type":"object","properties":{"host":{"type":"string"},"port":{"type":"integer","minimum":1,"maximum":65535},"tls":{"type":"boolean"},"workers":{"type":"integer"}},"required":["host","port","tls","workers"],"additionalProperties":false}'
)
prompts=(
"Describe a programmer as JSON."
"Give the capital, population and languages of France as JSON."
"List three Rust crates for HTTP with their purpose, as JSON."
"Write a bug report for a null pointer crash in the login form, as JSON."
"Write the configuration of a web server (host, port, TLS, workers) as JSON."
)
for i in "${!prompts[@]}"; do
  printf '%s' "${schemas[$i]}" > "$dir/s$i.json"
  for mode in free schema; do
    extra=()
    [ "$mode" = schema ] && extra=(--json-schema "$dir/s$i.json")
    "$B" generate --k 4 --proposer draft --max-tokens 64 --prompt "${prompts[$i]}" "${extra[@]}" --json 2>/dev/null |
      python3 -c "
import json, sys
j = json.load(sys.stdin); s = j['stats']
print($i + 1, '$mode', s['generated_tokens'], s['rounds'], s['drafted'], s['accepted'],
      round(s['acceptance_rate'], 3), round(s['mean_accepted_len'], 2), round(s['tokens_per_s'], 2),
      json.dumps(j['text'][:60]))"
  done
done
