"""Tuning tasks: the kernels of each bucket's function, specialised at the bucket's tuning point.

Runs on the module after fusion (each `main_<bucket>` calls fused PrimFuncs with symbolic shapes).
MetaSchedule cannot tune a kernel with a symbolic dimension, so each call site's kernel is
specialised by binding the bucket's `tune_at` values in its Relax caller and letting
`SpecializePrimFuncBasedOnCallSite` propagate the static shapes. The static kernels are
normalised exactly as MetaSchedule stores workloads, so the same kernel met again (another
bucket, another workload) has the same key and is tuned once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.s_tir import analysis as s_tir_analysis

from ..ir_attrs import BUCKET_ATTR


@dataclass
class Task:
    """One static kernel to tune, and the call sites (bucket function, kernel name) it serves.

    `weight` is the expected number of calls per model call: each site counts with the
    probability of its bucket, under a log-uniform prior over each dimension's range (every
    power-of-two range of n equally likely), so decode and long prompts both count.
    """

    name: str
    mod: tvm.IRModule
    key: str
    flops: float
    bucket: dict[str, list[int]]
    sites: list[tuple[str, str]] = field(default_factory=list)
    weight: float = 0.0


def bucket_probability(bucket: dict[str, list[int]], bounds: dict[str, tuple[int, int]]) -> float:
    """P(bucket) under a log-uniform prior over each dimension's [lower, upper]."""
    p = 1.0
    for dim, (lo, hi, _) in bucket.items():
        lower, upper = bounds[dim]
        p *= (math.log2(hi + 1) - math.log2(lo)) / (math.log2(upper + 1) - math.log2(lower))
    return p


def normalize(func: tirx.PrimFunc) -> tvm.IRModule:
    """The module MetaSchedule tunes and stores: `main`, noalias, no other attributes."""
    return tvm.IRModule({"main": _strip(func).with_attr("global_symbol", "main").with_attr("tirx.noalias", True)})


def _strip(func: tirx.PrimFunc) -> tirx.PrimFunc:
    for key in list(func.attrs.keys()) if func.attrs else []:
        func = func.without_attr(key)
    return func


def workload_key(mod: tvm.IRModule) -> str:
    return str(tvm_ffi.structural_hash(mod))


def call_sites(func: relax.Function) -> list[relax.Call]:
    """The `call_tir` calls of a Relax function, in binding order."""
    calls = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.call_tir":
            calls.append(expr)

    relax.analysis.post_order_visit(func.body, visit)
    return calls


def bucket_functions(mod: tvm.IRModule) -> list[tvm.ir.GlobalVar]:
    return [
        gv for gv, f in mod.functions_items() if isinstance(f, relax.Function) and f.attrs and BUCKET_ATTR in f.attrs
    ]


def bucket_of(func: relax.Function) -> dict[str, list[int]]:
    return {name: [int(v) for v in spec] for name, spec in func.attrs[BUCKET_ATTR].items()}


def tune_point(func: relax.Function) -> dict[str, int]:
    """The bucket's tuning value of each dimension still symbolic in `func`."""
    symbolic = {v.name for v in relax.analysis.defined_symbolic_vars(func)}
    return {name: spec[2] for name, spec in bucket_of(func).items() if name in symbolic}


def specialise(
    mod: tvm.IRModule, gv: tvm.ir.GlobalVar, values: dict[str, int] | None = None
) -> list[tuple[str, tirx.PrimFunc | None]]:
    """(kernel name, kernel specialised at `values`, by default the bucket's tuning point) per call
    site; None for a site TVM cannot specialise (a call with a scalar argument, e.g. `arange(n)`, or
    a kernel whose buffer shape is an expression such as `b * n`, as ONNX imports write): it keeps
    its rule-based schedule."""
    func = mod[gv]
    values = tune_point(func) if values is None else values
    calls = call_sites(func)
    tmp = tvm.IRModule({g: mod[g] for g in {c.args[0] for c in calls}})
    tmp[gv.name_hint] = func.with_attr("global_symbol", gv.name_hint)
    if values:
        tmp = relax.transform.BindSymbolicVars(values, func_name=gv.name_hint)(tmp)
    bound_calls = call_sites(tmp[gv.name_hint])
    try:
        done = relax.transform.SpecializePrimFuncBasedOnCallSite()(tmp)
        return [(c.args[0].name_hint, done[s.args[0]]) for c, s in zip(calls, call_sites(done[gv.name_hint]))]
    except (tvm.error.InternalError, TypeError):  # TVM rejects the whole function for one call it cannot specialise
        return [(c.args[0].name_hint, _specialise_call(mod, b)) for c, b in zip(calls, bound_calls)]


