"""QuantDotGemv: one-row projections over 4- or 8-bit weight blocks multiply with int8 dot products.

A call of the kernel `kernels/quant_tir.linear` makes (a ``dequantize`` block annotated with the weight's
format, its float32 scale stages and the ``matmul``; no bias, no cast) whose input is one static row
(1, 1, K) is replaced by a call of `kernels/quant_dot_tir.gemv` with the same arguments: the row quantized
to int8 per 32 values, the weight's integers multiplied as stored with ``vpdpbusd`` (what llama.cpp does
with its Q8_1 activations; on AVX2 without VNNI ``vpmaddubsw`` + ``vpmaddwd``, llama.cpp's pair). Only where the
target has them (`quant_dot_tir.dot_form`) and the format is a 4-bit one with groups of 32
(`quant_dot_tir.eligible`, `INT8_BITS`); any other call is left as it is (the float32 GEMV rule
`cpu_quant_gemv.py` schedules it).

What the kernel fuses (each step read by nothing else): the ``rms_norm`` over the last axis that makes its
input, or the gated input ``silu(gu[..., :K]) * gu[..., K:]`` (a split of the gate/up projection in two),
computed in its serial prologue; and an ``add`` of its output with a residual of the output's type. A
decoder layer's four projections then are four kernels with its two norms, SwiGLU and residual adds.

Run after `SpecializeStaticCalls` (decode's calls, and prefill's in the n = 1 bucket, then have static
shapes) and before `FuseOps`: the new kernel is written scheduled and fuses with nothing; the bindings it
absorbed are left dead (run DeadCodeElimination after it).
"""

from __future__ import annotations

import logging

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ir_attrs import DEQUANTIZE_ATTR, DEQUANTIZE_SCALE_ATTR
from ..kernels import quant_dot_tir
from ..kernels.quant_formats import format_named
from ..schedules.rules import fast_math
from .fusion_utils import is_op, use_counts

logger = logging.getLogger(__name__)

# weight widths whose one-row projections take int8 activations: 4 bits (the int8 kernel runs Q4_1 2x faster
# than the float32 rule, 1 thread, warm); 8-bit blocks stay on the float32 rule, which reads them at the memory's
# speed already (the 49152 x 576 Q8_0 output projection: 1.07-1.24x slower in int8; docs/results.md)
INT8_BITS = (4,)


def _blocks(func: tirx.PrimFunc) -> list:
    found = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, found.append))
    return [b for b in found if b.name_hint != "root"]


def linear_format(func: tirx.PrimFunc):
    """The weight format of a `quant_tir.linear` kernel without bias or cast, else None."""
    blocks = _blocks(func)
    formats = [str(b.annotations[DEQUANTIZE_ATTR]) for b in blocks if DEQUANTIZE_ATTR in b.annotations]
    rest = [b for b in blocks if DEQUANTIZE_ATTR not in b.annotations and DEQUANTIZE_SCALE_ATTR not in b.annotations]
    if len(formats) != 1 or len(rest) != 1 or rest[0].name_hint != "matmul":
        return None
    try:
        return format_named(formats[0])
    except ValueError:
        return None


def _static(shape) -> tuple[int, ...] | None:
    if shape is None or not all(isinstance(d, tirx.IntImm) for d in shape.values):
        return None
    return tuple(int(d) for d in shape.values)


def replacement(func: tirx.PrimFunc, args: list[relax.Expr], out_ty) -> tuple | None:
    """(format, rows, cols) of the int8 kernel for one call of `func` with `args` / `out_ty`, or None where
    it does not apply."""
    fmt = linear_format(func)
    if fmt is None or not isinstance(out_ty, relax.TensorType) or len(args) != 1 + len(fmt.part_names):
        return None
    x_shape, y_shape = _static(args[0].ty.shape), _static(out_ty.shape)
    if x_shape is None or y_shape is None or len(x_shape) != 3 or x_shape[:2] != (1, 1) or y_shape[:2] != (1, 1):
        return None
    if args[0].ty.dtype != "float32" or out_ty.dtype != "float32":
        return None
    rows, cols = y_shape[2], x_shape[2]
    if fmt.bits not in INT8_BITS or not quant_dot_tir.eligible(fmt, cols):
        return None
    if any(_static(a.ty.shape) != s for a, (s, _) in zip(args[1:], fmt.shapes(rows, cols).values())):
        return None
    return fmt, rows, cols


def _row_norm(expr, var2val, uses) -> tuple | None:
    """(x, gamma, eps) where `expr` is a var bound to ``rms_norm(x, gamma)`` over the last axis, read once."""
    value = var2val.get(expr) if isinstance(expr, relax.Var) and uses[expr] == 1 else None
    if not is_op(value, "relax.nn.rms_norm"):
        return None
    x, gamma = value.args
    axes = [int(a) for a in value.attrs.axes]
    if axes not in ([-1], [2]) or _static(gamma.ty.shape) != (_static(x.ty.shape) or (0,))[-1:]:
        return None
    return x, gamma, float(value.attrs.epsilon)


