"""PackQuantWeightsCuda: 4-bit weights that only quantized projections read are repacked at load into the GPU
layout, and those projections read it (CUDA only).

A quantized projection is `R.call_tir(k, (x, qweight, scale))` of a kernel `k` that dequantizes a weight as it
reads it (`kernels/quant_tir.linear`: a block annotated ``ir_attrs.DEQUANTIZE_ATTR`` with a 4-bit format whose
value is ``(q - 8) * scale``: relaxtune's q4 groups, GGUF's Q4_0, and a reduction block), x float16 (..., K),
the output float16, no bias; `qweight` (N, K / 2) uint8 and `scale` (N, K / group) float16 static parameters
of the function `f` (weights: after ``num_input``). For each such `qweight` that nothing else reads, the
transform function `f_transform_params` (LiftTransformParams') returns `pack_q4(qweight)` instead (N, K / 8)
uint32 (`kernels/quant_gpu_tir.py`: `quant_formats.pack_q4_gpu`'s layout, computed on the device once, at load),
`f` takes that, and each projection becomes `R.call_tir(linear, (x, packed, scale))` over the GPU layout
(`quant_gpu_tir.linear`, its dequantization block annotated ``ir_attrs.GPU_Q4_ATTR``). Matched by operators,
annotations and types, never by names.

Why: the decode GEMV kernel (kernels/qgemv.cu) turns a pair of nibbles into a half2 with one LOP3 and one HADD2
when the pair sits at the same bit offsets of a word's two halves, next to x's pair; GGUF's order (weights i
and i + 16 in one byte) would need a permutation per vector. The scales stay as they are.

Run after LiftTransformParams (and KeepWeightsNK) and before MergeQuantProjections (merge_quant_projections.py)
and BucketDispatch; RewriteQuantGemvToCuda (quant_gemv_cuda.py) then gives each bucket's projections their
kernels. The pipeline adds the three for cuda sm_80+ with the cuda libraries on (config.CudaLibraries).
"""

from __future__ import annotations

import logging

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ir_attrs import DEQUANTIZE_ATTR
from ..kernels import quant_gpu_tir
from ..kernels.quant_formats import format_named, is_gpu_q4
from .fusion_utils import consumers, lifted_functions, output_binding, rewrite_output_tuple

logger = logging.getLogger(__name__)


def _static_shape(ty, dtype: str) -> list[int] | None:
    if not isinstance(ty, relax.TensorType) or ty.dtype != dtype or ty.shape is None:
        return None
    dims = ty.shape.values
    return [int(d) for d in dims] if all(isinstance(d, tirx.IntImm) for d in dims) else None


def _q4_linear_format(kernel) -> bool:
    """Whether `kernel` is a projection dequantizing a 4-bit weight the GPU layout takes (see above)."""
    if not isinstance(kernel, tirx.PrimFunc):
        return False
    formats, reductions = [], []

    def visit(block):
        if DEQUANTIZE_ATTR in block.annotations:
            formats.append(str(block.annotations[DEQUANTIZE_ATTR]))
        reductions.append(any(iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars))

    tvm_ffi.structural_walk(kernel.body, (s_tir.SBlock, visit))
    try:
        fmts = [format_named(name) for name in formats]
    except ValueError:
        return False
    return len(fmts) == 1 and is_gpu_q4(fmts[0]) and any(reductions)


