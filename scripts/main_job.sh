#!/usr/bin/env bash
# The main job on the built-in default: tune -> cache -> compile -> export -> run -> compare.
# Sized for a 2-core machine (about 8 minutes); TRIALS, WORKLOAD and SHAPES override it.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKLOAD=${WORKLOAD:-llama-block}
TRIALS=${TRIALS:-128}
SHAPES=${SHAPES:-n=1,32,128,512}
CACHE=${CACHE:-tuning_logs}
OUT=${OUT:-build}

relaxtune tune "$WORKLOAD" --target cpu --trials "$TRIALS" --cache "$CACHE" --json "$OUT/$WORKLOAD-tune.json"
relaxtune compile "$WORKLOAD" --target cpu --cache "$CACHE" -o "$OUT/$WORKLOAD.so"
relaxtune run "$OUT/$WORKLOAD.so" --shape b=1 --shape n=128
relaxtune bench "$WORKLOAD" --target cpu --cache "$CACHE" --shape "$SHAPES" --out "$OUT/bench" --json "$OUT/$WORKLOAD-bench.json"
