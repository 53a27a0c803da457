#!/usr/bin/env bash
# One GPU-machine call (issue 26): the fused 4-bit design without its arithmetic (benchmarks/stream_bound.py) beside
# the product on the same device: relaxtune_q4mlp_i8 alone (q4mlp_trace.py), the whole layer's relaxtune_q4block_i8
# alone (q4block_trace.py) and the q4f16 7B block at n = 1 as built (gpu_job.py), in one kernel and with its q/k/v
# GEMV before it, each with its grid barriers, with tagged words instead (RELAXTUNE_Q4MLP_BARRIER=tagged) and with
# each step's tiles claimed too (=claimed), against the floor for its bytes; then stream_bound.png of them all.
#   bash benchmarks/gpu_bound.sh OUT [stream_bound variants] [tests]   # tests: the fused kernels' gpu tests too
set -uo pipefail
out=${1:?usage: gpu_bound.sh OUT [variants] [tests]}
default=split,block,block-stream,block-dyn-stream,block-tag,block-dyn-tag,split-dyn-tag,mlp,mlp-tag,mlp-dyn-tag,qkv
variants=${2:-$default}  # "" too: the default
mkdir -p "$out"
site=$(bash scripts/device_install.sh) || exit 1
export PYTHONPATH=$site:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi -L
root=$PWD
gpu_tests() {  # SECONDS ARGS: pytest -m gpu ARGS from a folder of its own (the checkout's conftest and rootdir, no
  local limit=$1  # cache written), stopped after SECONDS; fails where a test failed or it was stopped
  shift
  (cd "$(mktemp -d)" && timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$root" "$@" 2>&1 |
    tail -4)
}
# first, each grid barrier's outputs against the default's (three minutes at most: a form that hangs or differs is
# left out of the timings below, which would otherwise wait on it for the rest of the call)
syncs="count tagged claimed" traced=h1f4,h1f4-tag,h1f4-claim
if ! gpu_tests 180 "$root/tests/kernels/test_gpu_q4mlp.py" -k every_barrier_gives_the_default; then
  echo "gpu_bound: the tagged or claimed form failed its check: timing the count barrier only"
  syncs=count traced=h1f4
fi
python3 benchmarks/stream_bound.py --out "$out/bound" --variants "$variants" 2>&1 | grep -v "^\s*$" | tail -30
timeout 300 python3 benchmarks/q4mlp_trace.py --out "$out/tr" --variants "$traced" 2>&1 | tail -7
timeout 300 python3 benchmarks/q4block_trace.py --out "$out/blk" --variants "$traced" 2>&1 | tail -6
art=/tmp/gjbound  # the block in one kernel (relaxtune_q4block_i8) and with the q/k/v GEMV before it
python3 benchmarks/gpu_job.py build --art "$art" \
  --only llama7b-q4-rf-cublas-flash-graph,llama7b-q4-noblock-rf-cublas-flash-graph 2>&1 | tail -2
for sync in $syncs; do  # the product's count barrier (the default), tagged words, claimed tiles
  RELAXTUNE_Q4MLP_BARRIER=$sync timeout 300 python3 benchmarks/gpu_job.py run --art "$art" --out "$out/q4-$sync" \
    --seqs 1 --skip flash,gemv,tiny,kernels,runtime,compile,modes,fp16 2>&1 |
    grep -E "q4f16 (floor|block n = 1)|n=1: .*rel err" | sed "s/^/$sync: /"
done
python3 benchmarks/stream_bound.py --out "$out" --plot "$out"  # labelled by the folder and the device
if [ "${3:-}" = tests ]; then  # the fused kernels' gpu tests
  gpu_tests 420 "$root/tests/kernels/test_gpu_q4mlp.py" \
    "$root/tests/kernels/test_gpu_kernels.py::test_gemv_nk_attn_matches_fp32_torch" || echo "gpu_bound: tests failed"
fi
