#!/usr/bin/env bash
# One GPU-machine call (issue 26): the 7B block in fp16 and bf16 built there, then relaxtune against torch
# eager and every torch.compile mode (interleaved) with the bandwidth floor, then the gpu-marked tests.
# PROLOGUE_AB=1 also builds each dtype's block without the GEMV prologues (fuse_gemv_prologue_cuda.py) and times
# the two at n = 1 in turns, with the floor and each one's ratio to it; for fp16 also both without CUDA graphs,
# each kernel timed (the fused GEMVs against the plain ones plus the norm / SwiGLU kernels).
# MODES=0 leaves out torch.compile (its modes and eager; the latency table keeps eager).
#   [PROLOGUE_AB=1] [MODES=0] bash benchmarks/gpu_7b_modes.sh OUT [fp16|bf16|both] [tests]
set -uo pipefail
out=${1:?usage: gpu_7b_modes.sh OUT [fp16|bf16|both] [tests]}
which=${2:-both}
mkdir -p "$out"
site=$(bash scripts/device_install.sh) || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1
art=/tmp/gj7b
only=""
[[ $which != bf16 ]] && only+="llama7b-rf-cublas-flash-graph,"
[[ $which != fp16 ]] && only+="llama7b-bf16-rf-cublas-flash-graph,"
ab=${PROLOGUE_AB:-0}
if [[ $ab == 1 ]]; then
  [[ $which != bf16 ]] && only+="llama7b-rf-cublas-flash-noprologue-graph,llama7b-rf-cublas-flash,"
  [[ $which != bf16 ]] && only+="llama7b-rf-cublas-flash-noprologue,"
  [[ $which != fp16 ]] && only+="llama7b-bf16-rf-cublas-flash-noprologue-graph,"
fi
start=$SECONDS
python3 benchmarks/gpu_job.py build --art "$art" --only "${only%,}" 2>&1 | tail -5
echo "built in $((SECONDS - start)) s"
skip=flash,gemv,tiny,runtime,compile
[[ $which == bf16 ]] && skip+=,fp16
[[ $ab != 1 ]] && skip+=,prologue,kernels
[[ ${MODES:-1} == 0 ]] && skip+=,modes
python3 benchmarks/gpu_job.py run --art "$art" --out "$out" --skip "$skip" 2>&1 | grep -v "^\s*$" | tail -60
echo "ran in $((SECONDS - start)) s"
if [[ ${3:-} == tests ]]; then
  (cd "$(mktemp -d)" && python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$OLDPWD" "$OLDPWD/tests/kernels" \
    2>&1 | tail -15)
fi
