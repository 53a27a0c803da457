#!/usr/bin/env bash
# On the GPU machine (no network): TVM from .device (../shared/device: install.sh), then relaxtune itself,
# installed from this checkout with no dependencies into the same folder. Prints the folder:
#   S=$(bash scripts/device_install.sh) && export PYTHONPATH=$S && python3 benchmarks/gpu_job.py run ...
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
site=$(bash "$root/.device/install.sh")
python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target "$site" "$root" >&2
echo "$site"
