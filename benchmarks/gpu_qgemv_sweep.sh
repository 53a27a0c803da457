#!/usr/bin/env bash
# One GPU-machine call (issue 26): the 4-bit GEMV's kernel variants (qgemv.cu's register kernel, qgemv_stream.cu's
# families and ring depths) checked against torch and timed side by side on the 7B block's shapes at 1 and 2 rows
# (benchmarks/qgemv_sweep.py: a table, and OUT/qgemv_sweep.json), then the gpu-marked 4-bit tests
# (tests/kernels/test_gpu_qgemv.py: every family against torch, the q4f16 llama blocks); with `block`, also
# gpu_quant.sh's q4f16 7B block at n = 1 / 128 on the default kernel (about 3 more minutes).
#   bash benchmarks/gpu_qgemv_sweep.sh OUT [block]
set -uo pipefail
out=${1:?usage: gpu_qgemv_sweep.sh OUT [block]}
mkdir -p "$out"
site=$(bash scripts/device_install.sh) || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1
start=$SECONDS
# each step under a time limit: a kernel that never finishes costs its step, not the call
timeout 300 python3 benchmarks/qgemv_sweep.py --out "$out" 2>&1 | grep -v "^\s*$" | tail -60
echo "swept in $((SECONDS - start)) s"
(cd "$(mktemp -d)" && timeout 360 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$OLDPWD" \
  "$OLDPWD/tests/kernels/test_gpu_qgemv.py" "$OLDPWD/tests/kernels/test_gpu_q4mlp.py" 2>&1 | tail -15)
echo "tested in $((SECONDS - start)) s"
if [[ ${2:-} == block ]]; then
  art=/tmp/gjq4
  python3 benchmarks/gpu_job.py build --art "$art" --only llama7b-q4-rf-cublas-flash-graph,llama7b-q4-rf-cublas-flash \
    2>&1 | tail -3
  python3 benchmarks/gpu_job.py run --art "$art" --out "$out" --seqs 1,128 \
    --skip flash,gemv,tiny,kernels,runtime,compile,modes,fp16,q4kernel 2>&1 | grep -v "^\s*$" | tail -40
  echo "block in $((SECONDS - start)) s"
fi
