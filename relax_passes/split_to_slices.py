"""SplitToSlices: a `split` of a projection's last axis whose parts are each reshaped to heads
(GPT-2's fused c_attn: ``split(qkv, 3, axis=-1)`` → ``reshape(.., (b, n, h, d))``) becomes one
reshape to ``(.., sum h, d)`` (a view) and one `strided_slice` per part on the head axis.

Stock FuseOps keeps a `split` as a kernel of its own (its output is a tuple), so the three parts
go through memory between the projection and their consumers. A slice is injective, so after this
pass each part is computed inside its consumer kernel (the transposes to (b, h, n, d)).

Matches operators only (`relax.split` on the last axis, `relax.reshape` that splits the last axis
into (heads, d) with one d for all parts). Does not fire when a part has another consumer, is not
reshaped to heads, or its heads are read by an operator a slice does not fuse into (a fused
attention kernel, a matmul: fusion_utils.SLICE_ABSORBING_OPS): then the split stays, since three
standalone slice kernels would be worse than one split kernel.
Run before LegalizeOps, anywhere in the relaxtune fusion passes.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .fusion_utils import absorbs_slice, consumers, is_op, static_int, use_counts

logger = logging.getLogger(__name__)


def _plan(func: relax.Function) -> dict:
    """{split var: (head dim, [(field index, reshape var)])} for splits that fire."""
    uses, users = use_counts(func), consumers(func)
    fields: dict = {}
    reshapes: dict = {}
    splits = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if is_op(value, "relax.split"):
                ndim = value.args[0].ty.ndim
                if int(value.attrs.axis) in (-1, ndim - 1):
                    splits[binding.var] = value
            elif isinstance(value, relax.TupleGetItem) and value.tuple_value in splits:
                fields.setdefault(value.tuple_value, []).append((int(value.index), binding.var))
            elif is_op(value, "relax.reshape") and isinstance(value.args[0], relax.Var):
                reshapes[value.args[0]] = binding.var
    plans = {}
    for var, split in splits.items():
        parts = sorted(fields.get(var, []))
        count = len(split.ty.fields)
        if uses[var] != count or [i for i, _ in parts] != list(range(count)):
            continue
        found, head_dim = [], None
        for index, part in parts:
            target = reshapes.get(part)
            if target is None or uses[part] != 1 or not absorbs_slice(target, users):
                break
            out, src = target.ty.shape.values, part.ty.shape.values
            d = static_int(out[-1])
            if (
                len(out) != len(src) + 1
                or d is None
                or head_dim not in (None, d)
                or static_int(src[-1]) is None
                or static_int(src[-1]) % d
            ):
                break
            head_dim = d
            found.append((index, target))
        else:
            plans[var] = (head_dim, found)
    return plans


@mutator
class _Slicer(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.plans: dict = {}
        self.replace: dict = {}  # reshape var -> (split var, begin head, end head)
        self.views: dict = {}  # split var -> the emitted (.., heads, d) view
        self.count = 0

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.plans:
            head_dim, _ = self.plans[binding.var]
            source = self.visit_expr(binding.value.args[0])
            shape = source.ty.shape.values
            heads = static_int(shape[-1]) // head_dim
            self.views[binding.var] = self.builder_.emit(relax.op.reshape(source, [*shape[:-1], heads, head_dim]))
            self.count += 1
            return
        if isinstance(binding.value, relax.TupleGetItem) and binding.value.tuple_value in self.plans:
            return  # a part of a rewritten split: its only consumer, the reshape, becomes a slice
        if binding.var not in self.replace:
            super().visit_var_binding_(binding)
            return
        split_var, begin, end = self.replace[binding.var]
        view = self.views[split_var]
        call = relax.op.strided_slice(view, axes=[view.ty.ndim - 2], begin=[begin], end=[end], assume_inbound=True)
        new = (
            self.builder_.emit(call) if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output(call)
        )
        self.set_var_remap(binding.var, new)


@tvm.transform.module_pass(opt_level=0, name="SplitToSlices")
class SplitToSlices:
    """A split of a projection into head-reshaped parts as a view plus slices (see module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        slicer = _Slicer(mod)
        changed = False
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            plans = _plan(func)
            if not plans:
                continue
            slicer.plans, slicer.replace, slicer.views = plans, {}, {}
            for split_var, (head_dim, parts) in plans.items():
                begin = 0
                for _, reshape_var in parts:
                    heads = static_int(reshape_var.ty.shape.values[-2])
                    slicer.replace[reshape_var] = (split_var, begin, begin + heads)
                    begin += heads
            slicer.builder_.update_func(gv, relax.analysis.remove_all_unused(slicer.visit_expr(func)))
            changed = True
        if not changed:
            return mod
        logger.info("SplitToSlices rewrote %d split(s)", slicer.count)
        return slicer.builder_.get()
