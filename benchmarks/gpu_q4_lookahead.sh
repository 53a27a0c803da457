#!/usr/bin/env bash
# One GPU-machine call (issue 26): the fused 4-bit decode MLP kernel's L2 lookahead (RELAXTUNE_Q4MLP_LOOKAHEAD: slots
# of weights the producer keeps prefetched into L2 past its ring) traced per step at several depths, then the q4f16
# 7B block built there and timed at n = 1 / 128 in turns at depths 0 / 4 / 8 (one artifact, the depth set per build
# label while its graphs are captured; two VMs of each), then the gpu-marked 4-bit tests and the language models'.
#   bash benchmarks/gpu_q4_lookahead.sh OUT [notests]
set -uo pipefail
out=${1:?usage: gpu_q4_lookahead.sh OUT [notests]}
mkdir -p "$out"
site=$(bash scripts/device_install.sh) || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1
start=$SECONDS
timeout 150 python3 benchmarks/q4mlp_trace.py --out "$out/tr" --variants h1f4-la0,h1f4-la2,h1f4-la4,h1f4-la8,h1f4-la16,h1f4-la0 \
  2>&1 | tail -14
echo "traced in $((SECONDS - start)) s"
art=/tmp/gjq4la
timeout 300 python3 benchmarks/gpu_job.py build --art "$art" --only llama7b-q4-rf-cublas-flash-graph,\
llama7b-q4-rf-cublas-flash 2>&1 | tail -2
echo "built in $((SECONDS - start)) s"
builds=() envs=()
for i in 1 2; do
  for d in 0 4 8; do builds+=(--build "la$d-$i=$art"); envs+=(--env "la$d-$i:RELAXTUNE_Q4MLP_LOOKAHEAD=$d"); done
done
timeout 200 python3 benchmarks/gpu_ab_builds.py --q4 --variant llama7b-q4-rf-cublas-flash-graph \
  --plain llama7b-q4-rf-cublas-flash "${builds[@]}" "${envs[@]}" --seqs 1,128 --rounds 9 --out "$out/ab" 2>&1 |
  grep -v "^\s*$" | grep -v "compute_symbolic\|assert_op" | tail -24
echo "timed in $((SECONDS - start)) s"
if [[ " $* " != *" notests "* ]]; then
  (cd "$(mktemp -d)" && timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$OLDPWD" \
    "$OLDPWD/tests/kernels/test_gpu_qgemv.py" "$OLDPWD/tests/models/test_llm_cuda.py" -k "q4mlp or one_row or block or llm" \
    2>&1 | tail -6)
  echo "tested in $((SECONDS - start)) s"
fi
