#!/usr/bin/env bash
# Runs every fuzz target of fuzz/ for a bounded time (issue #16 item 6; not part of CI).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     default: 60 s, every target
#
# With nightly Rust and cargo-fuzz (`cargo install cargo-fuzz`), the libFuzzer targets run
# with coverage feedback and sanitizers; otherwise the stable mutation runner
# (fuzz/src/bin/smoke.rs) runs the same target bodies. Either way a crash leaves its
# input in fuzz/artifacts/<target>/ and the script exits non-zero: make it a regression
# test (tests/all/untrusted_files.rs, input in tests/fixtures/fuzz/) and fix the cause.
# LONGCTX_FUZZ_ENGINE=smoke forces the stable runner.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
shift || true
all=(safetensors_header safetensors_index config_json tokenizer_json dataset_jsonl dataset_text dataset_parquet dataset_tokens dataset_arrow dataset_jsonl_compressed checkpoint_state)
if [[ $# -gt 0 ]]; then targets=("$@"); else targets=("${all[@]}"); fi

engine="${LONGCTX_FUZZ_ENGINE:-}"
if [[ -z "$engine" ]]; then
  if cargo +nightly fuzz --version >/dev/null 2>&1; then engine=libfuzzer; else engine=smoke; fi
fi
echo "fuzz: engine $engine, ${secs} s per target: ${targets[*]}"

failed=()
# The stable runner also writes each target's valid seed inputs (libFuzzer starts from them).
# The main workspace's target directory: the library is already built there.
CARGO_TARGET_DIR="$PWD/target" cargo build --manifest-path fuzz/Cargo.toml --bin smoke
if [[ "$engine" == libfuzzer ]]; then
  cargo +nightly fuzz build --features libfuzzer -O
  for t in "${targets[@]}"; do
    target/debug/smoke "$t" --write-seeds "fuzz/corpus/$t"
    if ! cargo +nightly fuzz run --features libfuzzer -O "$t" "fuzz/corpus/$t" -- -max_total_time="$secs" -rss_limit_mb=4096 -timeout=20; then
      failed+=("$t")
    fi
  done
else
  for t in "${targets[@]}"; do
    if ! target/debug/smoke "$t" "$secs"; then failed+=("$t"); fi
  done
fi
if (( ${#failed[@]} )); then
  echo "fuzz: crashes in ${failed[*]} (inputs in fuzz/artifacts/)" >&2
  exit 1
fi
echo "fuzz: no crash"
