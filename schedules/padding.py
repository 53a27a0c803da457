"""Pad a symbolic dimension up to the tile multiple of its tuned schedule, so no guard is needed.

A kernel is padded along dimension `n` only when that is exact: `n` appears in its buffers as a
whole axis and only spatial (data-parallel) block iterators range over it, so padded rows are
computed from zeros, never mixed into real rows, and sliced off afterwards. The caller pads the
inputs (one copy kernel that zero-fills the new rows), calls a copy of the kernel specialised to `n_tiles * multiple`
rows
(which takes `n_tiles` as a leading scalar argument), and slices the outputs back to `n`.
"""

from __future__ import annotations

from tvm import relax, te, tirx

from .replay import fresh_schedule


def _uses(expr, names: set[str]) -> bool:
    return any(v.name in names for v in tirx.analysis.undefined_vars(expr))


def _blocks(func: tirx.PrimFunc):
    sch = fresh_schedule(func)
    pending = [sch.get_sblock("root", func_name="main")]
    while pending:
        block_rv = pending.pop()
        yield sch.get(block_rv)
        pending.extend(sch.get_child_blocks(block_rv))


def can_pad(func: tirx.PrimFunc, names: set[str]) -> bool:
    """Whether padding dimensions `names` of this kernel leaves its real outputs unchanged."""
    for param in func.params:
        if not hasattr(param.ty, "shape"):
            if _uses(param, names):
                return False
            continue
        for dim in param.shape:
            if _uses(dim, names) and not (isinstance(dim, tirx.Var) and dim.name in names):
                return False
    for block in _blocks(func):
        for iv in block.iter_vars:
            if int(iv.iter_type) != 0 and _uses(iv.dom.extent, names):
                return False
    return True


def _tiles(var: tirx.Var) -> tirx.Var:
    return tirx.Var(f"{var.name}_tiles", "int64")


def _padded_shape(shape, tiles: dict[str, tuple[tirx.Var, int]]) -> list:
    """Each padded dimension `n` becomes `n_tiles * multiple`."""
    return [tiles[d.name][0] * tiles[d.name][1] if isinstance(d, tirx.Var) and d.name in tiles else d for d in shape]


def _zero_filled(x: te.Tensor, axis: int, rows, padded) -> te.Tensor:
    """x with `axis` grown from `rows` to `padded`, the new rows zeros: one copy kernel."""
    shape = list(x.shape)
    shape[axis] = padded
    zero = tirx.const(0, x.dtype)
    return te.compute(shape, lambda *i: tirx.if_then_else(i[axis] < rows, x(*i), zero), name="zero_filled")


def emit_padded_call(bb: relax.BlockBuilder, kernel_gv, args, out_ty: relax.TensorType, pads) -> relax.Expr:
    """Emit: pad inputs with zeros to ceil(n / multiple) tiles; call; slice the output back to n.

    Each input is grown by one copy kernel that writes zeros past row n. Not `concat` with a zeros
    tensor: at an n that is already a multiple, that tensor has no rows, and on the H200 gpt2-block's
    small-bucket records then gave outputs 100% off at exactly n = 16 (right at 2..15 and at 17..128)."""
    tiles = {name: ((var + (multiple - 1)) // multiple, multiple) for name, (var, multiple) in pads.items()}
    padded_args = []
    for arg in args:
        if isinstance(arg.ty, relax.TensorType) and arg.ty.shape is not None:
            for axis, dim in enumerate(arg.ty.shape.values):
                if isinstance(dim, tirx.Var) and dim.name in pads:
                    count, multiple = tiles[dim.name]
                    arg = bb.emit_te(_zero_filled, arg, axis, dim, count * multiple, primfunc_name_hint="zero_filled")
        padded_args.append(arg)
    scalars = [relax.prim_value(count) for count, _ in tiles.values()]
    out_shape = out_ty.shape.values
    result = bb.emit(
        relax.call_tir(
            kernel_gv, scalars + padded_args, relax.TensorType(_padded_shape(out_shape, tiles), out_ty.dtype)
        )
    )
    axes = [a for a, d in enumerate(out_shape) if isinstance(d, tirx.Var) and d.name in pads]
    return bb.emit(
        relax.op.strided_slice(result, axes, [0] * len(axes), [out_shape[a] for a in axes], assume_inbound=True)
    )


def padded_kernel(kernel: tirx.PrimFunc, arg_types, out_ty, pads) -> tirx.PrimFunc:
    """A copy of `kernel` over `n_tiles * multiple` rows, taking each `n_tiles` as a scalar.

    Extents written as a product with a fresh variable let TVM prove every tile divides them,
    so the tuned schedule applies without a guard.
    """
    tiles = {name: (_tiles(var), multiple) for name, (var, multiple) in pads.items()}
    bb = relax.BlockBuilder()
    gv = bb.add_func(kernel, "kernel")
    shape_param = relax.Var("tiles", relax.ShapeType([count for count, _ in tiles.values()]))
    params = [shape_param] + [
        relax.Var(f"arg{i}", relax.TensorType(_padded_shape(t.shape.values, tiles), t.dtype))
        for i, t in enumerate(arg_types)
    ]
    with bb.function("caller", params):
        out_padded = relax.TensorType(_padded_shape(out_ty.shape.values, tiles), out_ty.dtype)
        out = bb.emit(relax.call_tir(gv, params[1:], out_padded))
        bb.emit_func_output(out)
    spec = relax.transform.SpecializePrimFuncBasedOnCallSite()(bb.get())["kernel"]
    scalars = [count for count, _ in tiles.values()]
    return tirx.PrimFunc(scalars + list(spec.params), spec.body, spec.ret_type, spec.attrs)
