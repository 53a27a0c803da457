#!/usr/bin/env bash
# One GPU-machine call (issue 26): the q4f16 7B block with its decode MLP as one kernel (relaxtune_q4mlp_i8,
# FuseQuantMlpCuda: the default) against the same block with o_proj .. down as five kernels (CudaLibraries(q4_mlp=
# False)), built there and timed in turns at n = 1 / 128 with each kernel of both at n = 1 (gpu_ab_builds.py --q4);
# then the gpu-marked 4-bit tests (the fused kernel against its int8 reference, the one-row block both ways).
#   bash benchmarks/gpu_q4_mlp.sh OUT [notests]
set -uo pipefail
out=${1:?usage: gpu_q4_mlp.sh OUT [notests]}
mkdir -p "$out"
site=$(bash scripts/device_install.sh) || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1
start=$SECONDS
art=/tmp/gjmlp
timeout 300 python3 benchmarks/gpu_job.py build --art "$art" --only llama7b-q4-rf-cublas-flash-graph,\
llama7b-q4-rf-cublas-flash,llama7b-q4-nomlp-rf-cublas-flash-graph,llama7b-q4-nomlp-rf-cublas-flash 2>&1 | tail -5
echo "built in $((SECONDS - start)) s"
timeout 240 python3 benchmarks/gpu_ab_builds.py --q4 --variant llama7b-q4-rf-cublas-flash-graph \
  --plain llama7b-q4-rf-cublas-flash --build mlp="$art" --build five="$art":llama7b-q4-nomlp-rf-cublas-flash-graph \
  --seqs 1,128 --rounds 9 --out "$out/ab" 2>&1 | grep -v "^\s*$" | tail -45
echo "timed in $((SECONDS - start)) s"
if [[ " $* " != *" notests "* ]]; then
  (cd "$(mktemp -d)" && timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$OLDPWD" \
    "$OLDPWD/tests/kernels/test_gpu_qgemv.py" -k "q4mlp or one_row or block" 2>&1 | tail -15)
  echo "tested in $((SECONDS - start)) s"
fi
