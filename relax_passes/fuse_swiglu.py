"""FuseSwiGLU: `silu(x @ Wg) * (x @ Wu)` → one matmul kernel over an interleaved (K, 2F) weight
whose epilogue computes the gate, so neither (.., F) projection goes through memory.

Stock FuseOps makes two kernels of it (one matmul, and the other matmul with the silu-multiply
epilogue reading the first one's output). Here the gate and up columns are interleaved,
``W[k, 2f] = Wg[k, f]``, ``W[k, 2f + 1] = Wu[k, f]`` — a weight-only op that LiftTransformParams
moves to load time — and the kernel is one contraction ``C[.., j] = sum_k x[.., k] W[k, j]`` with
the epilogue ``out[.., f] = silu(C[.., 2f]) * C[.., 2f + 1]``: each column pair lies in one
register tile, so the CPU matmul rule computes the epilogue per tile (`cpu_matmul`), and
MetaSchedule tunes it as one contraction (a separate pair axis, (K, F, 2), makes MetaSchedule's
design space generation fail in TVM 0.27: "TensorRegion pattern match failed").

Matches operators only (`relax.matmul`, `relax.nn.silu` or its torch-import form
`g * sigmoid(g)`, `relax.multiply`, either operand order), so it fires on imported models as on
the built-in blocks. Fires only when both matmuls
read the same activation, both weights are load-time expressions (fusion_utils), and neither
matmul nor the silu has another consumer.

Run before LiftTransformParams (the stacking must be lifted) and before LegalizeOps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from .fusion_utils import FUSED_OPS_ATTR, inline_load_time, is_load_time, is_op, plain_matmul, use_counts, weight_params

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Match:
    x: relax.Expr
    gate_weight: relax.Expr
    up_weight: relax.Expr


def swiglu_te(x: te.Tensor, weight: te.Tensor) -> te.Tensor:
    """TE of the fused kernel: x (.., K), weight (K, 2F) with gate/up columns interleaved →
    silu(x·W[:, 0::2]) * (x·W[:, 1::2])."""
    red, cols = weight.shape
    k = te.reduce_axis((0, red), "k")
    lead = list(x.shape[:-1])
    acc = te.compute(
        [*lead, cols],
        lambda *i: te.sum(x[(*i[:-1], k)] * weight[k, i[-1]], axis=k),
        name="matmul",
    )

    def gate(*i):
        g = acc[(*i[:-1], 2 * i[-1])]
        return g * tirx.sigmoid(g) * acc[(*i[:-1], 2 * i[-1] + 1)]

    return te.compute([*lead, cols // 2], gate, name="silu_multiply")


def _same_static_shape(a: relax.TensorType, b: relax.TensorType) -> bool:
    dims_a, dims_b = a.shape.values, b.shape.values
    return len(dims_a) == len(dims_b) and all(
        isinstance(p, tirx.IntImm) and isinstance(q, tirx.IntImm) and int(p) == int(q) for p, q in zip(dims_a, dims_b)
    )


def _silu_of(var, var2val) -> tuple[relax.Var, dict] | None:
    """(gate var, {var: reads it must have}) when `var` is silu(gate): `nn.silu(g)` or, as torch
    import decomposes it, `g * sigmoid(g)` in either order."""
    value = var2val.get(var) if isinstance(var, relax.Var) else None
    if value is None:
        return None
    if is_op(value, "relax.nn.silu") and isinstance(value.args[0], relax.Var):
        return value.args[0], {var: 1, value.args[0]: 1}
    if is_op(value, "relax.multiply"):
        for g, s in (value.args, value.args[::-1]):
            sig = var2val.get(s) if isinstance(s, relax.Var) else None
            if sig is not None and is_op(sig, "relax.sigmoid") and sig.args[0].same_as(g) and isinstance(g, relax.Var):
                return g, {var: 1, s: 1, g: 2}
    return None


def _match(mul: relax.Call, var2val, uses, weights) -> _Match | None:
    if not is_op(mul, "relax.multiply"):
        return None
    for silu_var, up_var in (mul.args, mul.args[::-1]):
        silu = _silu_of(silu_var, var2val)
        if silu is None or not isinstance(up_var, relax.Var):
            continue
        gate_var, reads = silu
        gate, up = var2val.get(gate_var), var2val.get(up_var)
        if gate is None or up is None or not (plain_matmul(gate) and plain_matmul(up)):
            continue
        if not gate.args[0].same_as(up.args[0]) or any(uses[v] != k for v, k in {**reads, up_var: 1}.items()):
            continue  # an intermediate with another reader must stay in memory: nothing to gain
        gate_w, up_w = gate.args[1], up.args[1]
        if gate_w.ty.dtype != up_w.ty.dtype or not _same_static_shape(gate_w.ty, up_w.ty):
            continue
        if not (is_load_time(gate_w, weights, var2val) and is_load_time(up_w, weights, var2val)):
            continue
        return _Match(gate.args[0], gate_w, up_w)
    return None


@mutator
class _SwiGLUFuser(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.matches: dict = {}
        self.weights: set = set()
        self.var2val: dict = {}
        self.count = 0

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        found = self.matches.get(binding.var)
        if found is None:
            super().visit_var_binding_(binding)
            return
        bb = self.builder_
        gate_up = [inline_load_time(w, self.weights, self.var2val) for w in (found.gate_weight, found.up_weight)]
        red, feat = (int(d) for d in found.gate_weight.ty.shape.values)
        weight = relax.op.reshape(relax.op.stack(gate_up, axis=2), [red, 2 * feat])  # columns g0 u0 g1 u1 ...
        packed = bb.emit(weight, name_hint="swiglu_weight")
        call = bb.call_te(swiglu_te, self.visit_expr(found.x), packed, primfunc_name_hint="matmul_silu_multiply")
        kernel = call.args[0]
        bb.update_func(kernel, bb.get()[kernel].with_attr(FUSED_OPS_ATTR, ["matmul", "matmul", "silu", "multiply"]))
        new = bb.emit(call) if isinstance(binding.var, relax.DataflowVar) else bb.emit_output(call)
        self.set_var_remap(binding.var, new)
        self.count += 1


@tvm.transform.module_pass(opt_level=0, name="FuseSwiGLU")
class FuseSwiGLU:
    """Gate and up projections with their silu-multiply as one matmul kernel (see module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        fuser = _SwiGLUFuser(mod)
        changed = False
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            var2val = relax.analysis.get_var2val(func)
            uses = use_counts(func)
            weights = weight_params(func)
            fuser.matches = {
                var: m for var, value in var2val.items() if (m := _match(value, var2val, uses, weights)) is not None
            }
            if not fuser.matches:
                continue
            fuser.weights, fuser.var2val = weights, var2val
            new_func = relax.analysis.remove_all_unused(fuser.visit_expr(func))
            fuser.builder_.update_func(gv, new_func)
            changed = True
        if not changed:
            return mod
        logger.info("FuseSwiGLU fused %d gate/up pair(s)", fuser.count)
        return fuser.builder_.get()
