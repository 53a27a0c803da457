#!/usr/bin/env bash
# Tune a workload for cuda on the GPU machine in one run of at most MINUTES (default 9), then list
# the cache. Records are appended and flushed one by one, so the time limit (SIGINT) keeps them all.
#
#   S=$(bash .device/install.sh) && export PYTHONPATH=$S:$PWD && \
#     bash scripts/tune_gpu.sh $OUT/tuning_logs [WORKLOAD] [TRIALS] [CONFIG] [BUCKETS]
#
# Defaults: llama-block, fp16 at Llama-7B sizes, 256 trials, buckets n=1,16,128,2048, FUSION=stock
# (compile with the same --fusion to apply the records). CONFIG or BUCKETS "default": the
# workload's own sizes / the default power-of-two buckets; DTYPE=float32 for the default workloads.
# The job tunes the kernels the build keeps: fp16/bf16 weight GEMMs call cuBLAS and attention is the
# flash kernel unless CUBLAS=0 / FLASH=0 (then compile with --no-cublas / --no-flash-attention too).
set -uo pipefail
cache=${1:?usage: tune_gpu.sh CACHE_DIR [WORKLOAD] [TRIALS] [CONFIG] [BUCKETS]}
workload=${2:-llama-block}
trials=${3:-256}
config=${4:-hidden=4096,heads=32,kv_heads=32,ffn=11008,max_seq=2048,max_batch=1}
buckets=${5:-n=1,16,128,2048}
minutes=${MINUTES:-9}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$cache" && cache=$(cd "$cache" && pwd)
# the package as `pip install -e .` lays it out (relaxtune.relax_passes, relaxtune.schedules), for this
# process and the build workers it spawns: symlinks in a folder first on PYTHONPATH, run from there
site=$(mktemp -d)
mkdir -p "$site/relaxtune"
ln -s "$root"/relaxtune/* "$site/relaxtune/"
ln -s "$root/relax_passes" "$site/relaxtune/relax_passes"
ln -s "$root/schedules" "$site/relaxtune/schedules"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
cd "$site"
start=$(date +%s)
timeout --signal=INT --kill-after=30 $((minutes * 60)) \
  python3 -m relaxtune tune "$workload" --target cuda \
  $([[ $config == default ]] || echo --config "$config") $([[ $buckets == default ]] || echo --buckets "$buckets") \
  --dtype "${DTYPE:-float16}" --fusion "${FUSION:-stock}" --trials "$trials" --cache "$cache" --no-progress \
  $([[ ${CUBLAS:-1} == 0 ]] && echo --no-cublas) $([[ ${FLASH:-1} == 0 ]] && echo --no-flash-attention)
rc=$?
echo "tune: exit $rc after $(( $(date +%s) - start )) s (124/130: stopped at the ${minutes}-minute limit, records kept)"
python3 -m relaxtune cache ls --cache "$cache"
[[ $rc == 0 || $rc == 124 || $rc == 130 ]]
