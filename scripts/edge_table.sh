#!/usr/bin/env bash
# The edge <-> cloud table of docs/edge.md: tokens/s, acceptance and verifier
# passes per generated token for `tandem generate --verifier` through netsim
# `lan` and `fast-4g`, next to target-only and draft-only, greedy, k = 4.
#
# Pinning (1 thread each, RAYON_NUM_THREADS=1):
#   edge (draft, `tandem generate --verifier`) and draft-only  -> core 0
#   verifier (`tandem serve-verifier`, target) and target-only -> core 1
#   netsim proxies                                             -> core 1 (cloud side)
#
# Usage: scripts/edge_table.sh [N_PROMPTS (3)] [MAX_TOKENS (64)]
# Env: TANDEM_BIN (default target/debug/tandem; the dev profile is opt-level 3),
#      K (4). Prints a markdown table on stdout, progress on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${TANDEM_BIN:-target/debug/tandem}
N=${1:-3}
TOKENS=${2:-64}
K=${K:-4}
[ -x "$BIN" ] || { echo "build first: cargo build -p tandem ($BIN missing)" >&2; exit 1; }
for c in jq taskset; do command -v $c >/dev/null || { echo "needs $c" >&2; exit 1; }; done

tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
export RAYON_NUM_THREADS=1

TOKEN=edge-table-token-0123456789
printf '%s\n' "$TOKEN" > "$tmp/token"
cat > "$tmp/verifier.toml" <<TOML
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
insecure_loopback = true
[[devices]]
id = "bench"
token = "$TOKEN"
TOML

# Starts "$@" in the background, waits for a first stdout line matching $1.
start_bg() {
  local pattern=$1 out=$2; shift 2
  "$@" > "$out" 2> "$out.err" &
  pids+=($!)
  for _ in $(seq 1 600); do
    grep -q "$pattern" "$out" 2>/dev/null && return 0
    kill -0 "${pids[-1]}" 2>/dev/null || { cat "$out.err" >&2; return 1; }
    sleep 0.1
  done
  echo "timed out waiting for: $*" >&2; return 1
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
start_bg "serving grpc=" "$tmp/v.out" taskset -c 1 "$BIN" serve-verifier --config "$tmp/verifier.toml"
grpc=$(sed -n 's/.*grpc=\([^ ]*\).*/\1/p' "$tmp/v.out")
declare -A proxy
for p in lan fast-4g; do
  start_bg "listening on" "$tmp/n-$p.out" taskset -c 1 "$BIN" netsim --listen 127.0.0.1:0 --upstream "$grpc" --profile "$p"
  proxy[$p]=$(sed -n 's/^listening on //p' "$tmp/n-$p.out")
done

mapfile -t prompts < <(head -n "$N" prompts/default.jsonl | jq -r .prompt)
rows=(target draft lan fast-4g)
for i in "${!prompts[@]}"; do
  pr=${prompts[$i]}
  echo "prompt $((i+1))/$N" >&2
  common=(generate --json --k "$K" --max-tokens "$TOKENS" --prompt "$pr")
  taskset -c 1 "$BIN" "${common[@]}" --mode target > "$tmp/target-$i.json"
  taskset -c 0 "$BIN" "${common[@]}" --mode draft > "$tmp/draft-$i.json"
  for p in lan fast-4g; do
    taskset -c 0 "$BIN" "${common[@]}" --verifier "http://${proxy[$p]}" --token-file "$tmp/token" \
      > "$tmp/$p-$i.json" 2> "$tmp/$p-$i.err"
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

# Aggregates over prompts: tokens/s = sum(tokens) / sum(time) (prefill included,
# model load excluded); acceptance = sum(accepted) / sum(drafted).
agg() {
  local row=$1
  jq -s --arg row "$row" --argjson n "$N" '
    def r2: (. * 100 | round) / 100;
    (map(.stats.generated_tokens) | add) as $tok
    | (map(.stats.total_ms) | add) as $ms
    | {tps: ($tok / ($ms / 1000) | r2), tok: $tok,
       acc: (if $row == "target" or $row == "draft" then "-" else
               ((map(.stats.accepted) | add) / ((map(.stats.drafted) | add) | if . == 0 then 1 else . end) * 100 | round | tostring) + "%" end),
       ppt: (if $row == "target" then "1.00 (+prefill)" elif $row == "draft" then "0" else
               ((map(.stats.verifier_passes) | add) / $tok | r2 | tostring) end),
       rtt: (if $row == "lan" or $row == "fast-4g" then (map(.stats.rtt_mean_ms) | add / $n | round | tostring) else "-" end),
       ver: (if $row == "lan" or $row == "fast-4g" then (map(.stats.verified_tokens) | add | tostring) else "-" end)}
  ' "$tmp"/"$row"-*.json
}
same_as_target() {
  local ok=yes
  for i in $(seq 0 $((N-1))); do
    cmp -s <(jq -c .tokens "$tmp/$1-$i.json") <(jq -c .tokens "$tmp/target-$i.json") || ok=no
  done
  echo $ok
}

echo "tandem edge table $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $N prompts of prompts/default.jsonl x $TOKENS tokens, greedy, k=$K, 1 thread per process"
echo "load average before: $load_before; after: $load_after (machine shared with other work)"
echo
echo "| run | pinning | tokens/s | acceptance | verifier passes / token | mean RTT ms | verified tokens | output = target-only |"
echo "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"
for row in "${rows[@]}"; do
  j=$(agg "$row")
  case $row in
    target) name="target-only (1.5B)"; pin="core 1"; same="-";;
    draft) name="draft-only (0.5B)"; pin="core 0"; same=$(same_as_target draft);;
    *) name="edge+verifier, netsim $row"; pin="edge 0, verifier 1"; same=$(same_as_target "$row");;
  esac
  echo "| $name | $pin | $(jq -r .tps <<<"$j") | $(jq -r .acc <<<"$j") | $(jq -r .ppt <<<"$j") | $(jq -r .rtt <<<"$j") | $(jq -r .ver <<<"$j") | $same |"
done
