"""Check a scheduled symbolic kernel against its unscheduled form before it goes into an artifact.

TVM's schedule primitives are not always right on symbolic extents: measured here,
`reverse_compute_at` over fused symbolic loops silently dropped rows when a schedule tuned at
batch 1 ran at batch 2. So every re-applied record is run once at small symbolic values that
are not tile multiples (batch 2, odd lengths) against the naive legalised kernel, which is
correct by construction; a mismatch sends the kernel back to its rules. The reference runs on the
host (llvm); the candidate where its target's kernels run (`check_target`): the host for CPU
targets, the GPU for a GPU target on a machine that has one (the tuning job's machine; measured
there: cuda records re-applied at symbolic shapes gave outputs 1e3-5e4 x off the fp32 tolerance,
which only the block-level bucket check had caught, bucket by bucket), nowhere otherwise.
"""

from __future__ import annotations

import logging

import numpy as np
import tvm
from tvm import tirx

logger = logging.getLogger(__name__)


def _evaluate(expr, values: dict[str, int]) -> int:
    """An integer shape expression (vars, +, -, *, //, %) at the given values."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, tirx.IntImm):
        return int(expr)
    if isinstance(expr, tirx.Var):
        return values[expr.name]
    a, b = _evaluate(expr.a, values), _evaluate(expr.b, values)
    kind = type(expr).__name__
    ops = {"Add": a + b, "Sub": a - b, "Mul": a * b, "FloorDiv": a // b if b else 0, "FloorMod": a % b if b else 0}
    if kind not in ops:
        raise ValueError(f"cannot evaluate {kind} in a shape")
    return ops[kind]


def probe_values(func: tirx.PrimFunc, bounds: dict[str, tuple[int, int]]) -> dict[str, int]:
    """A small value for every symbolic variable of the signature: batch 2, odd lengths, 2 tiles."""
    values = {}
    for param in func.params:
        exprs = list(param.shape) if hasattr(param.ty, "shape") else [param]
        for expr in exprs:
            for var in tirx.analysis.undefined_vars(expr):
                lo, hi = bounds.get(var.name, (1, 1 << 30))
                values.setdefault(var.name, min(hi, max(lo, 3 if lo > 2 else 2)))
    return values


def check_target(target: tvm.target.Target) -> tvm.target.Target | None:
    """Where a kernel scheduled for `target` can be run here: the host (llvm) for a CPU target,
    `target` itself where this machine has a device of its kind, else None (not checked)."""
    if "gpu" not in target.keys:
        return tvm.target.Target("llvm")
    return target if tvm.device(target.kind.name, 0).exist else None


def _run(
    func: tirx.PrimFunc, values: dict[str, int], seed: int, target: tvm.target.Target | None = None
) -> list[np.ndarray]:
    target = target or tvm.target.Target("llvm")
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    device = tvm.cpu(0) if target.kind.name == "llvm" else tvm.device(target.kind.name, 0)
    rng = np.random.default_rng(seed)
    args = []
    for param in func.params:
        if hasattr(param.ty, "shape"):
            shape = [_evaluate(d, values) for d in param.shape]
            args.append(tvm.runtime.tensor(rng.standard_normal(shape).astype(str(param.dtype)), device=device))
        else:
            args.append(values[param.name])
    lib.mod["main"](*args)
    return [a.numpy() for a in args if not isinstance(a, int)]


def same_results(
    reference: tirx.PrimFunc,
    candidate: tirx.PrimFunc,
    bounds: dict[str, tuple[int, int]],
    target: tvm.target.Target | None = None,
) -> bool:
    """Whether `candidate`, run on `target` (default: the host), computes what `reference` does
    on the host at probe values of its symbolic dims."""
    try:
        values = probe_values(reference, bounds)
        expected = _run(reference, values, seed=0)
        got = _run(candidate, values, seed=0, target=target)
    except Exception as err:  # a kernel we cannot probe is not trusted
        logger.info("could not probe a scheduled kernel: %s", str(err).strip().splitlines()[-1])
        return False
    finite = [np.abs(e[np.isfinite(e)]) for e in expected if e.size]
    scale = max([1.0] + [float(f.max()) for f in finite if f.size])  # masked scores hold -inf
    return all(np.allclose(g, e, rtol=1e-3, atol=1e-4 * scale, equal_nan=True) for g, e in zip(got, expected))
