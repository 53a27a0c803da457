#!/usr/bin/env bash
# Start a TVM RPC tracker in the foreground (Ctrl-C stops it): servers register with it under a
# device key, and `relaxtune tune --rpc HOST:PORT --device-key KEY` asks it for free servers.
# Usage: scripts/rpc_tracker.sh [BIND_HOST] [PORT]      (defaults: 0.0.0.0 9190; 127.0.0.1 = this machine only)
# The RPC protocol runs any uploaded code: use it on a trusted network only.
set -euo pipefail
HOST=${1:-0.0.0.0}
PORT=${2:-9190}
exec python -m tvm.exec.rpc_tracker --host "$HOST" --port "$PORT" --port-end "$((PORT + 1))"