def _specialise_call(mod: tvm.IRModule, call: relax.Call) -> tirx.PrimFunc | None:
    """One call site on its own: a caller taking exactly the call's (bound) argument types."""
    args = list(call.args[1].fields)
    if not all(isinstance(a.ty, relax.TensorType) for a in args) or not isinstance(call.ty, relax.TensorType):
        return None
    bb = relax.BlockBuilder()
    kernel = bb.add_func(mod[call.args[0]], "kernel")
    params = [relax.Var(f"arg{i}", a.ty) for i, a in enumerate(args)]
    with bb.function("caller", params):
        bb.emit_func_output(bb.emit(relax.call_tir(kernel, params, call.ty)))
    try:
        return relax.transform.SpecializePrimFuncBasedOnCallSite()(bb.get())["kernel"]
    except (tvm.error.InternalError, TypeError):  # a scalar argument, or a buffer shaped by an expression (`b * n`)
        return None


def is_contraction(func: tirx.PrimFunc) -> bool:
    """Whether a kernel is one contraction (a matmul with its fused prologue/epilogue).

    A contraction block reduces over two or more buffers (a norm reduces over one). These are
    where search pays; norms, softmax and element-wise kernels get rule-based schedules, and so do
    kernels with several contractions (the legalised attention: MetaSchedule's layout rewrite
    breaks their builds in TVM 0.27, and a fused attention rule is the better answer).
    """
    from .replay import fresh_schedule

    sch = fresh_schedule(func)
    pending = [sch.get_sblock("root", func_name="main")] if _has_root(sch) else []
    contractions = 0
    while pending:
        block_rv = pending.pop()
        block = sch.get(block_rv)
        reduce_vars = {iv.var.name for iv in block.iter_vars if int(iv.iter_type) == 2}
        along_reduction = []
        for region in block.reads:
            indexed = any(v.name in reduce_vars for r in region.region for v in tirx.analysis.undefined_vars(r.min))
            if indexed and not any(region.source.same_as(seen) for seen in along_reduction):
                along_reduction.append(region.source)
        contractions += len(along_reduction) >= 2
        pending.extend(sch.get_child_blocks(block_rv))
    return contractions == 1


def _has_root(sch) -> bool:
    try:
        sch.get_sblock("root", func_name="main")
        return True
    except Exception:  # no root block: not a schedulable kernel
        return False


def global_bounds(mod: tvm.IRModule) -> dict[str, tuple[int, int]]:
    """Each dimension's full range, from the buckets of all bucket functions."""
    bounds: dict[str, tuple[int, int]] = {}
    for gv in bucket_functions(mod):
        for dim, (lo, hi, _) in bucket_of(mod[gv]).items():
            old = bounds.get(dim, (lo, hi))
            bounds[dim] = (min(old[0], lo), max(old[1], hi))
    return bounds


def extract_tasks(mod: tvm.IRModule, only_contractions: bool = True) -> list[Task]:
    """Deduplicated tuning tasks over every bucket function of a fused module."""
    tasks: dict[str, Task] = {}
    bounds = global_bounds(mod)
    for gv in bucket_functions(mod):
        bucket = bucket_of(mod[gv])
        probability = bucket_probability(bucket, bounds)
        for kernel, static in specialise(mod, gv):
            if static is None or (only_contractions and not is_contraction(static)):
                continue
            task_mod = normalize(static)
            key = workload_key(task_mod)
            if key not in tasks:
                flops = float(s_tir_analysis.estimate_tir_flops(task_mod))
                name = f"{kernel}@{gv.name_hint.removeprefix('main_')}"
                tasks[key] = Task(name=name, mod=task_mod, key=key, flops=flops, bucket=bucket)
            tasks[key].sites.append((gv.name_hint, kernel))
            tasks[key].weight += probability
    return list(tasks.values())
