#!/usr/bin/env bash
# Prediction vs reality for split execution (docs/shard-planner.md): for several
# split points s and netsim `lan` / `fast-4g`, the cost model's per-round time
# (from a `tandem profile` of the target + the planner's evaluation of that split,
# as reported by the edge in stats.split.predicted_*) next to the measured one
# (stats.split.round_ms: device layers [0, s) + exchange + local head if pinned).
#
# Pinning (1 thread each, RAYON_NUM_THREADS=1):
#   device (`tandem generate --verifier --split s`, draft + target [0, s)) -> core 0
#   verifier (`tandem serve-verifier`, target [s, N))                       -> core 1
#   netsim proxies                                                          -> core 1
#   the profile is measured on core 0 (server_speed = 1: same cores)
#
# Usage: scripts/split_table.sh [SPLITS ("0 7 14 21 28")] [MAX_TOKENS (32)]
# Env: TANDEM_BIN (default target/debug/tandem; the dev profile is opt-level 3),
#      PROFILE (a target profile JSON; measured first when missing),
#      REPROFILE=1 (measure the profile again right before each network's runs,
#      so a shared machine's drifting load hits prediction and measurement alike),
#      PIN_HEAD=1 (U-shape), K (4), NETS ("lan fast-4g"; `direct` = no proxy).
# Prints a markdown table on stdout, progress on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${TANDEM_BIN:-target/debug/tandem}
SPLITS=${1:-"0 7 14 21 28"}
TOKENS=${2:-32}
K=${K:-4}
NETS=${NETS:-"lan fast-4g"}
PIN=${PIN_HEAD:-0}
[ -x "$BIN" ] || { echo "build first: cargo build -p tandem ($BIN missing)" >&2; exit 1; }
for c in jq taskset; do command -v $c >/dev/null || { echo "needs $c" >&2; exit 1; }; done

tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
export RAYON_NUM_THREADS=1
PROMPT="Write a Rust function that returns the larger of two i32 values."

PROFILE=${PROFILE:-$tmp/target.profile.json}
measure_profile() {
  echo "profiling the target on core 0 ..." >&2
  taskset -c 0 "$BIN" profile --model target --threads 1 --context 48 --blocks 1,$((K + 1)) \
    --repeats 5 --out "$PROFILE" >&2
}
[ -f "$PROFILE" ] || measure_profile

TOKEN=split-table-token-0123456789
printf '%s\n' "$TOKEN" > "$tmp/token"
cat > "$tmp/verifier.toml" <<TOML
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
insecure_loopback = true
[limits]
max_message_bytes = 16777216
[[devices]]
id = "bench"
token = "$TOKEN"
TOML

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

# The link the model assumes = the netsim profile's numbers.
link() { "$BIN" netsim --list | awk -v p="$1" '$1 == p { print $2, $3, $4 }'; }

med() { jq -s 'sort | if length == 0 then null elif length % 2 == 1 then .[length/2|floor] else (.[length/2-1] + .[length/2]) / 2 end'; }

pin_flag=()
[ "$PIN" = 1 ] && pin_flag=(--pin-head)
echo "| network | s | head | predicted ms (device + network + server) | measured ms median (device + rest) | error | rounds |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
for net in $NETS; do
  if [ "$net" = direct ]; then
    # No proxy: the edge talks to the verifier directly (the model's link: 0 ms, 10 Gbit/s).
    rtt=0; down=10000; up=10000; addr=${grpc#http://}
  else
    read -r rtt down up <<<"$(link "$net")"
    start_bg "listening on" "$tmp/n-$net.out" taskset -c "${NETSIM_CORE:-1}" "$BIN" netsim --listen 127.0.0.1:0 --upstream "$grpc" --profile "$net"
    addr=$(sed -n 's/^listening on //p' "$tmp/n-$net.out")
  fi
  [ "${REPROFILE:-0}" = 1 ] && measure_profile
  cat > "$tmp/edge-$net.toml" <<TOML
token = "$TOKEN"
open_timeout_ms = 120000
deadline_initial_ms = 60000
deadline_max_ms = 60000
[split]
up_mbps = $up
down_mbps = $down
initial_rtt_ms = $rtt
server_speed = 1.0
TOML
  for s in $SPLITS; do
    echo "$net s=$s ..." >&2
    taskset -c 0 "$BIN" generate --json --no-privacy-router --k "$K" --max-tokens "$TOKENS" \
      --verifier "http://$addr" --edge-config "$tmp/edge-$net.toml" --split "$s" "${pin_flag[@]}" \
      --split-profile "$PROFILE" --prompt "$PROMPT" > "$tmp/g.json" 2> "$tmp/g.err" \
      || { cat "$tmp/g.err" >&2; exit 1; }
    sp=$(jq '.stats.split' "$tmp/g.json")
    # Round 0 includes the first use of the connection after the prefill: skip it.
    m=$(jq '.round_ms[1:][]' <<<"$sp" | med)
    md=$(jq '.device_ms[1:][]' <<<"$sp" | med)
    p=$(jq '.predicted_round_ms' <<<"$sp")
    pd=$(jq '.predicted_device_ms' <<<"$sp")
    pn=$(jq '.predicted_network_ms' <<<"$sp")
    ps=$(jq '.predicted_server_ms' <<<"$sp")
    n=$(jq '.round_ms | length' <<<"$sp")
    head=$([ "$PIN" = 1 ] && echo device || echo server)
    printf '| %s | %s | %s | %.0f (%.0f + %.0f + %.0f) | %.0f (%.0f + %.0f) | %+.0f %% | %s |\n' \
      "$net" "$s" "$head" "$p" "$pd" "$pn" "$ps" "$m" "$md" "$(jq -n "$m - $md")" \
      "$(jq -n "($m - $p) / $p * 100")" "$n"
  done
done
echo
echo "load average before: $load_before; after: $(cut -d' ' -f1-3 /proc/loadavg) (2 cores)"
