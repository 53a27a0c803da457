#!/usr/bin/env bash
# One GPU-machine call (issue 26): the fp16 and bf16 7B blocks built there with the n = 1 attention as o_proj's
# prologue (the default, FuseAttentionGemvCuda) and without it (CudaLibraries(gemv_attention=False): the flash
# kernel), timed at n = 1 in turns with the bandwidth floor, each build as several VMs (each loads its own weights;
# VMs of one artifact differ by up to ~2 us); each kernel of the default fp16 build without graphs; then the
# gpu-marked kernel tests, among them the new kernel against torch and the fp16 / bf16 block artifacts at every bucket.
#   bash benchmarks/gpu_attn_gemv.sh OUT [notests]
set -uo pipefail
out=${1:?usage: gpu_attn_gemv.sh OUT [notests]}
mkdir -p "$out"
site=$(bash scripts/device_install.sh) || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1
start=$SECONDS
art=/tmp/gjattn
timeout 300 python3 benchmarks/gpu_job.py build --art "$art" --only llama7b-rf-cublas-flash-graph,llama7b-rf-cublas-flash,\
llama7b-rf-cublas-flash-noattn-graph,llama7b-bf16-rf-cublas-flash-graph,llama7b-bf16-rf-cublas-flash-noattn-graph \
  2>&1 | tail -2
echo "built in $((SECONDS - start)) s"
builds=()
for i in 1 2 3; do builds+=(--build "attn$i=$art" --build "flash$i=$art:llama7b-rf-cublas-flash-noattn-graph"); done
timeout 200 python3 benchmarks/gpu_ab_builds.py "${builds[@]}" --seqs 1,128 --rounds 11 --out "$out/fp16" 2>&1 |
  grep -v "^\s*$" | grep -v "compute_symbolic\|assert_op" | tail -24
echo "timed fp16 in $((SECONDS - start)) s"
builds=()
for i in 1 2; do builds+=(--build "attn$i=$art" --build "flash$i=$art:llama7b-bf16-rf-cublas-flash-noattn-graph"); done
timeout 120 python3 benchmarks/gpu_ab_builds.py --dtype bfloat16 --variant llama7b-bf16-rf-cublas-flash-graph \
  --plain none "${builds[@]}" --seqs 1 --rounds 9 --out "$out/bf16" 2>&1 | grep -v "^\s*$" | tail -5
echo "timed bf16 in $((SECONDS - start)) s"
if [[ " $* " != *" notests "* ]]; then
  (cd "$(mktemp -d)" && timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$OLDPWD" \
    "$OLDPWD/tests/kernels/test_gpu_kernels.py" 2>&1 | tail -5)
  echo "tested in $((SECONDS - start)) s"
fi
