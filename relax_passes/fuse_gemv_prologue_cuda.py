"""FuseGemvPrologueCuda: relaxtune's (N, K) GEMV kernel computes its own input and its SwiGLU: the RMSNorm before a
projection and the SwiGLU between gate/up and down are no longer kernels of their own (CUDA only).

In the calls RewriteGemvToCuda made for weights kept (N, K) (the decode buckets):

- ``y = relaxtune_gemv_nk(h, w)`` with ``h = R.nn.rms_norm(x, g, axes=[-1], epsilon)`` read by nothing else,
  ``g`` of shape ``(K,)`` becomes ``y = relaxtune_gemv_nk_rms(x, g, w, epsilon)`` (epsilon a float64 PrimValue);
- ``y = relaxtune_gemv_nk(m, w)`` (or ``relaxtune_gemv_nk_add(m, w, r)``) with ``m = silu(gate) * up``, where
  ``gate = gu[..., 0:K]`` and ``up = gu[..., K:2K]`` are the halves of one tensor ``gu (..., 2K)``, as strided
  slices (the merged gate/up product of MergeProjections(copy_slices=True)) or as the two fields of
  ``R.split(gu, 2, axis=-1)`` (a language model's own merged gate/up), and each of ``m``, ``silu(gate)``, ``gate``,
  ``up`` (and the split) is read by nothing else, becomes ``y = relaxtune_gemv_nk_swiglu(gu, w)``
  (``relaxtune_gemv_nk_swiglu_add(gu, w, r)``);
- but where that ``gu`` is itself ``relaxtune_gemv_nk(x, w_gu)`` (or its RMSNorm form, above) read by nothing
  else, the SwiGLU is that GEMV's epilogue instead: ``m = relaxtune_gemv_nk_glu(x, w_gu)``
  (``relaxtune_gemv_nk_rms_glu(x, g, w_gu, epsilon)``), ``m (..., K)``, and the down projection reads ``m``:
  ``y = relaxtune_gemv_nk(m, w)`` (``relaxtune_gemv_nk_add(m, w, r)``).

The kernel (kernels/gemv.py, gemv_prologue.cu's x prologues and gemv_nk.cu's SwiGLU epilogue) computes a prologue's
input once per block into shared memory while its first weight loads are in flight, or pairs each gate row with its up
row and writes silu(gate) * up; rounded where the kernels it replaces round. Matched by operators and types, never by
names: x, g, gu, w and y of one dtype (float16 / bfloat16), the norm over the last axis, unit strides, the slices'
bounds static. K is at most kernels.gemv.PROLOGUE_MAX_K (shared memory).

Why: at n = 1 each of these is a small kernel of its own in the block's CUDA graph, whose launch and whose
output's write and read cost about as much as a tenth of the GEMV after it (docs/results.md, GPU Llama-7B block).

Runs after RewriteGemvToCuda (it reads that pass's calls) and before LegalizeOps; the pipeline adds it for
cuda sm_80+ from config.CudaLibraries (`gemv`, `gemv_prologue`, `gemv_glu`).
"""

from __future__ import annotations

import logging
from collections import Counter

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..kernels.gemv import (
    NK_ADD_FUNCTION,
    NK_FUNCTION,
    NK_GLU_FUNCTION,
    NK_RMS_FUNCTION,
    NK_RMS_GLU_FUNCTION,
    NK_SWIGLU_ADD_FUNCTION,
    NK_SWIGLU_FUNCTION,
    PROLOGUE_MAX_K,
)
from .fusion_utils import extern_call, has_call, is_op, static_int, static_ints, use_counts, with_functions

logger = logging.getLogger(__name__)

DTYPES = ("float16", "bfloat16")
SWIGLU = {NK_FUNCTION: NK_SWIGLU_FUNCTION, NK_ADD_FUNCTION: NK_SWIGLU_ADD_FUNCTION}  # each call and its SwiGLU form


def _tensor(expr, ndim: int | None = None) -> relax.TensorType | None:
    """`expr`'s tensor type when its dtype is one the kernel takes (and its rank `ndim`), else None."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.dtype not in DTYPES or ty.shape is None:
        return None
    return ty if ndim is None or ty.ndim == ndim else None


def _last_axis(axes: list[int] | None, ndim: int) -> bool:
    return axes is not None and len(axes) == 1 and axes[0] in (-1, ndim - 1)


def nk_call(call) -> tuple[str, list] | None:
    """(name, operands) of `call_dps_packed(name, (x, w, ...))` for RewriteGemvToCuda's (N, K) calls, else None."""
    return extern_call(call, SWIGLU)


