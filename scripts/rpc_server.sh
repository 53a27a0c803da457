#!/usr/bin/env bash
# Start a TVM RPC server on the device in the foreground and register it with the tracker under KEY
# (Ctrl-C stops it). Run one per device; the device needs Python with the same apache-tvm as the job.
# Usage: scripts/rpc_server.sh KEY [TRACKER_HOST:PORT] [PORT]
#        (defaults: tracker 127.0.0.1:9190; server port: the first free one from 9090)
# The server runs any uploaded code: use it on a trusted network only.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 KEY [TRACKER_HOST:PORT] [PORT]" >&2
    exit 2
fi
KEY=$1
TRACKER=${2:-127.0.0.1:9190}
PORT=${3:-9090}
exec python -m tvm.exec.rpc_server --tracker "$TRACKER" --key "$KEY" --host 0.0.0.0 --port "$PORT" --port-end "$((PORT + 100))"
