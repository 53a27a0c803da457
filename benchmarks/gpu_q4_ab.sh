#!/usr/bin/env bash
# One GPU-machine call (issue 26): the q4f16 7B block's default build (llama7b-q4-rf-cublas-flash-graph) against other
# builds of it (benchmarks/gpu_job_variants.py names), all built there and timed at n = 1 / 128 in turns with the
# floor of the block's 4-bit bytes, two VMs of each (VMs of one artifact differ by 1-3 us), each kernel of the default
# build at n = 1 without graphs (gpu_ab_builds.py --q4); then the gpu-marked 4-bit tests, the language models' on the
# GPU and the attention kernels'.
#   bash benchmarks/gpu_q4_ab.sh OUT NAME=VARIANT [NAME=VARIANT ...] [notests]
# e.g. norm=llama7b-q4-noprologue-rf-cublas-flash-graph (the q/k/v RMSNorm as its own kernel),
#      flash=llama7b-q4-noattn-rf-cublas-flash-graph (the flash kernel before the fused MLP kernel),
#      five=llama7b-q4-nomlp-rf-cublas-flash-graph (o_proj .. down as five kernels);
# NAME=env:VAR=VALUE[,VAR=VALUE]: the default build timed with those set around its calls (one artifact, two launch
# configurations: the kernels' host code reads such variables per launch), e.g. pdl0=env:RELAXTUNE_GEMV_PDL=0
set -uo pipefail
usage="usage: gpu_q4_ab.sh OUT NAME=VARIANT [NAME=VARIANT ...] [notests]"
out=${1:?$usage}
shift
others=() tests=1
for arg in "$@"; do
  case $arg in
    notests) tests=0 ;;
    ?*=?*) others+=("$arg") ;;
    *) echo "gpu_q4_ab.sh: '$arg' is neither NAME=VARIANT nor notests; $usage" >&2 && exit 2 ;;
  esac
done
[[ ${#others[@]} -gt 0 ]] || { echo "gpu_q4_ab.sh: no NAME=VARIANT to time against the default; $usage" >&2; exit 2; }
mkdir -p "$out"
site=$(bash scripts/device_install.sh) || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1
start=$SECONDS
art=/tmp/gjq4ab default=llama7b-q4-rf-cublas-flash-graph plain=llama7b-q4-rf-cublas-flash
only=$default,$plain
for o in "${others[@]}"; do [[ ${o#*=} == env:* ]] || only+=",${o#*=}"; done
timeout 300 python3 benchmarks/gpu_job.py build --art "$art" --only "$only" 2>&1 | tail -2
echo "built in $((SECONDS - start)) s"
builds=()
for i in 1 2; do
  builds+=(--build "default$i=$art")
  for o in "${others[@]}"; do
    if [[ ${o#*=} == env:* ]]; then
      builds+=(--build "${o%%=*}$i=$art")
      IFS=, read -ra assignments <<< "${o#*=env:}"
      for assignment in "${assignments[@]}"; do builds+=(--env "${o%%=*}$i:$assignment"); done
    else
      builds+=(--build "${o%%=*}$i=$art:${o#*=}")
    fi
  done
done
timeout 240 python3 benchmarks/gpu_ab_builds.py --q4 --variant "$default" --plain "$plain" "${builds[@]}" \
  --seqs 1,128 --rounds 9 --out "$out/ab" 2>&1 | grep -v "^\s*$" | grep -v "compute_symbolic\|assert_op" | tail -30
echo "timed in $((SECONDS - start)) s"
if [[ $tests == 1 ]]; then
  (cd "$(mktemp -d)" && timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$OLDPWD" \
    "$OLDPWD/tests/kernels/test_gpu_qgemv.py" "$OLDPWD/tests/kernels/test_gpu_q4mlp.py" \
    "$OLDPWD/tests/models/test_llm_cuda.py" "$OLDPWD/tests/kernels/test_gpu_kernels.py" \
    -k "not test_gpu_kernels or attn" 2>&1 | tail -6)
  echo "tested in $((SECONDS - start)) s"
fi
