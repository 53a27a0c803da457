"""Converters relaxtune adds to TVM's ONNX importer for what today's exporters emit.

``torch.onnx.export`` (the dynamo exporter) writes shape arithmetic as small scalar graphs: the
sequence length as ``Squeeze(Shape(x))``, position ids as ``Range(0, n, 1)``, views as
``Reshape(x, Concat(..., [-1]))``. TVM 0.27's importer turns those scalars into symbolic
expressions, then fails on three of the forms (Hugging Face GPT-2 and Llama exports, measured):

- ``Range`` with a symbolic limit gets a fresh length variable (``range_len_0``) instead of the
  limit itself, so the positions no longer broadcast against ``n`` and every later shape is lost
  (``Expand``: "'NoneType' object is not iterable"). Here: ``arange(start, limit, step)`` with the
  limit kept as the expression it is.
- ``Reshape`` of a symbolic scalar to ``[1]`` (building a shape vector) fails with "Reshape
  expects the input data to be a Tensor". Here: the one-element shape ``(value,)``.
- ``Reshape`` to a symbolic shape with a ``-1`` entry is left to run-time inference, which fails
  when the target shape is symbolic. Here: the ``-1`` is solved from the input's known shape.

Every other case goes to TVM's own converter unchanged. Used by
:mod:`relaxtune.workloads.onnx_import` around ``from_onnx``; the fixes live here, not in TVM.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


def _converters():
    import tvm
    import tvm.relax.frontend.onnx.onnx_frontend as fe
    from tvm import relax, tirx
    from tvm.sym import Analyzer

    def const_int(value) -> int | None:
        if isinstance(value, tvm.ir.GenericConst):
            array = value.value.numpy()
            if array.size == 1 and array.dtype.kind in "iu":
                return int(array.item())
        return None

    def is_minus_one(dim) -> bool:
        return isinstance(dim, tirx.IntImm) and dim.value == -1

    class Range(fe.Range):
        @classmethod
        def _impl_v12(cls, bb, inputs, attr, params):
            start, limit, delta = (fe.get_constant(x, params) for x in inputs[:3])
            first, step = const_int(start), const_int(delta)
            if first is not None and step is not None and tvm.ir.is_prim_expr(limit):
                dtype = str(start.value.numpy().dtype)
                return relax.op.arange(first, Analyzer().simplify(limit), step, dtype)
            return super()._impl_v12(bb, inputs, attr, params)

    class Reshape(fe.Reshape):
        @classmethod
        def _impl_v13(cls, bb, inputs, attr, params):
            data, shape = inputs[0], fe.get_constant(inputs[1], params)
            if tvm.ir.is_prim_expr(data):
                if isinstance(shape, tvm.ir.GenericConst) and shape.value.numpy().tolist() in ([1], [-1]):
                    return relax.ShapeExpr([data])
            known = getattr(getattr(data, "ty", None), "shape", None)
            if isinstance(shape, relax.ShapeExpr) and known is not None:
                dims, source = list(shape.values), list(known)
                if not attr.get("allowzero", 0):  # 0 copies the input's dimension
                    dims = [source[i] if isinstance(d, tirx.IntImm) and d.value == 0 else d for i, d in enumerate(dims)]
                free = [i for i, d in enumerate(dims) if is_minus_one(d)]
                if len(free) == 1:
                    total, rest = 1, 1
                    for d in source:
                        total = total * d
                    for i, d in enumerate(dims):
                        rest = rest * d if i != free[0] else rest
                    dims[free[0]] = Analyzer().simplify(tirx.floordiv(total, rest))
                    return relax.op.reshape(data, relax.ShapeExpr(dims))
            return super()._impl_v13(bb, inputs, attr, params)

    return {"Range": Range, "Reshape": Reshape}


@contextlib.contextmanager
def relaxtune_converters() -> Iterator[None]:
    """TVM's ONNX importer with relaxtune's converters in place of its own (restored on exit)."""
    import tvm.relax.frontend.onnx.onnx_frontend as fe

    stock = fe._get_convert_map
    fixes = _converters()
    fe._get_convert_map = lambda: {**stock(), **fixes}
    try:
        yield
    finally:
        fe._get_convert_map = stock