class PrologueMatcher:
    """The prologues of one function's (N, K) GEMV calls (through `var2val`, reads counted in `uses`)."""

    def __init__(self, func: relax.Function):
        self.var2val = relax.analysis.get_var2val(func)
        self.uses: Counter = use_counts(func)

    def single_use(self, var, op: str) -> relax.Call | None:
        """The call of operator `op` that `var` is bound to, when `var` is read once, else None."""
        value = self.var2val.get(var) if isinstance(var, relax.Var) else None
        return value if is_op(value, op) and self.uses[var] == 1 else None

    def rms(self, x_arg, k: int, dtype: str) -> tuple | None:
        """(x, g, epsilon) when `x_arg` is a single-use rms_norm over the last axis with a (K,) weight."""
        norm = self.single_use(x_arg, "relax.nn.rms_norm")
        if norm is None:
            return None
        x, g = norm.args
        xt, gt = _tensor(x), _tensor(g, ndim=1)
        if xt is None or gt is None or xt.dtype != dtype or gt.dtype != dtype or static_int(gt.shape.values[0]) != k:
            return None
        if not _last_axis([int(a) for a in norm.attrs.axes], xt.ndim):
            return None
        return x, g, float(norm.attrs.epsilon)

    def swiglu(self, x_arg, k: int, dtype: str) -> relax.Expr | None:
        """gu when `x_arg` is single-use `silu(gu[..., :K]) * gu[..., K:2K]` (either operand order), else None."""
        found = self.swiglu_chain(x_arg, k, dtype)
        return found[0] if found else None

    def swiglu_chain(self, x_arg, k: int, dtype: str) -> tuple[relax.Expr, list] | None:
        """(gu, the variables between gu and `x_arg`, `x_arg` included) for `swiglu`'s match, else None."""
        product = self.single_use(x_arg, "relax.multiply")
        if product is None:
            return None
        for gated, up in (product.args, reversed(product.args)):
            silu = self.single_use(gated, "relax.nn.silu")
            if silu is None:
                continue
            gu = self._half(silu.args[0], 0, k)
            if gu is not None and gu.same_as(self._half(up, k, k)) and _tensor(gu).dtype == dtype:
                halves = [silu.args[0], up]
                split = self.var2val[up].tuple_value if isinstance(self.var2val[up], relax.TupleGetItem) else None
                return gu, [x_arg, gated, *halves, *([split] if split is not None else [])]
        return None

    def read_by_swiglu_only(self, gu, between: list) -> bool:
        """Whether `gu` is read by nothing but its SwiGLU, `between` as `swiglu_chain` found it: by the split, or by
        the two slices."""
        return self.uses[gu] == (1 if len(between) == 5 else 2)

    def glu_producers(self) -> tuple[dict, set]:
        """({gu: K} for each gu that a SwiGLU-form call reads and a plain (N, K) GEMV call makes, read by nothing else;
        the variables between each such gu and its reader): the GEMVs that take the SwiGLU as their epilogue."""
        producers, dropped = {}, set()
        for value in list(self.var2val.values()):
            found = nk_call(value)
            if found is None or len(found[1]) < 2 or _tensor(found[1][1], ndim=2) is None:
                continue
            k = static_int(found[1][1].ty.shape.values[1])
            chain = self.swiglu_chain(found[1][0], k, found[1][1].ty.dtype) if k is not None else None
            if chain is None or not isinstance(chain[0], relax.Var):
                continue
            gu, between = chain
            made = nk_call(self.var2val.get(gu))
            wt = _tensor(made[1][1], ndim=2) if made is not None else None
            k_in = static_int(wt.shape.values[1]) if wt is not None else None
            plain_gemv = k_in is not None and made[0] == NK_FUNCTION and k_in <= PROLOGUE_MAX_K
            if plain_gemv and self.read_by_swiglu_only(gu, between):
                producers[gu] = k
                dropped.update(between)
        return producers, dropped

    def _half(self, var, begin: int, k: int) -> relax.Expr | None:
        """gu when `var` is read once and is gu[..., begin:begin + K] of a gu (..., 2K): a unit-stride slice, or field
        begin / K of a split of gu's last axis into two halves read by nothing else; else None."""
        sliced = self.single_use(var, "relax.strided_slice")
        if sliced is None:
            return self._split_half(var, begin // k, k)
        gu = sliced.args[0]
        ty = _tensor(gu)
        if ty is None or static_int(ty.shape.values[-1]) != 2 * k:
            return None
        axes, begins, ends = (static_ints(a) for a in sliced.args[1:4])
        strides = static_ints(sliced.args[4]) if len(sliced.args) > 4 else []
        if not _last_axis(axes, ty.ndim) or strides is None or any(s != 1 for s in strides):
            return None
        return gu if begins == [begin] and ends is not None and min(ends[0], 2 * k) == begin + k else None

    def _split_half(self, var, index: int, k: int) -> relax.Expr | None:
        item = self.var2val.get(var) if isinstance(var, relax.Var) else None
        if not isinstance(item, relax.TupleGetItem) or item.index != index or self.uses[var] != 1:
            return None
        split = self.var2val.get(item.tuple_value) if isinstance(item.tuple_value, relax.Var) else None
        if not is_op(split, "relax.split") or self.uses[item.tuple_value] != 2:  # the gate and the up field
            return None
        gu, parts = split.args[0], split.attrs.indices_or_sections
        ty = _tensor(gu)
        if ty is None or static_int(ty.shape.values[-1]) != 2 * k or not _last_axis([int(split.attrs.axis)], ty.ndim):
            return None
        halves = int(parts) == 2 if isinstance(parts, tirx.IntImm) else [int(i) for i in parts] == [k]
        return gu if halves else None


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, matcher: PrologueMatcher, glu: bool = True):
        super().__init__(mod)
        self.matcher, self.counts = matcher, Counter()
        self.glu, self.dropped = matcher.glu_producers() if glu else ({}, set())

    def visit_var_binding_(self, binding):
        if binding.var in self.dropped:  # the SwiGLU a GEMV's epilogue computes: read by nothing else
            return
        k = self.glu.get(binding.var)
        if k is None:
            super().visit_var_binding_(binding)
            return
        # gu (..., 2K) -> silu(gate) * up (..., K): the GEMV's SwiGLU epilogue
        name, operands = nk_call(binding.value)
        shape = [*binding.value.ty.shape.values[:-1], k]
        fused = self._fused(binding.value, name, operands, relax.TensorType(shape, binding.value.ty.dtype), glu=True)
        dataflow = isinstance(binding.var, relax.DataflowVar)
        self.set_var_remap(binding.var, self.builder_.emit(fused) if dataflow else self.builder_.emit_output(fused))

    def visit_call_(self, call):
        found = nk_call(call)
        new = self._fused(call, *found) if found else None
        return new if new is not None else super().visit_call_(call)

    def _fused(self, call, name: str, operands: list, ty=None, glu: bool = False) -> relax.Call | None:
        x_arg, w = operands[0], operands[1]
        wt, yt = _tensor(w, ndim=2), _tensor(call)
        k = static_int(wt.shape.values[1]) if wt is not None else None
        if k is None or k > PROLOGUE_MAX_K or yt is None or yt.dtype != wt.dtype:
            return None
        ty = ty or call.ty
        if name == NK_FUNCTION:
            norm = self.matcher.rms(x_arg, k, wt.dtype)
            if norm is not None:
                x, g, eps = norm
                self.counts["rms"] += 1
                self.counts["glu"] += glu
                eps_value = relax.prim_value(tirx.FloatImm("float64", eps))
                args = [self.visit_expr(x), self.visit_expr(g), self.visit_expr(w), eps_value]
                return relax.call_dps_packed(NK_RMS_GLU_FUNCTION if glu else NK_RMS_FUNCTION, args, ty)
        if glu:
            self.counts["glu"] += 1
            return relax.call_dps_packed(NK_GLU_FUNCTION, [self.visit_expr(a) for a in operands], ty)
        found = self.matcher.swiglu_chain(x_arg, k, wt.dtype)
        if found is None:
            return None
        gu, between = found
        if between[0] in self.dropped:  # gu's GEMV computes the SwiGLU: the plain product of it
            return relax.call_dps_packed(name, [self.visit_expr(gu), *(self.visit_expr(a) for a in operands[1:])], ty)
        self.counts["swiglu"] += 1
        args = [self.visit_expr(gu), *(self.visit_expr(a) for a in operands[1:])]
        return relax.call_dps_packed(SWIGLU[name], args, ty)


@tvm.transform.module_pass(opt_level=0, name="FuseGemvPrologueCuda")
class FuseGemvPrologueCuda:
    """The RMSNorm / SwiGLU before an (N, K) GEMV call computed by the kernel itself (see above); `glu` False: the
    SwiGLU always as down's prologue, never as gate/up's epilogue."""

    def __init__(self, glu: bool = True):
        self.glu = glu

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function) or not has_call(func, nk_call):
                continue
            rewriter = _Rewriter(mod, PrologueMatcher(func), self.glu)
            new = rewriter.visit_expr(func)
            if not rewriter.counts:
                continue
            updates[gvar] = relax.analysis.remove_all_unused(new)  # the norms, SwiGLUs and slices read no more
            logger.info(
                "%s: %d RMSNorm(s), %d SwiGLU(s) as prologue and %d as epilogue into the (N, K) GEMV",
                gvar.name_hint,
                rewriter.counts["rms"],
                rewriter.counts["swiglu"],
                rewriter.counts["glu"],
            )
        return with_functions(mod, updates)