def q4_projection(mod: tvm.IRModule, call, weights: set) -> tuple | None:
    """(x, qweight, scale) of a quantized projection (see above) whose weight parts are among `weights`, else None."""
    if not (isinstance(call, relax.Call) and call.op == tvm.ir.Op.get("relax.call_tir")) or len(call.args) != 2:
        return None
    gv, args = call.args
    if gv not in mod.get_global_vars() or not isinstance(args, relax.Tuple) or len(args.fields) != 3:
        return None
    x, qweight, scale = args.fields
    if qweight not in weights or scale not in weights or not _q4_linear_format(mod[gv]):
        return None
    xt, out = x.ty, call.ty
    q, s = _static_shape(qweight.ty, "uint8"), _static_shape(scale.ty, "float16")
    if not (isinstance(xt, relax.TensorType) and xt.dtype == "float16" and xt.shape is not None) or not (q and s):
        return None
    k = xt.shape.values[-1]
    if not isinstance(k, tirx.IntImm) or int(k) != 2 * q[1] or s[0] != q[0] or int(k) % s[1]:
        return None
    group = int(k) // s[1]
    if group % 32 or (group // 32) & (group // 32 - 1):  # 32 x a power of two: the kernel's vectors
        return None
    if not (isinstance(out, relax.TensorType) and out.dtype == "float16" and out.ndim == xt.ndim):
        return None
    return x, qweight, scale


def _read_as_q4_weight_only(mod: tvm.IRModule, param: relax.Var, readers: list, weights: set) -> bool:
    """Whether every reader of `param` is a quantized projection whose 4-bit weight it is."""
    for reader in readers or [None]:
        found = q4_projection(mod, reader, weights)
        if found is None or not found[1].same_as(param):
            return False
    return True


def _with_output_tuple(tfunc: relax.Function) -> relax.Function:
    """`tfunc` with its outputs as one tuple binding (what `output_binding` reads): LiftTransformParams returns the
    parameter itself when it lifted nothing (the quantized projections read their parts as they are)."""
    body = tfunc.body
    result = body.body if isinstance(body, relax.SeqExpr) else body
    param = tfunc.params[0] if len(tfunc.params) == 1 else None
    if param is None or not result.same_as(param) or not isinstance(param.ty, relax.TupleType):
        return tfunc
    bb = relax.BlockBuilder()
    with bb.function("transform", [param]):
        with bb.dataflow():
            fields = [bb.emit(relax.TupleGetItem(param, i)) for i in range(len(param.ty.fields))]
            out = bb.emit_output(relax.Tuple(fields))
        bb.emit_func_output(out)
    made = bb.get()["transform"]
    return relax.Function(made.params, made.body, made.ret_ty, made.is_pure, tfunc.attrs)


@mutator
class _Projections(PyExprMutator):
    """`f` with each projection of a packed weight reading its GPU layout."""

    def __init__(self, mod, packed: dict, weights: set):
        super().__init__(mod)
        self.mod, self.packed, self.weights = mod, packed, weights

    def visit_call_(self, call):
        found = q4_projection(self.mod, call, self.weights)
        if found is None or found[1] not in self.packed:
            return super().visit_call_(call)
        x, qweight, scale = found
        return self.builder_.call_te(
            quant_gpu_tir.linear, self.visit_expr(x), self.packed[qweight], scale, primfunc_name_hint="q4_gpu_linear"
        )


def _packed(picked: set[int]):
    """The transform function's new outputs: those at `picked` packed into the GPU layout."""

    def rewrite(bb: relax.BlockBuilder, fields: list) -> list:
        return [
            bb.emit(bb.call_te(quant_gpu_tir.pack_q4, f, primfunc_name_hint="pack_q4_gpu")) if i in picked else f
            for i, f in enumerate(fields)
        ]

    return rewrite


@tvm.transform.module_pass(opt_level=0, name="PackQuantWeightsCuda")
class PackQuantWeightsCuda:
    """4-bit weights only quantized projections read: the GPU layout, packed at load (see above)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gv, func, transform, num_input in lifted_functions(mod):
            tfunc = _with_output_tuple(mod[transform])
            binding = output_binding(tfunc)
            if binding is None or len(binding.value.fields) != len(func.params) - num_input:
                continue
            weights = set(func.params[num_input:])
            readers = consumers(func)
            picked = {}
            for i, p in enumerate(func.params[num_input:], num_input):
                if _read_as_q4_weight_only(mod, p, readers.get(p, []), weights):
                    rows, half = (int(d) for d in p.ty.shape.values)
                    picked[p] = (i, relax.Var(p.name, relax.TensorType([rows, half // 4], "uint32")))
            if not picked:
                continue
            params = [picked[p][1] if p in picked else p for p in func.params]
            packed = {p: new for p, (_i, new) in picked.items()}
            rewriter = _Projections(mod, packed, weights)
            new_func = rewriter.visit_expr(relax.Function(params, func.body, func.ret_ty, func.is_pure, func.attrs))
            mod = rewriter.builder_.get()
            mod[gv] = new_func
            mod = rewrite_output_tuple(mod, transform, tfunc, _packed({i - num_input for i, _new in picked.values()}))
            logger.info("%s: %d 4-bit weight(s) packed for the GPU at load", gv.name_hint, len(picked))
        return mod
