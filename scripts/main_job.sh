#!/usr/bin/env bash
# The main job on the built-in default: tune -> cache -> compile -> export -> run -> compare.
# Sized for a 2-core machine (under 10 minutes): four shape buckets instead of the default eleven.
# TRIALS, WORKLOAD, SHAPES and BUCKETS override it (BUCKETS="" for the default power-of-two plan).
set -euo pipefail
cd "$(dirname "$0")/.."
WORKLOAD=${WORKLOAD:-llama-block}
TRIALS=${TRIALS:-128}
SHAPES=${SHAPES:-n=1,32,128,512}
CACHE=${CACHE:-tuning_logs}
OUT=${OUT:-build}
BUCKETS=${BUCKETS-n=1,16,128,1024}
B=()
[[ -n "$BUCKETS" ]] && B=(--buckets "$BUCKETS")

relaxtune tune "$WORKLOAD" --target cpu --trials "$TRIALS" --cache "$CACHE" "${B[@]}" --json "$OUT/$WORKLOAD-tune.json"
relaxtune compile "$WORKLOAD" --target cpu --cache "$CACHE" "${B[@]}" -o "$OUT/$WORKLOAD.so"
relaxtune run "$OUT/$WORKLOAD.so" --shape b=1 --shape n=128
relaxtune bench "$WORKLOAD" --target cpu --cache "$CACHE" "${B[@]}" --shape "$SHAPES" --out "$OUT/bench" --json "$OUT/$WORKLOAD-bench.json"
