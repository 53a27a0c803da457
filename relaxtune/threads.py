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
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

VARIABLE = "TVM_NUM_THREADS"


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (at least 1)."""
    import psutil

    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    physical = psutil.cpu_count(logical=False) or allowed
    return max(1, min(allowed, physical))


def configure() -> int:
    """Set TVM_NUM_THREADS to the physical core count unless the user chose a count; returns the count in force."""
    for name in (VARIABLE, "OMP_NUM_THREADS"):
        value = os.environ.get(name, "")
        if value.strip().isdigit() and int(value) > 0:
            return int(value)
    threads = physical_cores()
    os.environ[VARIABLE] = str(threads)
    logger.debug("TVM runtime threads: %d (physical cores)", threads)
    return threads
