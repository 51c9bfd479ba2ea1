#!/usr/bin/env bash
# Runs every cargo-fuzz target for a bounded time (docs/fuzzing.md).
#
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET (30)] [TARGET ...]
# Needs the nightly toolchain and cargo-fuzz (`cargo install --locked cargo-fuzz`).
# Env: TANDEM_FUZZ_TOKENIZER  a GGUF whose tokenizer `tokenizer_roundtrip` uses
#                             (default: the tiny test vocabulary)
#      CARGO_TARGET_DIR       (default fuzz/target)
# Each target starts from its committed seeds (fuzz/seeds/<target>) plus the
# working corpus fuzz/corpus/<target> (gitignored, kept between runs). A crash
# stops the run with libFuzzer's report; the input is in fuzz/artifacts/<target>.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
SECS=${1:-30}
shift || true
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
  TARGETS=(gguf_load tokenizer_roundtrip policy_toml netsim_timeline router_classify openai_request)
fi
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}

t0=$(date +%s)
cargo +nightly fuzz build
echo "== fuzz build: $(( $(date +%s) - t0 ))s" >&2
for t in "${TARGETS[@]}"; do
  mkdir -p "corpus/$t"
  echo "== fuzz $t for ${SECS}s" >&2
  # -timeout: one input taking over 10 s is a hang; -rss_limit_mb: an input
  # that allocates beyond what any sane file backs is a finding.
  log="corpus/$t.log"
  status=0
  cargo +nightly fuzz run "$t" "corpus/$t" "seeds/$t" -- \
    -max_total_time="$SECS" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
    >"$log" 2>&1 || status=$?
  grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb)' "$log" >&2 || true
  if [ "$status" -ne 0 ]; then
    tail -n 60 "$log" >&2
    echo "fuzz target $t failed (exit $status); the input is in fuzz/artifacts/$t" >&2
    exit 1
  fi
done
echo "== fuzz total: $(( $(date +%s) - t0 ))s" >&2
