"""Re-apply a schedule tuned on a static kernel to the same kernel with symbolic dimensions.

MetaSchedule tunes static copies only, and replaying a static trace on the symbolic kernel fails
(`SamplePerfectTile` on a symbolic loop). A trace is made shape-generic by replacing each
`SamplePerfectTile` with its decision as literal split factors whose outermost factor is left
free (`[None, d1, d2, ...]`): on the static extent this is the same split; on a symbolic extent the
outer loop runs ceil(n / (d1*d2*...)) times.

When the inner factors of a symbolic loop do not divide its runtime extent, TVM guards the body
with a predicate inside the innermost loops, which cost 3-9x in measurements. `row_samples` finds
the samples on symbolic loops; `generalize` can keep only their innermost (register) tile, and
`multiples` gives what each dimension must then be padded to (see `padding.py`).
"""

from __future__ import annotations

import math

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.schedule import Trace

SCHEDULED = "tirx.is_scheduled"


def fresh_schedule(func: tirx.PrimFunc) -> s_tir.Schedule:
    """A Schedule over a deep copy of `func`: TVM's schedule primitives rewrite IR nodes in place
    when it holds the only reference, which silently changed kernels still used elsewhere."""
    copy = tvm.ir.load_json(tvm.ir.save_json(func))
    return s_tir.Schedule(tvm.IRModule({"main": copy.with_attr("global_symbol", "main")}))


ROW_TILE_CAP = 16  # rows a symbolic dimension may be padded by, at most (one register/cache tile)


def row_tile(decision) -> tuple[int, int]:
    """How many innermost tile levels of a symbolic loop to keep, and their product (<= the cap)."""
    kept, product = 0, 1
    for factor in reversed([int(f) for f in decision[1:]]):
        if product * factor > ROW_TILE_CAP:
            break
        kept, product = kept + 1, product * factor
    return kept, product


def generalize(trace: Trace, row_samples: dict[int, int] | None = None) -> list:
    """The trace as JSON with every SamplePerfectTile folded into its Split as literal factors.

    Samples in `row_samples` (instruction index → innermost levels to keep, on symbolic loops)
    get their outer levels set to 1, e.g. `[None, 1, 8, 2]`: the loop structure the rest of the
    trace refers to is unchanged, and a symbolic extent then only needs padding to a multiple of
    the kept tile (a few rows) instead of the whole tuned extent.
    """
    row_samples = row_samples or {}
    insts, decisions = trace.as_json()
    decision_of = {int(index): decision for index, decision in decisions}
    literal: dict[str, object] = {}
    out_insts, out_decisions = [], []
    for index, (kind, inputs, attrs, outputs) in enumerate(insts):
        inputs = [literal.get(x, x) if isinstance(x, str) else x for x in inputs]
        if kind == "SamplePerfectTile":
            factors = [int(f) for f in decision_of[index]]
            if index in row_samples:
                keep = row_samples[index]
                factors = [factors[0]] + [1] * (len(factors) - 1 - keep) + factors[len(factors) - keep :]
            literal.update({rv: (None if k == 0 else factors[k]) for k, rv in enumerate(outputs)})
            continue
        if index in decision_of:
            out_decisions.append([len(out_insts), decision_of[index]])
        out_insts.append([kind, inputs, attrs, outputs])
    return [out_insts, out_decisions]


def apply_trace(func: tirx.PrimFunc, trace_json: list) -> tirx.PrimFunc:
    """Schedule `func` (static or symbolic) with a generalized trace; marks it scheduled."""
    attrs = dict(func.attrs) if func.attrs else {}
    sch = fresh_schedule(func)
    Trace.apply_json_to_schedule(trace_json, sch)
    out = sch.mod["main"].without_attr("global_symbol")
    if "global_symbol" in attrs:
        out = out.with_attr("global_symbol", attrs["global_symbol"])
    return out.with_attr(SCHEDULED, True)


def has_guard(func: tirx.PrimFunc) -> bool:
    """Whether a scheduled kernel kept a block predicate (a `T.where`) anywhere."""
    return "T.where(" in func.script()


