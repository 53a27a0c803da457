"""How many threads TVM's CPU runtime uses: one per physical core, not TVM's guess.

With neither TVM_NUM_THREADS nor OMP_NUM_THREADS set, TVM 0.27 sizes its thread pool as
``std::thread::hardware_concurrency() / 2`` on x86, assuming two hyper-threads per core. Where every
logical CPU is a core (this 2-core VM; many cloud VMs) that runs every parallel kernel on half the
machine: relaxtune's llama-block ran on one of two cores while torch used both (docs/threads.md).

`configure()` (run by every entry point: the CLI, `relaxtune.api`, the benchmarks) sets TVM_NUM_THREADS, unless the
user set it or
OMP_NUM_THREADS, to the physical cores this process may run on. TVM reads it when the first
parallel kernel creates the pool, and child processes (MetaSchedule's runner, build workers)
inherit it, so what tuning measures runs with the threads the artifact runs with. A program that
loads a relaxtune `.so` with the bare TVM runtime should set TVM_NUM_THREADS itself.

It also sets TVM_BIND_THREADS=0 unless the user set it: TVM otherwise pins each worker thread to one core,
and on a machine shared with other jobs a pinned worker waits for its core at every parallel kernel, which
then waits for it: on the shared 2-core box pinned workers made SmolLM2's decode intermittently 2x slower,
unpinned ones never (benchmarks/decode_threads.py, docs/results.md).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

VARIABLE = "TVM_NUM_THREADS"
BIND_VARIABLE = "TVM_BIND_THREADS"


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (at least 1)."""
    import psutil

    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    physical = psutil.cpu_count(logical=False) or allowed
    return max(1, min(allowed, physical))


def configure() -> int:
    """Set TVM_NUM_THREADS to the physical core count unless the user chose a count, and TVM_BIND_THREADS to 0
    (workers not pinned) unless set; returns the thread count in force."""
    os.environ.setdefault(BIND_VARIABLE, "0")
    for name in (VARIABLE, "OMP_NUM_THREADS"):
        value = os.environ.get(name, "")
        if value.strip().isdigit() and int(value) > 0:
            return int(value)
    threads = physical_cores()
    os.environ[VARIABLE] = str(threads)
    logger.debug("TVM runtime threads: %d (physical cores)", threads)
    return threads
