#!/usr/bin/env bash
# Prediction vs reality for split execution (docs/shard-planner.md): for several
# split points s and netsim `lan` / `fast-4g`, the cost model's per-round time
# (from `tandem profile`s of the target + the planner's evaluation of that split,
# as reported by the edge in stats.split.predicted_*) next to the measured one
# (stats.split.round_ms: device layers [0, s) + exchange + local head if pinned),
# and the measured round split into device compute (stats.split.device_ms),
# server compute (the verifier's own clock: its `split round computed` debug
# log) and the rest (network + gRPC + per-round bookkeeping).
#
# Pinning (1 thread each, RAYON_NUM_THREADS=1):
#   device (`tandem generate --verifier --split s`, draft + target [0, s)) -> core 0
#   verifier (`tandem serve-verifier`, target [s, N))                       -> core 1
#   netsim proxies                                                          -> core 1
# Calibration (EdgeShard: every node gets a *measured* profile): the device's
# profile is measured on core 0, the server's on core 1 ([split] server_profile);
# [split] round_overhead_ms is the measured fixed cost of one exchange (OVERHEAD_MS).
#
# Usage: scripts/split_table.sh [SPLITS ("0 7 14 21 28")] [MAX_TOKENS (32)]
# Env: TANDEM_BIN (default target/debug/tandem; the dev profile is opt-level 3),
#      PROFILE / SERVER_PROFILE (target profile JSONs of core 0 / core 1; measured
#      first when missing; SERVER_PROFILE=none: server = device profile, speed 1),
#      REPROFILE=1 (measure both profiles again right before each network's runs,
#      so a shared machine's drifting load hits prediction and measurement alike;
#      REPROFILE=each: before every split point),
#      OVERHEAD_MS (per-round fixed cost in the model, ms; default 0; `auto`:
#      measured first with a direct round trip at s = CAL_SPLIT (14)),
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
SERVER_PROFILE=${SERVER_PROFILE:-$tmp/server.profile.json}
OVERHEAD_MS=${OVERHEAD_MS:-0}
profile_on() {
  echo "profiling the target on core $1 ..." >&2
  taskset -c "$1" "$BIN" profile --model target --threads 1 --context 48 --blocks 1,$((K + 1)) \
    --repeats 5 --out "$2" >&2
}
measure_profile() {
  profile_on 0 "$PROFILE"
  [ "$SERVER_PROFILE" = none ] || profile_on 1 "$SERVER_PROFILE"
}
if [ ! -f "$PROFILE" ]; then profile_on 0 "$PROFILE"; fi
if [ "$SERVER_PROFILE" != none ] && [ ! -f "$SERVER_PROFILE" ]; then
  profile_on 1 "$SERVER_PROFILE"
fi

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
# The verifier logs each split round's compute (its own clock) on stderr.
TANDEM_LOG=tandem_verifier::split=debug \
  start_bg "serving grpc=" "$tmp/v.out" taskset -c 1 "$BIN" serve-verifier --config "$tmp/verifier.toml"
grpc=$(sed -n 's/.*grpc=\([^ ]*\).*/\1/p' "$tmp/v.out")

# The link the model assumes = the netsim profile's numbers.
link() { "$BIN" netsim --list | awk -v p="$1" '$1 == p { print $2, $3, $4 }'; }

med() { jq -s 'sort | if length == 0 then null elif length % 2 == 1 then .[length/2|floor] else (.[length/2-1] + .[length/2]) / 2 end'; }

pin_flag=()
[ "$PIN" = 1 ] && pin_flag=(--pin-head)
head=$([ "$PIN" = 1 ] && echo device || echo server)

# edge_config FILE RTT DOWN UP OVERHEAD: the [split] link = the network's numbers.
edge_config() {
  {
    printf 'token = "%s"\nopen_timeout_ms = 120000\ndeadline_initial_ms = 60000\n' "$TOKEN"
    printf 'deadline_max_ms = 60000\n[split]\nup_mbps = %s\ndown_mbps = %s\ninitial_rtt_ms = %s\n' "$4" "$3" "$2"
    [ "$SERVER_PROFILE" = none ] || printf 'server_profile = "%s"\n' "$SERVER_PROFILE"
    printf 'round_overhead_ms = %s\n' "$5"
  } > "$1"
}