def thread_extents(func: tirx.PrimFunc) -> dict[str, set[str]]:
    """Thread tag (threadIdx.x, blockIdx.x, ...) → the extents of the loops bound to it. A GPU
    kernel launches with one extent per tag, so a tag bound at two extents is a broken schedule: a
    record re-applied with a smaller row tile bound 32 threads to its rows while its cooperative
    shared-memory fetches kept the 128 of the trace (the H200 ran it 5e4 x off the fp32 tolerance)."""
    import tvm_ffi

    found: dict[str, set[str]] = {}

    def visit(loop):
        if loop.thread_binding is not None:
            found.setdefault(str(loop.thread_binding.thread_tag), set()).add(str(loop.extent))

    tvm_ffi.structural_walk(func.body, ((tirx.For,), visit), order="pre")
    return found


def threads_agree(func: tirx.PrimFunc) -> bool:
    """Whether every thread tag of a kernel is bound at one extent (see `thread_extents`)."""
    return all(len(extents) == 1 for extents in thread_extents(func).values())


def _static_iters(func: tirx.PrimFunc) -> dict[str, list[bool]]:
    """Block name → per block iter, whether its extent is a constant."""
    import tvm_ffi

    found: dict[str, list[bool]] = {}

    def visit(block):
        found[block.name_hint] = [isinstance(iv.dom.extent, tirx.IntImm) for iv in block.iter_vars]

    tvm_ffi.structural_walk(func.body, ((s_tir.SBlock,), visit), order="pre")
    return found


def _binds_only_static_iters(sch: s_tir.Schedule, loop, static_iters: dict[str, list[bool]]) -> bool:
    """True when every block iter bound through `loop` is static in the symbolic kernel (so a loop
    of the same extent as a dimension's tuning value, e.g. K = 64 at n = 64, is not that dimension)."""
    import tvm_ffi
    from tvm.tirx.analysis import undefined_vars

    loop_var = sch.get(loop).loop_var
    verdicts: list[bool] = []

    def visit(realize):
        block = realize.block
        for k, value in enumerate(realize.iter_values):
            if any(v.same_as(loop_var) for v in undefined_vars(value)):
                flags = static_iters.get(block.name_hint)
                verdicts.append(flags is not None and k < len(flags) and flags[k])

    tvm_ffi.structural_walk(sch.get(loop), ((s_tir.SBlockRealize,), visit), order="pre")
    return bool(verdicts) and all(verdicts)


def row_samples(
    static_func: tirx.PrimFunc, trace: Trace, tune_at: dict[str, int], symbolic_func: tirx.PrimFunc | None = None
) -> dict[int, tuple[str, int, int]]:
    """The SamplePerfectTile instructions on symbolic loops: index → (dimension, kept levels, tile).

    Read off the trace replayed on the static kernel: a sampled loop whose extent equals a
    dimension's tuning value is taken as that dimension's loop, unless `symbolic_func` (the same
    kernel with symbolic shapes) shows that every block iter the loop binds is static. A static
    loop taken for a symbolic one only gets a smaller tile, which stays correct (the caller
    verifies no guard is left).
    """
    sch = fresh_schedule(static_func)
    insts = list(trace.insts)
    found: dict[int, tuple[str, int]] = {}
    static_iters = _static_iters(symbolic_func) if symbolic_func is not None else None

    def provider(inst, inputs, _attrs, decision):
        if inst.kind.name == "SamplePerfectTile":
            extent = sch.get(inputs[0]).extent
            index = next(i for i, other in enumerate(insts) if other.same_as(inst))
            if static_iters is not None and _binds_only_static_iters(sch, inputs[0], static_iters):
                return decision
            for name, value in tune_at.items():
                if value > 1 and isinstance(extent, tirx.IntImm) and int(extent) == value:
                    found[index] = (name, *row_tile(decision))
        return decision

    trace.apply_to_schedule(sch, remove_postproc=True, decision_provider=provider)
    return found


def multiples(samples: dict[int, tuple[str, int, int]]) -> dict[str, int]:
    """Per dimension, the lcm of the kept row tiles of its loops: what it must be padded to."""
    out: dict[str, int] = {}
    for name, _, tile in samples.values():
        out[name] = math.lcm(out.get(name, 1), tile)
    return out
