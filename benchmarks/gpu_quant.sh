#!/usr/bin/env bash
# One GPU-machine call (issues 24/26): the Llama-7B-sized block with 4-bit projections (--quantize q4f16, groups of
# 32) built there, then the 4-bit GEMV kernel alone and the block at n = 1 / 128 against the floor for its bytes and
# against torch on the same weights dequantized, then the gpu-marked 4-bit tests (tests/kernels/test_gpu_qgemv.py).
#   bash benchmarks/gpu_quant.sh OUT [tests]
set -uo pipefail
out=${1:?usage: gpu_quant.sh OUT [tests]}
mkdir -p "$out"
site=$(bash scripts/device_install.sh) || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1
art=/tmp/gjq4
start=$SECONDS
python3 benchmarks/gpu_job.py build --art "$art" --only llama7b-q4-rf-cublas-flash-graph,llama7b-q4-rf-cublas-flash \
  2>&1 | tail -5
echo "built in $((SECONDS - start)) s"
python3 benchmarks/gpu_job.py run --art "$art" --out "$out" --seqs 1,128 \
  --skip flash,gemv,tiny,kernels,runtime,compile,modes,fp16 2>&1 | grep -v "^\s*$" | tail -60
echo "ran in $((SECONDS - start)) s"
if [[ ${2:-} == tests ]]; then
  (cd "$(mktemp -d)" && python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$OLDPWD" \
    "$OLDPWD/tests/kernels/test_gpu_qgemv.py" "$OLDPWD/tests/kernels/test_gpu_q4mlp.py" 2>&1 | tail -15)
fi
