"""FuseNormIntoGemv: at decode-sized buckets, a LayerNorm and the projection that reads it are one kernel.

``y = layer_norm(x, gamma, beta)`` over the last axis, read only by ``z = matmul(y, W)`` (a 2-D
weight), and the element-wise chain after it (a bias or residual ``add`` / ``multiply`` /
``subtract`` with an operand computed before the chain, ``gelu``, ``gelu_tanh``, ``silu``,
``sigmoid``, ``tanh``; each step read only by the next): when the rows of ``x`` (the product of
the upper bounds of its leading axes, in the bucket's function) are at most ``MAX_ROWS``, the
chain becomes a call of a private function marked ``Primitive``, which LegalizeOps legalizes and
FuseTIR makes one kernel: the LayerNorm's statistics and normalized rows, then the GEMV and its
epilogue (`schedules/rules/cpu_norm_gemv.py` computes the few normalized rows once, on one thread,
before the parallel GEMV). FuseOps never puts a LayerNorm (a reduction) and a matmul in one kernel.

At a decode step (gpt2-block, n = 1) the LayerNorm kernel is ~1 us of work and its own VM call
and output; after this pass a block has 2 kernel calls fewer.

Matches operators and attributes only. Left alone: a LayerNorm over other axes, one read by
anything else than one matmul (or also by something else), a matmul with a weight of another
rank or another output dtype, rows with no upper bound or above ``MAX_ROWS`` (prefill buckets:
there the LayerNorm is a small share and the GEMM's row tiling wants its rows in memory).

Runs after BucketDispatch (it reads each bucket's bounds), before LegalizeOps.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .fusion_utils import is_op, plain_matmul, upper_bound, upper_bounds, use_counts

logger = logging.getLogger(__name__)

MAX_ROWS = 16  # b <= 4 and n <= 4: the decode buckets of the built-in blocks
BINARY = ("relax.add", "relax.multiply", "relax.subtract")
UNARY = ("relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.silu", "relax.sigmoid", "relax.tanh")


def _last_axis_norm(call) -> bool:
    if not is_op(call, "relax.nn.layer_norm") or not isinstance(call.args[0].ty, relax.TensorType):
        return False
    ndim = call.args[0].ty.ndim
    axes = [int(a) for a in call.attrs.axes]
    return len(axes) == 1 and axes[0] in (-1, ndim - 1)


def _rows(x: relax.Expr, bounds: dict[str, int]) -> int | None:
    shape = x.ty.shape
    if shape is None or not isinstance(shape, relax.ShapeExpr):
        return None
    rows = 1
    for dim in shape.values[:-1]:
        bound = upper_bound(dim, bounds)
        if bound is None:
            return None
        rows *= bound
    return rows


class _Chain:
    """One LayerNorm → matmul → element-wise chain: its calls in order and the vars they bind."""

    def __init__(self, calls: list, vars_: list):
        self.calls, self.vars = calls, vars_

    def inputs(self) -> list:
        """Free variables / constants the chain reads, in first-use order (not its own vars)."""
        own, found = set(self.vars), []
        for call in self.calls:
            for arg in call.args:
                if not any(arg.same_as(v) for v in own) and not any(arg.same_as(f) for f in found):
                    found.append(arg)
        return found


def find_chains(func: relax.Function, bounds: dict[str, int]) -> list[_Chain]:
    """The chains of `func` this pass groups (module docstring)."""
    var2val = relax.analysis.get_var2val(func)
    uses = use_counts(func)
    users: dict = {}
    for var, value in var2val.items():
        for free in relax.analysis.free_vars(value):
            users.setdefault(free, []).append(var)
    chains = []
    for var, value in var2val.items():
        if not _last_axis_norm(value) or uses[var] != 1 or len(users.get(var, [])) != 1:
            continue
        rows = _rows(value.args[0], bounds)
        if rows is None or rows > MAX_ROWS:
            continue
        (mm_var,) = users[var]
        matmul = var2val[mm_var]
        if (
            not plain_matmul(matmul)
            or not matmul.args[0].same_as(var)
            or not isinstance(matmul.args[1].ty, relax.TensorType)
        ):
            continue
        calls, vars_ = [value, matmul], [var, mm_var]
        while uses[vars_[-1]] == 1 and len(users.get(vars_[-1], [])) == 1:
            nxt = users[vars_[-1]][0]
            step = var2val[nxt]
            if not isinstance(step, relax.Call) or not isinstance(step.op, tvm.ir.Op):
                break
            if step.op.name in UNARY and len(step.args) == 1:
                pass
            elif (
                step.op.name in BINARY
                and len(step.args) == 2
                and isinstance(step.ty, relax.TensorType)
                and step.ty.ndim == matmul.ty.ndim
            ):
                other = step.args[1] if step.args[0].same_as(vars_[-1]) else step.args[0]
                if (
                    any(other.same_as(v) for v in vars_)
                    or relax.analysis.free_vars(other)
                    and any(v in vars_ for v in relax.analysis.free_vars(other))
                ):
                    break
            else:
                break
            calls.append(step)
            vars_.append(nxt)
        chains.append(_Chain(calls, vars_))
    return chains


def _group(chain: _Chain) -> relax.Function:
    """A private Primitive function computing the chain from fresh parameters."""
    inputs = chain.inputs()
    params = [relax.Var(f"p{i}", arg.ty) for i, arg in enumerate(inputs)]
    bb = relax.BlockBuilder()
    with bb.function("fused_norm_gemv", params, {"Primitive": True}, private=True):
        with bb.dataflow():
            env = list(zip(inputs, params))
            out = None
            for i, call in enumerate(chain.calls):
                args = [next((p for a, p in env if a.same_as(arg)), arg) for arg in call.args]
                new = relax.Call(call.op, args, call.attrs, call.ty_args)
                out = bb.emit_output(new) if i == len(chain.calls) - 1 else bb.emit(new)
                env.append((chain.vars[i], out))
        bb.emit_func_output(out)
    return bb.get()["fused_norm_gemv"]


@mutator
class _Grouper(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.ends: list = []  # (last call of a chain, chain)
        self.grouped = 0

    def visit_call_(self, call):
        for end, chain in self.ends:
            if call.same_as(end):
                gv = self.builder_.add_func(_group(chain), "fused_norm_gemv")
                self.grouped += 1
                return relax.Call(gv, [self.visit_expr(arg) for arg in chain.inputs()])
        return super().visit_call_(call)


@tvm.transform.module_pass(opt_level=0, name="FuseNormIntoGemv")
class FuseNormIntoGemv:
    """LayerNorm + the projection reading it (+ its element-wise epilogue) as one kernel at decode-sized buckets."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        grouper = _Grouper(mod)
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function) or (func.attrs and func.attrs.get("Primitive", False)):
                continue
            chains = find_chains(func, upper_bounds(func))
            if chains:
                grouper.ends = [(chain.calls[-1], chain) for chain in chains]
                grouper.builder_.update_func(gv, grouper.visit_expr(func))
        if not grouper.grouped:
            return mod
        logger.info(
            "FuseNormIntoGemv: %d LayerNorm + projection chain(s) grouped into one kernel each", grouper.grouped
        )
        return relax.transform.DeadCodeElimination()(grouper.builder_.get())
