"""SpecializeStaticCalls: a quantized kernel with symbolic buffer shapes called where some of them are
constants gets a copy specialised to the call's shapes.

Kernels a model emits itself (`call_tir` of a TE function, e.g. the quantized projections of
`models/quant_linear.py`) are made once with the model's symbolic dimensions. `BucketDispatch` then
binds a dimension to a constant in an exact bucket (n = 1), where operators legalised later get
static kernels but these keep their symbolic ones; FuseTIR refuses to fuse such a call with a static
neighbour (an output buffer of shape (1, n, d) read as (1, 1, d): "Inconsistent buffers"). Run after
`BucketDispatch` and before `FuseOps`. Calls whose output has no constant dimension, or with extra TIR
arguments, are left as they are, and so are kernels that dequantize nothing (no block annotated
``ir_attrs.DEQUANTIZE_ATTR``): the other kernels passes emit keep the form their tuning records match.
"""

from __future__ import annotations

import logging

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ir_attrs import DEQUANTIZE_ATTR

logger = logging.getLogger(__name__)


def _known_shape(ty) -> bool:
    if isinstance(ty, relax.TupleType):
        return all(_known_shape(f) for f in ty.fields)
    return isinstance(ty, relax.TensorType) and ty.shape is not None


def _binds_constant(kernel: tirx.PrimFunc, ty) -> bool:
    """Whether the call's output type `ty` has a constant where the kernel's output buffer is symbolic."""
    outs = list(ty.fields) if isinstance(ty, relax.TupleType) else [ty]
    buffers = kernel.params[len(kernel.params) - len(outs) :]
    return any(
        not isinstance(k, tirx.IntImm) and isinstance(c, tirx.IntImm)
        for out, buf in zip(outs, buffers)
        for k, c in zip(buf.shape, out.shape.values)
    )


def _symbolic(func: tirx.PrimFunc) -> bool:
    """Whether a buffer parameter of `func` has a dimension that is not a constant."""
    shapes = [getattr(p, "shape", None) for p in func.params]
    return any(s is not None and not all(isinstance(d, tirx.IntImm) for d in s) for s in shapes)


def _dequantizes(func: tirx.PrimFunc) -> bool:
    """Whether a block of `func` is annotated as a dequantization (`kernels/quant_tir.py`)."""
    found = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, lambda b: found.append(DEQUANTIZE_ATTR in b.annotations)))
    return any(found)


def specialise(kernel: tirx.PrimFunc, args: list[relax.Expr], out_ty) -> tirx.PrimFunc:
    """`kernel` specialised to the static types of one call's `args` and output."""
    bb = relax.BlockBuilder()
    gv = bb.add_func(kernel, "kernel")
    params = [relax.Var(f"arg{i}", a.ty) for i, a in enumerate(args)]
    with bb.function("caller", params):
        bb.emit_func_output(bb.emit(relax.call_tir(gv, params, out_ty)))
    return relax.transform.SpecializePrimFuncBasedOnCallSite()(bb.get())["kernel"]


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod = mod
        self.count = 0

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_tir") or len(call.args) != 2:
            return call
        kernel = self.mod[call.args[0]] if call.args[0] in self.mod.get_global_vars() else None
        args = list(call.args[1].fields)
        if not isinstance(kernel, tirx.PrimFunc) or not _symbolic(kernel) or not _dequantizes(kernel):
            return call
        if not all(_known_shape(a.ty) for a in args) or not _known_shape(call.ty):
            return call
        if not _binds_constant(kernel, call.ty):  # nothing bound to a constant: the symbolic kernel fits
            return call
        try:
            static = specialise(kernel, args, call.ty)
        except (tvm.error.InternalError, TypeError) as err:  # a scalar argument: keep the call
            logger.debug("%s not specialised: %s", call.args[0].name_hint, err)
            return call
        gv = self.builder_.add_func(static, call.args[0].name_hint)
        self.count += 1
        out = call.ty if isinstance(call.ty, relax.TensorType) else list(call.ty.fields)
        return relax.call_tir(gv, args, out)


@tvm.transform.module_pass(opt_level=0, name="SpecializeStaticCalls")
class SpecializeStaticCalls:
    """Give each static call of a symbolic kernel its own static kernel (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewriter(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        if rewriter.count:
            logger.debug("SpecializeStaticCalls: %d call(s) given static kernels", rewriter.count)
        return rewriter.builder_.get()  # the symbolic originals left unused go in the pipeline's DCE
