#!/usr/bin/env bash
# The GPU machine's tuning job: every workload in one process (scripts/tune_gpu.py) within MINUTES
# (default 5, bucket checks included), then the cache listed. Records are appended and flushed one
# by one, so even the backstop kill (one minute past MINUTES) keeps them all.
#
#   S=$(bash scripts/device_install.sh) && export PYTHONPATH=$S && bash scripts/tune_gpu.sh $OUT/tuning_logs [options]
#
# Defaults (tune_gpu.py --help): the default workloads (llama-block, gpt2-block, mlp at their
# default fp32 configs) at buckets n=1,16,128,1024, at most 256 trials each (fewer where the time
# share is short) in batches of 16 (one per core), relaxtune fusion, cuBLAS and
# flash attention as `relaxtune compile` uses them (fp32 has neither). The fp16 Llama-7B-sized
# block keeps no contraction of its own with cuBLAS and the flash kernel on; its TIR kernels:
#   bash scripts/tune_gpu.sh DIR --workloads llama-block --dtype float16 --no-cublas --no-flash-attention \
#     --config hidden=4096,heads=32,kv_heads=32,ffn=11008,max_seq=2048,max_batch=1 --buckets n=1,16,128,2048
set -uo pipefail
cache=${1:?usage: tune_gpu.sh CACHE_DIR [tune_gpu.py options]}
shift
minutes=${MINUTES:-5}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$cache" && cache=$(cd "$cache" && pwd)
cd "$(mktemp -d)"  # not the checkout: its relaxtune/ folder would shadow the installed package
start=$(date +%s)
timeout --signal=INT --kill-after=20 $(( minutes * 60 + 60 )) \
  python3 "$root/scripts/tune_gpu.py" --cache "$cache" --minutes "$minutes" "$@"
rc=$?
echo "tune_gpu: exit $rc after $(( $(date +%s) - start )) s (124/130: stopped by the backstop, records kept)"
python3 -m relaxtune cache ls --cache "$cache"
[[ $rc == 0 || $rc == 124 || $rc == 130 ]]
