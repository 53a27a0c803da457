#!/usr/bin/env bash
# Show the tracker's servers and its queue per device key (total, free, pending requests).
# Usage: scripts/rpc_queue.sh [TRACKER_HOST:PORT]      (default 127.0.0.1:9190)
set -euo pipefail
TRACKER=${1:-127.0.0.1:9190}
exec python -m tvm.exec.query_rpc_tracker --host "${TRACKER%:*}" --port "${TRACKER##*:}"
