#!/usr/bin/env bash
# One GPU-machine call (issue 26): the 4-bit GEMV with int8 activations (qgemv_stream.cu's i8 families) against the
# float16-activation kernel, checked and timed side by side on the 7B block's shapes (benchmarks/qgemv_sweep.py), then
# the gpu-marked 4-bit tests; with `block`, the q4f16 7B block built three ways (int8 activations with the q/k/v
# RMSNorm as the GEMV's prologue, the default; without it; float16 activations) and timed in turns at n = 1 / 128
# (benchmarks/gpu_ab_builds.py --q4), with each kernel of the default build at n = 1.
#   bash benchmarks/gpu_int8_gemv.sh OUT [block] [notests]
set -uo pipefail
out=${1:?usage: gpu_int8_gemv.sh OUT [block] [notests]}
mkdir -p "$out"
site=$(bash scripts/device_install.sh) || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1
start=$SECONDS
if [[ " $* " != *" block "* ]]; then
  timeout 300 python3 benchmarks/qgemv_sweep.py --out "$out" \
    --variants s2r4-st2,s2r8-st2,i8s2r4,i8s2r8,i8s1r8,i8s2r4-st4,i8s1r8-st4 2>&1 | grep -v "^\s*$" | tail -40
  echo "swept in $((SECONDS - start)) s"
fi
if [[ " $* " == *" block "* ]]; then
  art=/tmp/gjq4 noprologue=llama7b-q4-noprologue-rf-cublas-flash-graph
  timeout 300 python3 benchmarks/gpu_job.py build --art "$art" \
    --only llama7b-q4-rf-cublas-flash-graph,llama7b-q4-rf-cublas-flash,llama7b-q4-f16act-rf-cublas-flash-graph,\
$noprologue \
    2>&1 | tail -4
  echo "built in $((SECONDS - start)) s"
  timeout 240 python3 benchmarks/gpu_ab_builds.py --q4 --variant llama7b-q4-rf-cublas-flash-graph \
    --plain llama7b-q4-rf-cublas-flash --build int8="$art" --build f16act="$art":llama7b-q4-f16act-rf-cublas-flash-graph \
    --build int8-noprologue="$art:$noprologue" \
    --seqs 1,128 --rounds 9 --out "$out/ab" 2>&1 | grep -v "^\s*$" | tail -45
  echo "timed in $((SECONDS - start)) s"
fi
if [[ " $* " != *" notests "* ]]; then
  (cd "$(mktemp -d)" && timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$OLDPWD" \
    "$OLDPWD/tests/kernels/test_gpu_qgemv.py" "$OLDPWD/tests/kernels/test_gpu_q4mlp.py" 2>&1 | tail -15)
  echo "tested in $((SECONDS - start)) s"
fi
