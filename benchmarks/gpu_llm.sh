#!/usr/bin/env bash
# One GPU-machine call (issue 26): a SmolLM2-sized model with random weights written there, relaxtune's cuda
# build of it (CUDA graphs on and off) against transformers eager / torch.compile / reduce-overhead, then,
# with `tests`, the gpu-marked language-model tests. `--quantize f16,q4f16` adds relaxtune's 4-bit build against
# transformers on the same 4-bit weights (dequantized to float16).
#   bash benchmarks/gpu_llm.sh OUT [tests] [gpu_llm.py options]
set -uo pipefail
out=${1:?usage: gpu_llm.sh OUT [tests] [gpu_llm.py options]}
shift
tests=""
if [[ ${1:-} == tests ]]; then tests=1; shift; fi
mkdir -p "$out"
site=$(bash scripts/device_install.sh) || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1
start=$SECONDS
python3 benchmarks/gpu_llm.py --out "$out" --work /tmp/gpu_llm "$@" 2>&1 | tee "$out/gpu_llm.log" | grep -v "^\s*$" | tail -60
echo "ran in $((SECONDS - start)) s"
if [[ -n $tests ]]; then
  (cd "$(mktemp -d)" && python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$OLDPWD" \
    "$OLDPWD/tests/models/test_llm_cuda.py" 2>&1 | tail -15)
fi
