"""FuseQuantGemvPrologueCuda: the 4-bit decode GEMV with int8 activations computes its own RMSNorm, so the norm
before a projection (q/k/v) is no kernel of its own (CUDA, sm_90+).

In the calls RewriteQuantGemvToCuda made with int8 activations (the decode buckets),
``y = relaxtune_q4gemv_i8(h, packed, scale)`` with ``h = R.nn.rms_norm(x, g, axes=[-1], epsilon)`` read by nothing
else, ``g`` of shape ``(K,)``, becomes ``y = relaxtune_q4gemv_i8_rms(x, g, packed, scale, epsilon)``.

The matching is FuseGemvPrologueCuda's (`PrologueMatcher`: operators and types, never names), x and g float16. Only
where the streamed kernel takes the product, which the kernels with a prologue need: K / group a multiple of 8 and
K <= kernels.gemv.Q4_PROLOGUE_MAX_K (the host refuses the rest with one line). The kernel (qgemv_stream.cu) computes
each thread's own pieces of x after the previous kernel, the norm in fp32 rounded once to float16 as TVM's
legalized rms_norm, then rounds them to int8 as without a prologue. The SwiGLU before the down projection stays a
kernel: as a prologue (its exp and reciprocal per element in every block) it cost more than its launch (H200,
docs/results.md "GPU 4-bit weights").

Runs after RewriteQuantGemvToCuda (its calls) and FuseQuantMlpCuda (which takes the one-row bucket's second norm
into its own kernel), before LegalizeOps; the pipeline adds it for cuda sm_90+ with `CompileConfig.int8_activations`
and `CudaLibraries.gemv_prologue`.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..kernels.gemv import Q4_I8_FUNCTION, Q4_I8_RMS_FUNCTION, Q4_PROLOGUE_MAX_K
from .fuse_gemv_prologue_cuda import PrologueMatcher
from .fusion_utils import extern_call, has_call, streamed_q4_weight, with_functions

logger = logging.getLogger(__name__)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, matcher: PrologueMatcher):
        super().__init__(mod)
        self.matcher, self.count = matcher, 0

    def visit_call_(self, call):
        found = extern_call(call, (Q4_I8_FUNCTION,))
        new = self._fused(call, found[1]) if found else None
        return new if new is not None else super().visit_call_(call)

    def _fused(self, call, operands: list) -> relax.Call | None:
        x_arg, packed, scale = operands
        weight = streamed_q4_weight(packed, scale, Q4_PROLOGUE_MAX_K)
        norm = self.matcher.rms(x_arg, weight[1], "float16") if weight is not None else None
        if norm is None:
            return None
        x, g, eps = norm
        self.count += 1
        eps_value = relax.prim_value(tirx.FloatImm("float64", eps))
        args = [self.visit_expr(x), self.visit_expr(g), self.visit_expr(packed), self.visit_expr(scale), eps_value]
        return relax.call_dps_packed(Q4_I8_RMS_FUNCTION, args, call.ty)


@tvm.transform.module_pass(opt_level=0, name="FuseQuantGemvPrologueCuda")
class FuseQuantGemvPrologueCuda:
    """The RMSNorm before an int8-activation 4-bit GEMV call computed by the kernel itself (see above)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function) or not has_call(func, lambda e: extern_call(e, (Q4_I8_FUNCTION,))):
                continue
            rewriter = _Rewriter(mod, PrologueMatcher(func))
            new = rewriter.visit_expr(func)
            if rewriter.count:
                updates[gvar] = relax.analysis.remove_all_unused(new)  # the norms read no more
                logger.info("%s: %d RMSNorm(s) into the 4-bit GEMV", gvar.name_hint, rewriter.count)
        return with_functions(mod, updates)
