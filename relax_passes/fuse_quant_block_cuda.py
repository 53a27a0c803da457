"""FuseQuantBlockCuda: a one-row decode step's whole decoder layer over 4-bit weights as one kernel (CUDA sm_90+,
int8 activations): the q/k/v projection and its RMSNorm join the fused attention + MLP kernel.

After FuseQuantMlpCuda and FuseQuantGemvPrologueCuda, the chain

    qkv = relaxtune_q4gemv_i8_rms(x, gin, wqkv, sqkv, eps_in)           # q | k | v, read by the reshape only
    qkv4 = R.reshape(qkv, (1, 1, heads, D))                              # read by the fused call only
    mlp = relaxtune_q4mlp_attn_i8(qkv4, qkv4, qkv4, cos, sin, heads, causal, scale, rope, res, wo, ..., eps)

where every read of `mlp` takes one of its fields, becomes

    block = relaxtune_q4block_i8(x, gin, wqkv, sqkv, eps_in, cos, sin, heads, causal, scale, rope, res, wo, ...,
                                 eps)                                    # outputs (qkv4, h, act, y)

and `mlp[i]` becomes `block[i + 1]`. kernels/qmlp_stream.cu: the q/k/v rows stream through the same ring ahead of
o_proj's, a grid barrier after them, then every block computes the row's attention from them (the q/k/v GEMV's
launch, ramp-up and tail gone). x must be one float16 row of H values (the MLP's, so H <= Q4_MLP_MAX_K[0]); q, k and
v one merged weight (MergeQuantProjections) whose scale rows the kernel copies whole.

Runs after FuseQuantGemvPrologueCuda (the norm already in the q/k/v call) and before LegalizeOps; the pipeline adds
it with FuseQuantMlpCuda's attention form and `CudaLibraries.q4_block`.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..kernels.gemv import Q4_BLOCK_FUNCTION, Q4_I8_RMS_FUNCTION, Q4_MLP_ATTN_FUNCTION, Q4_MLP_MAX_K
from .fusion_utils import consumers, extern_call, is_op, static_shape, streamed_q4_weight, use_counts, with_functions

logger = logging.getLogger(__name__)


def _fields_only(var: relax.Var, users: dict) -> bool:
    """Whether every read of `var` takes one field of it (R.TupleGetItem)."""
    readers = users.get(var, [])
    return bool(readers) and all(isinstance(r, relax.TupleGetItem) and r.tuple_value.same_as(var) for r in readers)


def block_matches(func: relax.Function) -> dict:
    """{the fused MLP call's variable: (the layer call's operands, output types)} for each chain above in `func`."""
    var2val, uses, users = relax.analysis.get_var2val(func), use_counts(func), consumers(func)
    fused = {}
    for var, value in var2val.items():
        mlp = extern_call(value, (Q4_MLP_ATTN_FUNCTION,))
        if mlp is None or not _fields_only(var, users):
            continue
        q, k, v, *attention = mlp[1][:9]
        if not (isinstance(q, relax.Var) and q.same_as(k) and q.same_as(v) and uses[q] == 3):
            continue
        reshape = var2val.get(q)
        qkv = reshape.args[0] if is_op(reshape, "relax.reshape") else None
        if not isinstance(qkv, relax.Var) or uses[qkv] != 1:
            continue
        made = extern_call(var2val.get(qkv), (Q4_I8_RMS_FUNCTION,))
        if made is None:
            continue
        x, gin, wqkv, sqkv, eps_in = made[1]
        res = mlp[1][9]
        weight, hidden = streamed_q4_weight(wqkv, sqkv, Q4_MLP_MAX_K[0]), (static_shape(res) or [0])[-1]
        if weight is None or weight[1] != hidden or static_shape(x) != static_shape(res):
            continue
        fused[var] = ([x, gin, wqkv, sqkv, eps_in, *attention, *mlp[1][9:]], [q.ty, *value.ty.fields])
    return fused


@mutator
class _Rewriter(PyExprMutator):
    """The fused MLP calls of `fused` as layer calls, their fields one on; the q/k/v call and its reshape are then
    read by nothing (remove_all_unused)."""

    def __init__(self, mod: tvm.IRModule, fused: dict):
        super().__init__(mod)
        self.fused, self.blocks = fused, {}

    def visit_var_binding_(self, binding):
        found = self.fused.get(binding.var)
        if found is None:
            super().visit_var_binding_(binding)
            return
        args, types = found
        self.blocks[binding.var] = self.builder_.emit(
            relax.call_dps_packed(Q4_BLOCK_FUNCTION, [self.visit_expr(a) for a in args], types)
        )

    def visit_tuple_getitem_(self, op):
        block = self.blocks.get(op.tuple_value)
        return relax.TupleGetItem(block, op.index + 1) if block is not None else super().visit_tuple_getitem_(op)


@tvm.transform.module_pass(opt_level=0, name="FuseQuantBlockCuda")
class FuseQuantBlockCuda:
    """Each one-row relaxtune_q4mlp_attn_i8 call fed by the q/k/v projection's relaxtune_q4gemv_i8_rms call (through
    one reshape) as one relaxtune_q4block_i8 call."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            fused = block_matches(func)
            if not fused:
                continue
            updates[gvar] = relax.analysis.remove_all_unused(_Rewriter(mod, fused).visit_expr(func))
            logger.info("%s: %d 4-bit decoder layer(s) as one kernel each", gvar.name_hint, len(fused))
        return with_functions(mod, updates)
