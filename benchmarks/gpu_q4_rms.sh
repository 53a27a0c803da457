#!/usr/bin/env bash
# One GPU-machine call (issue 26): the q4f16 7B block built there with the q/k/v RMSNorm as the int8 4-bit GEMV's
# prologue (relaxtune_q4gemv_i8_rms, the default) and without it (CudaLibraries(gemv_prologue=False): the norm's own
# kernel), timed at n = 1 / 128 in turns with the floor of the block's 4-bit bytes, two VMs of each, each kernel of
# the default build at n = 1 without graphs; then the gpu-marked 4-bit tests and the language models' on the GPU.
#   bash benchmarks/gpu_q4_rms.sh OUT [notests]
set -uo pipefail
out=${1:?usage: gpu_q4_rms.sh OUT [notests]}
mkdir -p "$out"
site=$(bash scripts/device_install.sh) || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1
start=$SECONDS
art=/tmp/gjq4rms
timeout 300 python3 benchmarks/gpu_job.py build --art "$art" --only llama7b-q4-rf-cublas-flash-graph,\
llama7b-q4-rf-cublas-flash,llama7b-q4-noprologue-rf-cublas-flash-graph 2>&1 | tail -2
echo "built in $((SECONDS - start)) s"
builds=()
for i in 1 2; do builds+=(--build "rms$i=$art" --build "norm$i=$art:llama7b-q4-noprologue-rf-cublas-flash-graph"); done
timeout 200 python3 benchmarks/gpu_ab_builds.py --q4 --variant llama7b-q4-rf-cublas-flash-graph \
  --plain llama7b-q4-rf-cublas-flash "${builds[@]}" --seqs 1,128 --rounds 9 --out "$out/ab" 2>&1 |
  grep -v "^\s*$" | grep -v "compute_symbolic\|assert_op" | tail -30
echo "timed in $((SECONDS - start)) s"
if [[ " $* " != *" notests "* ]]; then
  (cd "$(mktemp -d)" && timeout 250 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$OLDPWD" \
    "$OLDPWD/tests/kernels/test_gpu_qgemv.py" "$OLDPWD/tests/models/test_llm_cuda.py" 2>&1 | tail -6)
  echo "tested in $((SECONDS - start)) s"
fi
