"""Upper bounds of a kernel's symbolic dims, for 32-bit indices on the GPU (not a rule).

`annotate_var_bounds(mod)` writes on each PrimFunc `BOUND_ATTR` ({dim name: upper bound}), taken from the
`tir_var_upper_bound` (and `tir_var_lower_bound`) of the Relax functions that call it: it runs before the
GPU rules (gpu_rules.gpu_schedule_pass). `fits_int32(func)` reads it back: every buffer of a scheduled
kernel has at most INT32_MAX elements at those bounds and every parameter is a buffer, so the kernel may be
narrowed to int32 indices (`ForceNarrowIndexToInt32`); no bound, or a larger one, keeps int64.
"""

from __future__ import annotations

import tvm
from tvm import tirx

BOUND_ATTR = "relaxtune.var_upper_bound"
INT32_MAX = 2**31 - 1


def fits_int32(func) -> bool:
    """Every buffer of `func` has < 2^31 elements, with its symbolic dims at their `BOUND_ATTR` bounds;
    all parameters are buffers (a scalar int64 parameter would change type when narrowed)."""
    bounds = dict(func.attrs[BOUND_ATTR]) if func.attrs is not None and BOUND_ATTR in func.attrs else {}
    analyzer = tvm.sym.Analyzer()
    for p in func.params:
        shape = getattr(p, "shape", None)
        if shape is None:
            return False
        for dim in shape:
            for var in tirx.analysis.undefined_vars(dim):
                if str(var.name) not in bounds:
                    return False
                analyzer.bind(
                    var,
                    tvm.ir.Range(
                        tirx.IntImm(str(var.ty.dtype), 0),
                        tirx.IntImm(str(var.ty.dtype), int(bounds[str(var.name)]) + 1),
                    ),
                )
        total = 1
        for dim in shape:
            total *= int(analyzer.const_int_bound(dim).max_value)
            if total > INT32_MAX:
                return False
    return True


def annotate_var_bounds(mod):
    """Write on each PrimFunc `BOUND_ATTR`: {its symbolic dim name: upper bound}, the largest value that
    dim takes over every call_tir of it from a Relax function with `tir_var_upper_bound` (the bucket
    functions); a PrimFunc with a dim no bounded caller determines gets no attribute."""
    from tvm import relax

    call_tir = tvm.ir.Op.get("relax.call_tir")
    found: dict = {}  # GlobalVar name -> {dim name: bound or None (unbounded)}

    def shape_of(ty):
        return (
            list(ty.shape.values)
            if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr)
            else None
        )

    for _gv, func in mod.functions_items():
        if not isinstance(func, relax.Function) or func.attrs is None or "tir_var_upper_bound" not in func.attrs:
            continue
        upper = {str(k): int(v) for k, v in func.attrs["tir_var_upper_bound"].items()}
        lower = (
            {str(k): int(v) for k, v in func.attrs["tir_var_lower_bound"].items()}
            if "tir_var_lower_bound" in func.attrs
            else {}
        )
        analyzer = tvm.sym.Analyzer()
        for var in relax.analysis.defined_symbolic_vars(func):
            if str(var.name) in upper:
                lo = tirx.IntImm(str(var.ty.dtype), lower.get(str(var.name), 0))
                analyzer.bind(var, tvm.ir.Range(lo, tirx.IntImm(str(var.ty.dtype), upper[str(var.name)] + 1)))

        def visit(node, analyzer=analyzer):
            if not isinstance(node, relax.Call) or not node.op.same_as(call_tir):
                return
            callee = node.args[0]
            if not isinstance(callee, tvm.ir.GlobalVar) or not isinstance(mod[callee], tirx.PrimFunc):
                return
            args = list(node.args[1].fields) if isinstance(node.args[1], relax.Tuple) else [node.args[1]]
            outs = list(node.ty.fields) if isinstance(node.ty, relax.TupleType) else [node.ty]
            shapes = [shape_of(a.ty) for a in args] + [shape_of(t) for t in outs]
            dims = found.setdefault(callee.name_hint, {})
            for param, caller in zip(mod[callee].params, shapes):
                callee_shape = getattr(param, "shape", None)
                if callee_shape is None or caller is None or len(caller) != len(callee_shape):
                    continue
                for mine, theirs in zip(callee_shape, caller):
                    if isinstance(mine, tirx.Var):
                        top = analyzer.const_int_bound(theirs).max_value
                        ok = top < 2**62 and dims.get(str(mine.name), 0) is not None
                        dims[str(mine.name)] = max(dims.get(str(mine.name)) or 0, int(top)) if ok else None

        relax.analysis.post_order_visit(func.body, visit)
    out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    for name, dims in found.items():
        known = {k: v for k, v in dims.items() if v is not None}
        if known:
            gv = mod.get_global_var(name)
            out[gv] = mod[gv].with_attr(BOUND_ATTR, known)
    return out