# run_split ADDR EDGE_TOML S: one generation; sets m md mn ms (measured medians of
# rounds 2.., ms) and p pd pn ps (predicted), n (rounds).
run_split() {
  local vlines sp srv
  vlines=$(wc -l < "$tmp/v.out.err")
  taskset -c 0 "$BIN" generate --json --no-privacy-router --k "$K" --max-tokens "$TOKENS" \
    --verifier "http://$1" --edge-config "$2" --split "$3" "${pin_flag[@]}" \
    --split-profile "$PROFILE" --prompt "$PROMPT" > "$tmp/g.json" 2> "$tmp/g.err" \
    || { cat "$tmp/g.err" >&2; exit 1; }
  sp=$(jq '.stats.split' "$tmp/g.json")
  # Server compute of each exchanged round, from the verifier's log of this run
  # (all-local rounds have none).
  srv=$(tail -n +"$((vlines + 1))" "$tmp/v.out.err" | sed 's/\x1b\[[0-9;]*m//g' \
    | sed -n 's/.*split round computed.*server_ms=\([0-9.]*\).*/\1/p' | jq -s .)
  # Round 0 includes the first use of the connection after the prefill: skip it.
  m=$(jq '.round_ms[1:][]' <<<"$sp" | med)
  md=$(jq '.device_ms[1:][]' <<<"$sp" | med)
  ms=$(jq '.[1:][]' <<<"$srv" | med)
  [ "$ms" = null ] && ms=0
  # Network (+ per-round overhead): per round, round - device - server, when
  # every round was exchanged (the log has one line per round), else medians.
  mn=$(jq --argjson srv "$srv" 'if ($srv | length) == (.round_ms | length) then
         [range(1; .round_ms | length) as $i | .round_ms[$i] - .device_ms[$i] - $srv[$i]][]
       else empty end' <<<"$sp" | med)
  [ "$mn" = null ] && mn=$(jq -n "$m - $md - $ms")
  p=$(jq '.predicted_round_ms' <<<"$sp")
  pd=$(jq '.predicted_device_ms' <<<"$sp")
  pn=$(jq '.predicted_network_ms' <<<"$sp")
  ps=$(jq '.predicted_server_ms' <<<"$sp")
  n=$(jq '.round_ms | length' <<<"$sp")
}

if [ "$OVERHEAD_MS" = auto ]; then
  # The fixed cost of one exchange, measured without a simulated network: the
  # edge talks to the verifier directly at s = CAL_SPLIT; per round, round time
  # minus device compute minus the verifier's own compute.
  edge_config "$tmp/edge-cal.toml" 0 10000 10000 0
  run_split "${grpc#http://}" "$tmp/edge-cal.toml" "${CAL_SPLIT:-14}"
  OVERHEAD_MS=$(jq -n "$mn | if . < 0 then 0 else . end")
  echo "measured round overhead (direct, s = ${CAL_SPLIT:-14}): $OVERHEAD_MS ms" >&2
fi

echo "| network | s | head | predicted ms (device + network + server) | measured ms median (device + network + server) | error | rounds |"
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
  edge_config "$tmp/edge-$net.toml" "$rtt" "$down" "$up" "$OVERHEAD_MS"
  for s in $SPLITS; do
    echo "$net s=$s ..." >&2
    [ "${REPROFILE:-0}" = each ] && measure_profile
    run_split "$addr" "$tmp/edge-$net.toml" "$s"
    printf '| %s | %s | %s | %.0f (%.0f + %.0f + %.0f) | %.0f (%.0f + %.0f + %.0f) | %+.0f %% | %s |\n' \
      "$net" "$s" "$head" "$p" "$pd" "$pn" "$ps" "$m" "$md" "$mn" "$ms" \
      "$(jq -n "($m - $p) / $p * 100")" "$n"
  done
done
echo
echo "round_overhead_ms = $OVERHEAD_MS; server profile: $([ "$SERVER_PROFILE" = none ] && echo "none (server = device profile)" || echo "measured on core 1")"
echo
echo "load average before: $load_before; after: $(cut -d' ' -f1-3 /proc/loadavg) (2 cores)"