def _gated(expr, var2val, uses) -> relax.Expr | None:
    """gu where `expr` is a var bound to ``silu(gu[..., :K]) * gu[..., K:]`` (a split in two halves), read once."""
    value = var2val.get(expr) if isinstance(expr, relax.Var) and uses[expr] == 1 else None
    if not is_op(value, "relax.multiply"):
        return None
    for gate, up in (value.args, value.args[::-1]):
        silu = var2val.get(gate) if isinstance(gate, relax.Var) and uses[gate] == 1 else None
        if not is_op(silu, "relax.nn.silu"):
            continue
        halves = [var2val.get(v) if isinstance(v, relax.Var) else v for v in (silu.args[0], up)]
        if not all(isinstance(h, relax.TupleGetItem) for h in halves) or [h.index for h in halves] != [0, 1]:
            continue
        split = halves[0].tuple_value
        split = var2val.get(split, split) if isinstance(split, relax.Var) else split
        if not halves[1].tuple_value.same_as(halves[0].tuple_value) or not is_op(split, "relax.split"):
            continue
        sections = split.attrs.indices_or_sections
        if int(split.attrs.axis) in (-1, 2) and isinstance(sections, tvm.tirx.IntImm) and int(sections) == 2:
            return split.args[0]
    return None


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, tile: int, form: str):
        super().__init__(mod)
        self.mod, self.tile, self.form = mod, tile, form
        self.made: dict[tuple, relax.GlobalVar] = {}
        self.var2val, self.uses = {}, {}

    def plan(self, call) -> tuple | None:
        """(kernel key, fused prologue, input args) of an original quantized one-row call, else None."""
        if not is_op(call, "relax.call_tir") or len(call.args) != 2:
            return None
        kernel = self.mod[call.args[0]] if call.args[0] in self.mod.get_global_vars() else None
        args = list(call.args[1].fields) if isinstance(call.args[1], relax.Tuple) else []
        if not isinstance(kernel, tirx.PrimFunc) or not all(isinstance(a.ty, relax.TensorType) for a in args):
            return None
        key = replacement(kernel, args, call.ty)
        if key is None:
            return None
        norm, gu = _row_norm(args[0], self.var2val, self.uses), _gated(args[0], self.var2val, self.uses)
        if norm is not None:
            return key, quant_dot_tir.Fused(norm=True, eps=norm[2]), [norm[0], norm[1], *args[1:]]
        if gu is not None and _static(gu.ty.shape) == (1, 1, 2 * key[2]) and gu.ty.dtype == "float32":
            return key, quant_dot_tir.Fused(swiglu=True), [gu, *args[1:]]
        return key, quant_dot_tir.Fused(), args

    def emit(self, plan: tuple, out_ty, residual=None) -> relax.Call:
        (fmt, rows, cols), fused, args = plan
        if residual is not None:
            fused = quant_dot_tir.Fused(fused.norm, fused.eps, fused.swiglu, residual=True)
            args = [*args, residual]
        key = (fmt.name, rows, cols, fused)
        if key not in self.made:
            func = fast_math.rewrite(quant_dot_tir.gemv(fmt, rows, cols, self.tile, fused, self.form))  # the gate's exp
            self.made[key] = self.builder_.add_func(func, kernel_name(fmt.name, rows, cols, fused))
        return relax.call_tir(self.made[key], [self.visit_expr(a) for a in args], out_ty)

    def visit_call_(self, call):
        if is_op(call, "relax.add"):
            for lin, other in (call.args, call.args[::-1]):
                value = self.var2val.get(lin) if isinstance(lin, relax.Var) and self.uses[lin] == 1 else None
                plan = self.plan(value) if value is not None else None
                if plan is not None and _same(other.ty, value.ty):
                    return self.emit(plan, value.ty, residual=other)
        plan = self.plan(call)
        if plan is not None:
            return self.emit(plan, call.ty)
        return self.visit_expr_post_order(call)


def kernel_name(fmt: str, rows: int, cols: int, fused: quant_dot_tir.Fused) -> str:
    """quant_dot_gemv_FMT_NxK[_norm | _swiglu][_residual]: what each kernel holds, readable in profiles."""
    prologue = "_norm" if fused.norm else "_swiglu" if fused.swiglu else ""
    return f"quant_dot_gemv_{fmt}_{rows}x{cols}{prologue}{'_residual' if fused.residual else ''}"


def _same(a, b) -> bool:
    return (
        isinstance(a, relax.TensorType)
        and isinstance(b, relax.TensorType)
        and a.dtype == b.dtype
        and _static(a.shape) is not None
        and _static(a.shape) == _static(b.shape)
    )


@tvm.transform.module_pass(opt_level=0, name="QuantDotGemv")
class QuantDotGemv:
    """One-row quantized projections with int8 dot products (see the module docstring)."""

    def __init__(self, target, tile: int = quant_dot_tir.TILE):
        self.target, self.tile = target, tile

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        form = quant_dot_tir.dot_form(self.target)
        if form is None:
            return mod
        rewriter = _Rewriter(mod, self.tile, form)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.var2val, rewriter.uses = relax.analysis.get_var2val(func), use_counts(func)
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        if rewriter.made:
            logger.debug("QuantDotGemv: %d int8 kernel(s)", len(rewriter.made))
        return rewriter.builder_.get()
