"""Measuring candidates on remote devices through TVM's RPC tracker (MetaSchedule's RPCRunner).

The job builds every candidate locally (our fast builder) and sends the `.so` to a server that
registered with the tracker under the device key; the measured times come back to the job, which
alone writes the cache. What this module adds to the stock `RPCRunner`:

- `check_tracker`: the tracker is asked for its server list before anything is tuned; an
  unreachable tracker, or no server under the key, is one `UserError` line naming the address;
- one measuring connection per server registered at start (stock: one connection in all);
- a client-side limit per candidate (twice `run_timeout_s`: waiting for a free server, upload,
  load, measure): a server that dies or hangs costs only the candidates it held, each marked
  failed with the reason, which MetaSchedule writes to the per-task log in the cache folder's `logs/`;
- before each batch the tracker is asked again; with no server left the batch fails at once
  (reason logged) instead of waiting in the tracker's queue for ever.

`LocalCluster` starts a tracker and servers on 127.0.0.1 (tests, `benchmarks/rpc_throughput.py`).
Run `intrin.register_for(...)` before this is imported (it imports MetaSchedule). Servers must be
able to load the host's `.so` (same OS, CPU and TVM runtime).
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import socket
import struct
import time

from tvm.ir.utils import derived_object
from tvm.rpc import base
from tvm.s_tir.meta_schedule.runner import RPCConfig, RPCRunner
from tvm.s_tir.meta_schedule.runner.rpc_runner import RPCRunnerFuture
from tvm.support.popen_pool import PopenPoolExecutor

from ..config import TuneConfig
from ..errors import UserError

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0  # one connection attempt to the tracker
SERVER_WAIT_S = 5.0  # how long a check waits for a server under the key to (re)appear


def tracker_summary(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> dict:
    """The tracker's `{"queue_info": ..., "server_info": [...]}`; OSError when unreachable.

    One plain connection with a timeout (`tvm.rpc.connect_tracker` retries for 60 s)."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
        if struct.unpack("<i", base.recvall(sock, 4))[0] != base.RPC_TRACKER_MAGIC:
            raise ConnectionError("it answered, but not as a TVM RPC tracker")
        base.sendjson(sock, [base.TrackerCode.SUMMARY])
        code, summary = base.recvjson(sock)
    if code != base.TrackerCode.SUCCESS:
        raise ConnectionError(f"the tracker refused a summary (code {code})")
    return summary


def servers_under(summary: dict, key: str) -> int:
    """How many servers are registered (busy or free) under `key`."""
    return sum(1 for item in summary.get("server_info", []) if item.get("key") == f"server:{key}")


def _keys(summary: dict) -> list[str]:
    return sorted({str(item.get("key", "")).partition(":")[2] for item in summary.get("server_info", [])})


