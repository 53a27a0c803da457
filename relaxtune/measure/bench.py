"""Side-by-side latency of one workload: relaxtune vs stock TVM vs torch eager vs torch.compile
(vs ONNX Runtime, `onnxruntime_baseline.py`, where asked for).

All systems run in one process, one after the other per shape, on the same inputs and weights;
the table reports medians and the ratio to torch eager measured in the same run (this machine is
shared and noisy: compare ratios, not absolute times).
"""

from __future__ import annotations

import itertools
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..compiler.build import build
from .timing import interleaved, time_call  # noqa: F401 (benchmarks name them from here too)
from .vm import VMRunner

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
        return {
            "system": self.system,
            "shape": self.shape,
            "median_ms": self.median_ms,
            "runs": self.runs,
            "max_error": self.max_error,
        }


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
        return (
            torch.from_numpy(np.asarray(array, dtype=np.float32)).to(torch.bfloat16)
            if str(array.dtype) == "bfloat16"
            else torch.from_numpy(array)
        )

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
        from ..errors import UserError

        raise UserError(
            f"unknown dimension {unknown[0]!r} for {workload.name}: its symbolic dimensions are {sorted(workload.dims)}"
        )
    dims = list(workload.dims.values())
    values = [shapes.get(d.name, [d.representative]) for d in dims]
    grid = [dict(zip([d.name for d in dims], combo)) for combo in itertools.product(*values)]
    for point in grid:
        workload.check_shape(point)
    return grid


def bench(workload, target, job, shapes: dict[str, list[int]], systems=DEFAULT_SYSTEMS) -> list[Row]:
    import torch
    import tvm

    grid = shape_grid(workload, shapes)  # bad shapes fail before anything is built
    device = tvm.cuda(0) if target.is_gpu else tvm.cpu(0)
    builders = {}
    if "relaxtune" in systems:
        builders["relaxtune"] = build(workload, target, job)[0]
    if "tvm-stock" in systems:
        builders["tvm-stock"] = tvm.compile(workload.mod, target=target.target)
    runners = {system: VMRunner.for_workload(executable, device, workload) for system, executable in builders.items()}
    modules = {}
    if "onnxruntime" in systems:
        from . import onnxruntime_baseline

        ort_session = onnxruntime_baseline.session(workload)
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
            if system in runners:
                call, output = runners[system].caller(inputs), lambda: runners[system].outputs(inputs)
            elif system == "onnxruntime":
                call, output = onnxruntime_baseline.runner(ort_session, workload, inputs)
            else:
                call, output = _torch_runner(modules[system], workload, inputs)
            out = output()
            error = None
            if expected is not None:
                error = float(
                    np.max(np.abs(out.astype("float64") - expected)) / max(1.0, float(np.max(np.abs(expected))))
                )
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
