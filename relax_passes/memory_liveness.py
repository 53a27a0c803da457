"""Liveness for PlanMemory: a Relax function's intermediate tensors, when each is alive, which share bytes in place.

Reads a function after CallTIRRewrite (each kernel output an explicit `R.builtin.alloc_tensor`) and changes
nothing. `liveness` walks all top-level bindings (not per block) and follows a tensor through views, tuples and
copies, keyed by the Var objects: it gives the global allocations sized by the known dimensions (their first and
last binding, bytes, device), the allocations that reach the return value (never planned), and the PrimFunc
calls with the allocations each argument may be. `inplace_slots` gives an element-wise kernel's output the slot
of an input that dies at that call, where `verify_memory_plan.elementwise_inplace` proves it on the kernel's TIR.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.sym import Analyzer

from .verify_memory_plan import elementwise_inplace

_I64 = "int64"


def is_alloc(value) -> bool:
    """`value` is an `R.builtin.alloc_tensor` call (a kernel output that CallTIRRewrite made explicit)."""
    return (
        isinstance(value, relax.Call)
        and isinstance(value.op, tvm.ir.Op)
        and value.op.name == "relax.builtin.alloc_tensor"
    )


def _union(alias: dict, exprs) -> frozenset:
    return frozenset().union(*(alias.get(u, frozenset()) for e in exprs for u in relax.analysis.free_vars(e)))


def liveness(func: relax.Function, mod: tvm.IRModule, known: set):
    """Allocations sized by the signature's dimensions ([start, end], first use, bytes), what escapes, PrimFunc calls.

    Keyed by the Var objects, never their names: a rewrite that emits new bindings (a padded tuned
    call) can repeat a name already bound, and a name-keyed map then hands one tensor's later uses
    to another (wrong rows in llama-block at b=2).
    """
    roots: list[dict] = []
    alias: dict[relax.Var, frozenset] = {}  # var -> roots it may refer to
    fields: dict[relax.Var, list[frozenset]] = {}  # tuple var -> roots per field
    calls = []
    for i, binding in enumerate(b for block in func.body.blocks for b in block.bindings):
        var, value = binding.var, binding.value
        shape = list(value.args[0].values) if is_alloc(value) and isinstance(value.args[0], relax.ShapeExpr) else None
        if (
            shape is not None
            and str(value.args[3].value) == "global"
            and all(set(tirx.analysis.undefined_vars(d)) <= known for d in shape)
        ):
            nbytes = tirx.const(tvm.DataType(str(value.args[1].value)).bits // 8, _I64)
            for dim in shape:
                nbytes = nbytes * (dim if str(dim.ty.dtype) == _I64 else tirx.Cast(_I64, dim))
            roots.append(
                {"var": var, "start": i, "end": i, "first": None, "nbytes": nbytes, "device": int(value.args[2])}
            )
            alias[var] = frozenset([len(roots) - 1])
            continue
        used = _union(alias, [value])
        for r in used:
            roots[r]["end"] = i
            roots[r]["first"] = i if roots[r]["first"] is None else roots[r]["first"]
        if isinstance(value, relax.Tuple):
            fields[var] = [_union(alias, [f]) for f in value.fields]
        if (
            isinstance(value, relax.TupleGetItem)
            and isinstance(value.tuple_value, relax.Var)
            and value.tuple_value in fields
        ):
            alias[var] = fields[value.tuple_value][value.index]
        elif (
            isinstance(value, relax.Call)
            and isinstance(value.op, tvm.ir.GlobalVar)
            and isinstance(mod[value.op], tirx.PrimFunc)
        ):
            calls.append((i, mod[value.op], [alias.get(a) if isinstance(a, relax.Var) else None for a in value.args]))
        else:
            alias[var] = used
    return roots, _union(alias, [func.body.body]), calls


def inplace_slots(roots, planned: set[int], calls, analyzer: Analyzer) -> dict[int, int]:
    """root -> slot root: an element-wise kernel's output shares the slot of an input dying there."""
    slot = {r: r for r in planned}
    for i, prim, args in calls:
        single = [next(iter(a)) if a is not None and len(a) == 1 else None for a in args]
        taken = set()
        for m, dst in enumerate(single):
            for k, src in enumerate(single if dst in planned and roots[dst]["first"] == i else []):
                ok = src in planned and src not in taken and roots[src]["end"] == i and single.count(src) == 1
                if (
                    ok
                    and analyzer.can_prove_equal(roots[src]["nbytes"], roots[dst]["nbytes"])
                    and elementwise_inplace(prim, k, m)
                ):
                    slot[dst] = slot[src]
                    taken.add(src)
                    break
    return slot
