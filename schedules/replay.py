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


def row_samples(static_func: tirx.PrimFunc, trace: Trace, tune_at: dict[str, int]) -> dict[int, tuple[str, int, int]]:
    """The SamplePerfectTile instructions on symbolic loops: index → (dimension, kept levels, tile).

    Read off the trace replayed on the static kernel: a sampled loop whose extent equals a
    dimension's tuning value is taken as that dimension's loop. A static loop of the same extent
    only gets a smaller tile, which stays correct (the caller verifies no guard is left).
    """
    sch = fresh_schedule(static_func)
    insts = list(trace.insts)
    found: dict[int, tuple[str, int]] = {}

    def provider(inst, inputs, _attrs, decision):
        if inst.kind.name == "SamplePerfectTile":
            extent = sch.get(inputs[0]).extent
            index = next(i for i, other in enumerate(insts) if other.same_as(inst))
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
