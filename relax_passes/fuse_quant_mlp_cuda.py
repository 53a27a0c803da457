"""FuseQuantMlpCuda: a one-row decode step's o_proj through its down projection over 4-bit weights as one kernel
(CUDA sm_90+, int8 activations).

In the calls RewriteQuantGemvToCuda made with int8 activations, the chain

    h = relaxtune_q4gemv_i8_add(x, wo, so, res)        # o_proj and the residual
    n = R.nn.rms_norm(h, g, axes=[-1], epsilon)          # read by nothing else
    gu = relaxtune_q4gemv_i8(n, wgu, sgu)               # the merged gate | up projection (2F, H)
    m = silu(gu[..., :F]) * gu[..., F:]                  # slices or a split; each step read by nothing else
    y = relaxtune_q4gemv_i8_add(m, wd, sd, h)           # down and the residual h

where h is read by the norm and the down call only and x is one row, becomes

    mlp = relaxtune_q4mlp_i8(x, res, wo, so, g, wgu, sgu, wd, sd, epsilon)  # outputs (h, m, y)
    y = mlp[2]

and where x is the reshaped output of the one row's flash call read by nothing else (FuseAttentionGemvCuda's
`attention_operands`), the kernel computes that attention too (`attention`, CudaLibraries.gemv_attention):

    mlp = relaxtune_q4mlp_attn_i8(q, k, v, cos, sin, heads, causal, scale, rope, res, wo, so, g, wgu, sgu, wd, sd,
                                  epsilon)

kernels/qmlp_stream.cu: one cooperative launch streams the four weights through one shared-memory ring while its
grid barriers order the steps, so a decode step has four kernels fewer (the norm, the SwiGLU, two GEMVs) and no
weight stream stops between them. The norm and the SwiGLU are matched by FuseGemvPrologueCuda's PrologueMatcher
(operators and types, never names); x, res, g float16; every K a multiple of 8 groups (16-byte scale rows), A and H
at most 12288, F at most 16384 (kernels.gemv.Q4_MLP_MAX_K).

Runs after RewriteQuantGemvToCuda (its int8 calls, the residual adds already in them) and before LegalizeOps; the
pipeline adds it for cuda sm_90+ with `CompileConfig.int8_activations` and `CudaLibraries.q4_mlp`.
"""

from __future__ import annotations

import logging
import math

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..kernels.gemv import Q4_I8_ADD_FUNCTION, Q4_I8_FUNCTION, Q4_MLP_ATTN_FUNCTION, Q4_MLP_FUNCTION, Q4_MLP_MAX_K
from .fuse_attention_gemv_cuda import attention_operands
from .fuse_gemv_prologue_cuda import PrologueMatcher
from .fusion_utils import extern_call, static_shape, streamed_q4_weight, with_functions

logger = logging.getLogger(__name__)

DTYPE = "float16"
Q4_I8 = (Q4_I8_FUNCTION, Q4_I8_ADD_FUNCTION)  # RewriteQuantGemvToCuda's int8-activation calls


def _one_row(x, k: int) -> bool:
    shape = static_shape(x)
    return shape is not None and x.ty.dtype == DTYPE and math.prod(shape) == k


def mlp_matches(func: relax.Function, attention: bool = True) -> tuple[dict, set]:
    """({y: (the fused call's function, operands, output types)} for each chain above in `func`, the variables the
    fused calls replace); `attention`: x may be the one row's attention (the _attn form)."""
    m = PrologueMatcher(func)
    fused, dropped = {}, set()
    max_h, max_f = Q4_MLP_MAX_K
    for var, value in list(m.var2val.items()):
        down = extern_call(value, Q4_I8)
        if down is None or down[0] != Q4_I8_ADD_FUNCTION:
            continue
        act, wd, sd, h = down[1]
        d = streamed_q4_weight(wd, sd, max_f)
        chain = m.swiglu_chain(act, d[1], DTYPE) if d is not None else None
        if chain is None or not isinstance(chain[0], relax.Var):
            continue
        gu, between = chain
        made = extern_call(m.var2val.get(gu), Q4_I8)
        if made is None or made[0] != Q4_I8_FUNCTION or not m.read_by_swiglu_only(gu, between):
            continue
        n_var, wgu, sgu = made[1]
        gate_up = streamed_q4_weight(wgu, sgu, max_h)
        norm = m.rms(n_var, gate_up[1], DTYPE) if gate_up is not None else None
        if norm is None or not (isinstance(h, relax.Var) and norm[0].same_as(h)) or m.uses[h] != 2:
            continue
        o = extern_call(m.var2val.get(h), Q4_I8)
        if o is None or o[0] != Q4_I8_ADD_FUNCTION:
            continue
        x, wo, so, res = o[1]
        out = streamed_q4_weight(wo, so, max_h)
        if out is None or gate_up != (2 * d[1], out[0]) or d[0] != out[0] or not _one_row(x, out[1]):
            continue
        eps = relax.prim_value(tirx.FloatImm("float64", norm[2]))
        weights = [res, wo, so, norm[1], wgu, sgu, wd, sd, eps]
        attn = attention_operands(m.var2val, m.uses, x, out[1], max_rows=1) if attention else None
        if attn is not None:
            fused[var] = (Q4_MLP_ATTN_FUNCTION, [*attn[0], *weights], [h.ty, act.ty, value.ty])
            dropped.update(attn[1])
        else:
            fused[var] = (Q4_MLP_FUNCTION, [x, *weights], [h.ty, act.ty, value.ty])
        dropped.update([h, n_var, gu, *between])
    return fused, dropped


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, fused: dict, dropped: set):
        super().__init__(mod)
        self.fused, self.dropped = fused, dropped

    def visit_var_binding_(self, binding):
        if binding.var in self.dropped:  # computed by the fused kernel, read by nothing else
            return
        found = self.fused.get(binding.var)
        if found is None:
            super().visit_var_binding_(binding)
            return
        function, args, types = found
        mlp = self.builder_.emit(relax.call_dps_packed(function, [self.visit_expr(a) for a in args], types))
        y = relax.TupleGetItem(mlp, 2)
        dataflow = isinstance(binding.var, relax.DataflowVar)
        self.set_var_remap(binding.var, self.builder_.emit(y) if dataflow else self.builder_.emit_output(y))


@tvm.transform.module_pass(opt_level=0, name="FuseQuantMlpCuda")
class FuseQuantMlpCuda:
    """Each one-row o_proj .. down chain of int8-activation 4-bit GEMV calls as one relaxtune_q4mlp_i8 call
    (relaxtune_q4mlp_attn_i8 with the attention before it where `attention`)."""

    def __init__(self, attention: bool = True):
        self.attention = attention

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            fused, dropped = mlp_matches(func, self.attention)
            if not fused:
                continue
            updates[gvar] = _Rewriter(mod, fused, dropped).visit_expr(func)
            logger.info("%s: %d 4-bit MLP(s) as one kernel each", gvar.name_hint, len(fused))
        return with_functions(mod, updates)
