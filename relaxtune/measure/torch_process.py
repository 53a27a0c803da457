"""torch eager timed in a process of its own, sampled in turns with the systems timed here.

Measured on the 2-core box (2026-11-30, llama-block, quiet machine): relaxtune alone 11.9 ms at
n = 1000, but 20.7 ms when torch eager was timed in the same process in alternating samples
(torch itself 17.9 vs 18.7 ms): the two thread pools in one process slow TVM's calls down. A
side-by-side table must not charge one system for the other's threads, so torch runs in a
spawned child that rebuilds the same workload (same spec, config and seeds: same weights and
inputs) and answers "time K calls" requests; the parent waits (idle) while it runs.

`TorchProcess(spec, config)` → `.at(point)` (inputs for that shape, ~0.2 s of warm-up calls) →
`.sample(repeats)` (ms per call over `repeats` calls) / `.once()` (seconds of one call); it is a
sampler that `bench.interleaved` accepts beside plain callables.

Threads of the other process keep spinning for a while after its sample ends, so each sample
starts with one untimed call here, and `interleaved` gives the system sampled right after a
remote one an untimed sample first. Without that, the system sampled right after torch ran ~1.4x
slow (llama-block, 2-core box: the bucketed artifact 7.66 ms at n = 512 in the sweep's order,
5.21 ms timed alone, where the rules-only artifact sampled later in each round took 5.25 ms).
"""

from __future__ import annotations

import multiprocessing as mp
import time


def _serve(conn, spec: str, config: dict, threads: int | None) -> None:
    import torch

    from ..workloads import load
    from .bench import torch_inputs, torch_model

    if threads:
        torch.set_num_threads(threads)
    workload = load(spec, config)
    module = torch_model(workload)
    tensors = None

    def call():
        with torch.no_grad():
            return module(*tensors)

    conn.send(("ready", None))
    while True:
        what, arg = conn.recv()
        if what == "close":
            return
        try:
            if what == "at":
                inputs = workload.random_inputs(arg)
                tensors = torch_inputs(workload, inputs)
                start = time.perf_counter()  # warm up for ~0.2 s: a fresh process's first shape
                for _ in range(200):  # timed 7.9 ms per call at n = 1 after one warm-up call, 0.37 ms after these
                    call()
                    if time.perf_counter() - start > 0.2:
                        break
                conn.send(("ok", None))
            elif what == "once":
                start = time.perf_counter()
                call()
                conn.send(("ok", time.perf_counter() - start))
            elif what == "sample":
                call()  # untimed: the parent's thread pool may still be spinning
                start = time.perf_counter()
                for _ in range(arg):
                    call()
                conn.send(("ok", (time.perf_counter() - start) / arg * 1e3))
            else:
                conn.send(("error", f"unknown request {what!r}"))
        except Exception as err:  # pylint: disable=broad-except  # reported to the parent, which raises
            conn.send(("error", f"{type(err).__name__}: {err}"))


class TorchProcess:
    """torch eager for `spec` (+ `config`) in a spawned child process (see module docstring)."""

    def __init__(self, spec: str, config: dict | None = None, threads: int | None = None):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, spec, dict(config or {}), threads), daemon=True)
        self._proc.start()
        self._expect()

    def _expect(self):
        if not self._conn.poll(600):
            raise RuntimeError("torch timing process did not answer within 600 s")
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"torch timing process: {value}")
        return value

    def _ask(self, what: str, arg=None):
        self._conn.send((what, arg))
        return self._expect()

    def at(self, point: dict) -> "TorchProcess":
        self._ask("at", dict(point))
        return self

    def once(self) -> float:
        return self._ask("once")

    def sample(self, repeats: int) -> float:
        return self._ask("sample", int(repeats))

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(("close", None))
            self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()