def _servers_or_reason(host: str, port: int, key: str, wait_s: float) -> tuple[int, str]:
    """(servers under key, "") or (0, why none can be used), polling up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            summary = tracker_summary(host, port)
        except (OSError, ValueError) as err:  # ValueError: a reply that is not JSON
            why = getattr(err, "strerror", None) or str(err) or type(err).__name__
            return 0, f"RPC tracker {host}:{port} is unreachable ({why})"
        count = servers_under(summary, key)
        if count or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    if count:
        return count, ""
    return (
        0,
        f"no RPC server is registered under key {key!r} at tracker {host}:{port} (keys there: "
        f"{', '.join(_keys(summary)) or 'none'})",
    )


def check_tracker(config: TuneConfig, wait_s: float = SERVER_WAIT_S) -> int:
    """The number of servers under `config.device_key`; UserError when the tracker is unreachable or has none."""
    host, port = config.tracker_address
    count, reason = _servers_or_reason(host, port, config.device_key, wait_s)
    if not count:
        hint = (
            "start one (scripts/rpc_tracker.sh) or fix --rpc"
            if "unreachable" in reason
            else "start one (scripts/rpc_server.sh) or fix --device-key"
        )
        raise UserError(f"{reason}: {hint}")
    logger.debug("RPC tracker %s:%d: %d server(s) under key %r", host, port, count, config.device_key)
    return count


def _failed_future(reason: str, timeout_s: float) -> RPCRunnerFuture:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(RuntimeError(reason))
    return RPCRunnerFuture(future=future, timeout_sec=timeout_s)


@derived_object
class TrackerRunner(RPCRunner._cls):  # pylint: disable=protected-access  (how derived objects are extended)
    """RPCRunner with one connection per server, a per-candidate limit, and a tracker check per batch."""

    def __init__(
        self,
        rpc_config: RPCConfig,
        evaluator_config,
        workers: int,
        limit_s: float,
        server_wait_s: float = SERVER_WAIT_S,
    ) -> None:
        super().__init__(rpc_config=rpc_config, evaluator_config=evaluator_config, max_workers=workers)
        self.workers = workers
        self.limit_s = limit_s
        self.server_wait_s = server_wait_s
        self.pool.shutdown(wait=False)  # no worker was started: replace it by one that has a limit
        self.pool = PopenPoolExecutor(max_workers=workers, timeout=limit_s)

    def _sanity_check(self) -> None:
        """Stock: start a worker to resolve custom functions by name; we pass none."""

    def run(self, runner_inputs):
        cfg = self.rpc_config
        count, reason = _servers_or_reason(cfg.tracker_host, cfg.tracker_port, cfg.tracker_key, self.server_wait_s)
        if not count:
            logger.warning("%s: %d candidate(s) of this batch marked failed", reason, len(runner_inputs))
            return [_failed_future(reason, self.limit_s) for _ in runner_inputs]
        futures = super().run(runner_inputs)
        for future in futures:
            future.timeout_sec = self.limit_s  # named in the timeout message
        return futures


def make_rpc_runner(config: TuneConfig, evaluator_config) -> TrackerRunner:
    """MetaSchedule's RPC runner for `config.rpc_tracker` / `config.device_key` (checked first)."""
    servers = check_tracker(config)
    host, port = config.tracker_address
    rpc_config = RPCConfig(
        tracker_host=host,
        tracker_port=port,
        tracker_key=config.device_key,
        session_timeout_sec=max(1, math.ceil(config.run_timeout_s)),
    )
    return TrackerRunner(rpc_config, evaluator_config, workers=servers, limit_s=2 * config.run_timeout_s)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class LocalCluster:
    """A tracker and servers on 127.0.0.1, started by `with` and all stopped at its end.

    `servers` maps a device key to a count. Each server is TVM's `rpc.Server` (a worker process
    that forks one process per session), so `kill(key, i)` kills a server as a crash would.
    """

    def __init__(self, servers: dict[str, int], host: str = "127.0.0.1", timeout_s: float = 60.0):
        self.counts = dict(servers)
        self.host = host
        self.timeout_s = timeout_s
        self.tracker = None
        self.servers: dict[str, list] = {}

    @property
    def address(self) -> str:
        return f"{self.host}:{self.tracker.port}"

    def __enter__(self) -> "LocalCluster":
        from tvm import rpc
        from tvm.rpc.tracker import Tracker

        try:
            port = free_port(self.host)
            self.tracker = Tracker(self.host, port=port, port_end=port + 1, silent=True)
            for key, count in self.counts.items():
                for _ in range(count):
                    port = free_port(self.host)
                    server = rpc.Server(
                        self.host,
                        port=port,
                        port_end=port + 1,
                        key=key,
                        tracker_addr=(self.host, self.tracker.port),
                        silent=True,
                    )
                    self.servers.setdefault(key, []).append(server)
            self.wait_for(self.counts)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def wait_for(self, counts: dict[str, int]) -> None:
        """Block until the tracker lists exactly `counts` servers per key (bounded by timeout_s)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            summary = tracker_summary(self.host, self.tracker.port)
            if all(servers_under(summary, key) == n for key, n in counts.items()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"tracker {self.address} lists {summary['server_info']}, expected {counts}")
            time.sleep(0.1)

    def in_session(self, key: str, index: int = 0) -> bool:
        """Whether the server is serving a session now (it forks one process per session)."""
        import psutil

        worker = self.servers[key][index].proc
        try:
            return bool(worker is not None and psutil.Process(worker._proc.pid).children())  # pylint: disable=protected-access
        except psutil.NoSuchProcess:
            return False

    def kill(self, key: str, index: int = 0) -> None:
        """Kill one server and its session process, as a crash would."""
        self.servers[key][index].terminate()

    def __exit__(self, *exc) -> None:
        for servers in self.servers.values():
            for server in servers:
                server.terminate()
        self.servers = {}
        if self.tracker is not None:
            self.tracker.terminate()
            self.tracker = None
