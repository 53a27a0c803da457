"""Side-by-side latency of one workload: relaxtune vs stock TVM vs torch eager vs torch.compile
(vs ONNX Runtime, `bench_onnxruntime.py`, where asked for).

All systems run in one process, one after the other per shape, on the same inputs and weights;
the table reports medians and the ratio to torch eager measured in the same run (this machine is
shared and noisy: compare ratios, not absolute times).
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_SYSTEMS = ("relaxtune", "tvm-stock", "torch", "torch.compile")  # a workload's own `bench_systems` replace them
SYSTEMS = (*DEFAULT_SYSTEMS, "onnxruntime")


@dataclass
class Row:
    system: str
    shape: dict
    median_ms: float
    runs: int
    max_error: float | None = None

    def as_json(self) -> dict:
        return {"system": self.system, "shape": self.shape, "median_ms": self.median_ms, "runs": self.runs, "max_error": self.max_error}


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
    `bench_remote.TorchProcess`); the system sampled right after a sampler gets an untimed sample
    first (the other process's threads are still spinning)."""
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
    return {name: statistics.median(v) for name, v in samples.items()}


def _tvm_runner(executable, device, workload, inputs):
    import tvm
    from tvm import relax

    from .artifact import prepare_params

    vm = relax.VirtualMachine(executable, device)
    args = [tvm.runtime.tensor(inputs[t.name], device) for t in workload.inputs]
    args += prepare_params(vm, [tvm.runtime.tensor(v, device) for v in workload.params.values()])

    def call():
        out = vm["main"](*args)
        device.sync()
        return out

    return call, lambda: call().numpy()


def torch_dtype(workload):
    """The torch dtype of the workload's floating inputs (float32 when it has none)."""
    import torch

    return getattr(torch, next((t.dtype for t in workload.inputs if "float" in t.dtype), "float32"))


def torch_model(workload):
    """The workload's torch module in its own dtype (the reference module is float32): what a
    float16 / bfloat16 build is timed against."""
    return workload.torch_module().eval().to(torch_dtype(workload))


def torch_inputs(workload, inputs: dict) -> list:
    """The inputs as torch tensors (bfloat16 through float32: torch takes no numpy bfloat16)."""
    import torch

    def tensor(array):
        return torch.from_numpy(np.asarray(array, dtype=np.float32)).to(torch.bfloat16) if str(array.dtype) == "bfloat16" else torch.from_numpy(array)

    return [tensor(inputs[t.name]) for t in workload.inputs]


def _torch_runner(module, workload, inputs):
    import torch

    tensors = torch_inputs(workload, inputs)

    def call():
        with torch.no_grad():
            return module(*tensors)

    return call, lambda: call().float().numpy()


def shape_grid(workload, shapes: dict[str, list[int]]) -> list[dict[str, int]]:
    """Every combination of the given values; a dimension not given takes its representative value."""
    unknown = sorted(set(shapes) - set(workload.dims))
    if unknown:
        from .errors import UserError

        raise UserError(f"unknown dimension {unknown[0]!r} for {workload.name}: its symbolic dimensions are {sorted(workload.dims)}")
    dims = list(workload.dims.values())
    values = [shapes.get(d.name, [d.representative]) for d in dims]
    grid = [dict(zip([d.name for d in dims], combo)) for combo in itertools.product(*values)]
    for point in grid:
        workload.check_shape(point)
    return grid


def bench(workload, target, job, shapes: dict[str, list[int]], systems=DEFAULT_SYSTEMS) -> list[Row]:
    import torch
    import tvm

    from . import api

    grid = shape_grid(workload, shapes)  # bad shapes fail before anything is built
    device = tvm.cuda(0) if target.is_gpu else tvm.cpu(0)
    builders = {}
    if "relaxtune" in systems:
        builders["relaxtune"] = api.build(workload, target, job)[0]
    if "tvm-stock" in systems:
        builders["tvm-stock"] = tvm.compile(workload.mod, target=target.target)
    modules = {}
    if "onnxruntime" in systems:
        from . import bench_onnxruntime

        ort_session = bench_onnxruntime.session(workload)
    if "torch" in systems or "torch.compile" in systems:
        eager = torch_model(workload)
        modules["torch"] = eager
        if "torch.compile" in systems:
            modules["torch.compile"] = torch.compile(eager, dynamic=True)
    rows: list[Row] = []
    for point in grid:
        inputs = workload.random_inputs(point)
        expected = workload.reference(inputs, workload.params) if workload.reference else None
        for system in systems:
            if system in builders:
                call, output = _tvm_runner(builders[system], device, workload, inputs)
            elif system == "onnxruntime":
                call, output = bench_onnxruntime.runner(ort_session, workload, inputs)
            else:
                call, output = _torch_runner(modules[system], workload, inputs)
            out = output()
            error = None
            if expected is not None:
                error = float(np.max(np.abs(out.astype("float64") - expected)) / max(1.0, float(np.max(np.abs(expected)))))
            times = time_call(call)
            rows.append(Row(system, dict(point), statistics.median(times), len(times), error))
            logger.info("%s %s: %.3f ms", system, point, rows[-1].median_ms)
    return rows


def markdown(rows: list[Row], baseline: str = "torch") -> str:
    systems = list(dict.fromkeys(r.system for r in rows))
    points = list(dict.fromkeys(tuple(sorted(r.shape.items())) for r in rows))
    by_key = {(r.system, tuple(sorted(r.shape.items()))): r for r in rows}
    head = ["shape"] + [f"{s} ms (x {baseline})" for s in systems] + ["relaxtune max err"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for point in points:
        base = by_key.get((baseline, point))
        cells = [" ".join(f"{k}={v}" for k, v in point)]
        for s in systems:
            r = by_key.get((s, point))
            ratio = f" ({r.median_ms / base.median_ms:.2f}x)" if r and base else ""
            cells.append(f"{r.median_ms:.3f}{ratio}" if r else "-")
        rt = by_key.get(("relaxtune", point))
        cells.append(f"{rt.max_error:.1e}" if rt and rt.max_error is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dim = max(rows[0].shape, key=lambda d: len({r.shape[d] for r in rows}))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in dict.fromkeys(r.system for r in rows):
        pts = sorted((r.shape[dim], r.median_ms) for r in rows if r.system == system)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(dim)
    ax.set_ylabel("median latency (ms)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
