"""Timing on a shared, noisy machine: medians of repeated calls, and A/B comparisons sampled in turns.

`time_call` times one system alone; `interleaved` samples several in rounds so that load hits all
of them alike. Both return milliseconds; compare medians and ratios, never one absolute time.
"""

from __future__ import annotations

import statistics
import time


def time_call(fn, min_runs: int = 5, min_seconds: float = 0.3, max_seconds: float = 10.0) -> list[float]:
    """Latencies (ms) after one warm-up call; a slow system gets at least 3 runs."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    runs = 3 if first > 1.0 else min_runs
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < runs or (time.perf_counter() - start < min_seconds and len(times) < 2000):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() - start > max_seconds and len(times) >= 3:
            break
    return times


def interleaved(calls: dict, rounds: int, sample_s: float = 0.02) -> dict[str, float]:
    """Median ms per call of each system, sampled in turns (each sample: enough calls of it for
    about `sample_s` seconds, after one warm-up call), so that load on this shared machine hits
    every system alike. What A/B comparisons and the bucket check use. A system is a callable, or
    a sampler timed elsewhere (`sample(repeats)` -> ms per call, `once()` -> seconds; e.g.
    `torch_process.TorchProcess`); the system sampled right after a sampler gets an untimed sample
    first (the other process's threads are still spinning)."""
    return {name: statistics.median(v) for name, v in timed_samples(calls, rounds, sample_s).items()}


def paired(calls: dict, rounds: int, sample_s: float = 0.02) -> tuple[dict[str, float], float]:
    """(median ms of each of two systems, the median over rounds of the second's ms / the first's), sampled in
    turns as `interleaved` does. The ratio within a round compares two samples taken back to back, so load
    that changes between rounds (seen here: the same kernel 5x slower for seconds) cancels; the median of
    the ratios is steadier than the ratio of the medians."""
    samples = timed_samples(calls, rounds, sample_s)
    first, second = samples.values()
    ratio = statistics.median(b / a for a, b in zip(first, second))
    return {n: statistics.median(v) for n, v in samples.items()}, ratio


def timed_samples(calls: dict, rounds: int, sample_s: float = 0.02) -> dict[str, list[float]]:
    """Each system's ms per call, one sample per round, sampled in turns (see `interleaved`): the fastest
    sample of each is what it does when the shared machine lets it."""
    repeats = {}
    for name, call in calls.items():
        if hasattr(call, "sample"):
            call.once()  # warm-up
            repeats[name] = max(1, int(sample_s / max(call.once(), 1e-6)))
            continue
        call()  # warm-up: first-call allocation, caches
        start = time.perf_counter()
        call()
        repeats[name] = max(1, int(sample_s / max(time.perf_counter() - start, 1e-6)))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    after_remote = False
    for _ in range(rounds):
        for name, call in calls.items():
            if hasattr(call, "sample"):
                samples[name].append(call.sample(repeats[name]))
                after_remote = True
                continue
            if after_remote:  # the other process's threads still spin: an untimed sample first
                for _ in range(repeats[name]):
                    call()
                after_remote = False
            start = time.perf_counter()
            for _ in range(repeats[name]):
                call()
            samples[name].append((time.perf_counter() - start) / repeats[name] * 1e3)
    return samples
