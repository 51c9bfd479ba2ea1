#!/usr/bin/env bash
# Builds every fuzz target and runs each for a bounded time (docs/fuzzing.md).
#
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET (30)] [TARGET ...]
#        scripts/fuzz.sh build     only build (CI starts this early, at low priority)
# Needs the nightly toolchain (AddressSanitizer) and a C++ compiler (libFuzzer,
# built by libfuzzer-sys). It builds the targets the way `cargo fuzz build`
# does (the same coverage and sanitizer flags, release with debug assertions
# and overflow checks) without needing the cargo-fuzz binary, so CI does not
# spend minutes installing it; `cargo +nightly fuzz run TARGET` works on the
# same sources.
# Env: TANDEM_FUZZ_TOKENIZER  a GGUF whose tokenizer `tokenizer_roundtrip` uses
#                             (default: the tiny test vocabulary)
#      CARGO_TARGET_DIR       (default fuzz/target)
#      TANDEM_FUZZ_SANITIZER  address (default) or none (stable-compatible flags)
#      TANDEM_FUZZ_JOBS       targets run at once (default: the CPUs; each run
#                             is one thread, so each still gets SECONDS of a core)
# Each target starts from its committed seeds (fuzz/seeds/<target>) plus the
# working corpus fuzz/corpus/<target> (gitignored, kept between runs). A crash
# stops the run with libFuzzer's report; the input is in fuzz/artifacts/<target>.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
BUILD_ONLY=
if [ "${1:-}" = build ]; then BUILD_ONLY=1; shift; fi
SECS=${1:-30}
shift || true
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
  TARGETS=(gguf_load tokenizer_roundtrip policy_toml netsim_timeline router_classify
           openai_request verifier_messages edge_server_messages)
fi
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
HOST=$(rustc +nightly -vV | sed -n 's/^host: //p')
flags="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4"
flags+=" -Cllvm-args=-sanitizer-coverage-inline-8bit-counters"
flags+=" -Cllvm-args=-sanitizer-coverage-pc-table"
flags+=" -Cllvm-args=-sanitizer-coverage-trace-compares"
flags+=" --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
case "${TANDEM_FUZZ_SANITIZER:-address}" in
  address) flags+=" -Zsanitizer=address" ;;
  none) ;;
  *) echo "TANDEM_FUZZ_SANITIZER must be address or none" >&2; exit 2 ;;
esac

t0=$(date +%s)
RUSTFLAGS="$flags" RUSTDOCFLAGS="$flags" \
  cargo +nightly build --release --target "$HOST" --bins
echo "== fuzz build: $(( $(date +%s) - t0 ))s" >&2
if [ -n "$BUILD_ONLY" ]; then exit 0; fi
bin="$CARGO_TARGET_DIR/$HOST/release"
# One target's run; a crash prints libFuzzer's report and returns non-zero.
run_target() {
  local t=$1 log="corpus/$1.log" status=0
  mkdir -p "corpus/$t" "artifacts/$t"
  echo "== fuzz $t for ${SECS}s" >&2
  # -timeout: one input taking over 10 s is a hang; -rss_limit_mb: an input
  # that allocates beyond what any sane file backs is a finding.
  "$bin/$t" "corpus/$t" "seeds/$t" \
    -artifact_prefix="artifacts/$t/" \
    -max_total_time="$SECS" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
    >"$log" 2>&1 || status=$?
  grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb)' "$log" | sed "s/^/$t: /" >&2 || true
  if [ "$status" -ne 0 ]; then
    tail -n 60 "$log" >&2
    echo "fuzz target $t failed (exit $status); the input is in fuzz/artifacts/$t" >&2
    return 1
  fi
}
# Each libFuzzer run is one thread: TANDEM_FUZZ_JOBS targets at a time (default:
# the CPUs), so every target still gets its SECS of one core.
jobs=${TANDEM_FUZZ_JOBS:-$(nproc)}
pids=()
failed=0
for t in "${TARGETS[@]}"; do
  if [ ${#pids[@]} -ge "$jobs" ]; then
    wait "${pids[0]}" || failed=1
    pids=("${pids[@]:1}")
  fi
  run_target "$t" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || failed=1; done
if [ "$failed" -ne 0 ]; then
  echo "a fuzz target failed (its report is above)" >&2
  exit 1
fi
echo "== fuzz total: $(( $(date +%s) - t0 ))s" >&2
