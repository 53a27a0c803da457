"""MergeProjections: matmuls that read the same activation with load-time weights (Q, K, V) become
one matmul over the weights concatenated along the output axis, followed by one slice per
original projection.

The concatenation is a weight-only expression, so LiftTransformParams moves it to load time
(`main_transform_params`, run once by `artifact.prepare_params`), or FoldConstant folds it when
the weights are constants (imported models). One wide matmul reads the activation once and
gives the matmul rule / MetaSchedule one larger kernel instead of several narrow ones.

A projection followed by the add of a load-time (N,) bias (nn.Linear with bias, imported models)
keeps its bias: the merged matmul adds the concatenated biases, an epilogue FuseOps fuses into it.
When every projection is only reshaped to heads, ``reshape(y_i, (.., h_i, d))`` with one head
size d, the merged output is reshaped to ``(.., sum h_i, d)`` and sliced on the head axis: the
slices then fuse into the consumers (rotary embedding, transposes) instead of standing between a
matmul and a reshape as kernels of their own (stock FuseOps fuses neither into them).

Matches operators only (`relax.matmul` with a 2-D weight), never names. Does not fire on a single
projection, on weights that are activations, or on matmuls with another out_dtype; a projection
whose slice would not fuse into its readers (attention, a matmul, the function's output: see
fusion_utils.SLICE_ABSORBING_OPS) is left out of the group, since a slice kernel of its own would
cost as much as its matmul and add a copy; with `copy_slices` (GPU targets, where the matmuls are
cuBLAS calls) it stays in the group and its slice is a copy kernel.
Run after FuseSwiGLU (gate/up pairs are fused there, not merged here), before LiftTransformParams.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .fusion_utils import absorbs_slice, inline_load_time, is_load_time, is_op, plain_matmul, static_int, weight_params
from .fusion_utils import consumers as value_consumers

logger = logging.getLogger(__name__)


def _bias_of(var, var2val, consumers, weights):
    """(add var, bias) when the only reader of projection `var` adds a load-time (N,) bias, else None."""
    users = consumers.get(var, [])
    if len(users) != 1 or users[0] is None or not is_op(var2val[users[0]], "relax.add"):
        return None
    a, b = var2val[users[0]].args
    bias = b if a.same_as(var) else a
    n = static_int(var.ty.shape.values[-1])
    if not isinstance(bias.ty, relax.TensorType) or bias.ty.ndim != 1 or static_int(bias.ty.shape.values[0]) != n:
        return None
    return (users[0], bias) if is_load_time(bias, weights, var2val) else None


def _groups(func: relax.Function, var2val, weights, consumers) -> tuple[list[list[relax.Var]], dict]:
    """Projections grouped by activation (and by having a bias), in program order, groups of two or
    more; and per projection its end: (the var its slice replaces, its bias or None)."""
    by_input: dict = defaultdict(list)
    ends: dict = {}
    for block in func.body.blocks:
        if not isinstance(block, relax.DataflowBlock):
            continue
        for binding in block.bindings:
            value = binding.value
            if not isinstance(binding, relax.VarBinding) or not plain_matmul(value):
                continue
            x, w = value.args
            if static_int(w.ty.shape.values[1]) is None or not is_load_time(w, weights, var2val):
                continue
            biased = _bias_of(binding.var, var2val, consumers, weights)
            ends[binding.var] = biased or (binding.var, None)
            by_input[(x, str(w.ty.dtype), static_int(w.ty.shape.values[0]), biased is not None)].append(binding.var)
    return [members for members in by_input.values() if len(members) >= 2], ends


def _head_reshapes(members, var2val, consumers) -> dict | None:
    """{projection var: its reshape binding var} when each projection's only consumer reshapes
    the last axis into (heads, d) with one d for all, else None."""
    found, head_dim = {}, None
    for var in members:
        users = consumers.get(var, [])
        if len(users) != 1 or not is_op(var2val[users[0]], "relax.reshape"):
            return None
        out_shape = users[0].ty.shape.values
        in_shape = var.ty.shape.values
        if (
            len(out_shape) != len(in_shape) + 1
            or static_int(out_shape[-1]) is None
            or static_int(out_shape[-2]) is None
        ):
            return None
        if [str(d) for d in out_shape[:-2]] != [str(d) for d in in_shape[:-1]]:
            return None  # only the last axis may be split into (heads, d)
        if head_dim not in (None, static_int(out_shape[-1])):
            return None
        head_dim = static_int(out_shape[-1])
        found[var] = users[0]
    return found


def _consumers(func: relax.Function) -> dict:
    users: dict = defaultdict(list)
    for block in func.body.blocks:
        for binding in block.bindings:
            for var in relax.analysis.free_vars(binding.value):
                users[var].append(binding.var)
    ret = func.body.body
    if isinstance(ret, relax.Var):
        users[ret].append(None)
    return users


@mutator
class _Merger(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.var2val: dict = {}
        self.weights: set = set()
        self.first: dict = {}  # first member's var -> (the group's members, their head reshapes or None)
        self.replace: dict = {}  # var a slice takes the place of -> its projection
        self.merged: dict = {}  # projection -> (merged output, begin, end, sliced on the head axis)
        self.ends: dict = {}  # projection var -> (var its slice replaces, bias or None)
        self.count = 0

    def _emit_merged(self, members, heads: dict | None):
        bb = self.builder_
        first = self.var2val[members[0]]
        ws = [inline_load_time(self.var2val[m].args[1], self.weights, self.var2val) for m in members]
        weight = bb.emit(relax.op.concat(ws, axis=1), name_hint="merged_weight")
        y = bb.emit(relax.op.matmul(self.visit_expr(first.args[0]), weight))
        if self.ends[members[0]][1] is not None:
            biases = [inline_load_time(self.ends[m][1], self.weights, self.var2val) for m in members]
            y = bb.emit(relax.op.add(y, bb.emit(relax.op.concat(biases, axis=0), name_hint="merged_bias")))
        sizes = [static_int(self.var2val[m].args[1].ty.shape.values[1]) for m in members]
        if heads is not None:
            out = heads[self.ends[members[0]][0]].ty.shape.values
            head_dim = static_int(out[-1])
            sizes = [s // head_dim for s in sizes]
            y = bb.emit(relax.op.reshape(y, [*out[:-2], sum(sizes), head_dim]))
        offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        return y, offsets

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.first:
            members, heads = self.first[binding.var]
            y, offsets = self._emit_merged(members, heads)
            for i, member in enumerate(members):
                self.merged[member] = (y, offsets[i], offsets[i + 1], heads is not None)
            self.count += 1
        target = self.replace.get(binding.var)
        if target is None:
            super().visit_var_binding_(binding)
            return
        y, begin, end, on_heads = self.merged[target]
        axis = y.ty.ndim - 2 if on_heads else y.ty.ndim - 1
        call = relax.op.strided_slice(y, axes=[axis], begin=[begin], end=[end], assume_inbound=True)
        new = (
            self.builder_.emit(call) if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output(call)
        )
        self.set_var_remap(binding.var, new)


@tvm.transform.module_pass(opt_level=0, name="MergeProjections")
class MergeProjections:
    """Projections of one activation as one matmul over concatenated weights (see module docstring)."""

    def __init__(self, copy_slices: bool = False):
        # copy_slices (GPU, cuBLAS): keep every projection in the group even when its slice is a
        # copy kernel of its own (attention's v): an n x hidden copy costs less than a GEMM launch
        self.copy_slices = copy_slices

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        merger = _Merger(mod)
        changed = False
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            var2val = relax.analysis.get_var2val(func)
            weights = weight_params(func)
            consumers, users = _consumers(func), value_consumers(func)
            groups, ends = _groups(func, var2val, weights, consumers)
            if not groups:
                continue
            merger.var2val, merger.weights, merger.ends = var2val, weights, ends
            merger.first, merger.replace, merger.merged = {}, {}, {}
            for members in groups:
                heads = _head_reshapes([ends[m][0] for m in members], var2val, consumers)
                site = {m: heads[ends[m][0]] if heads else ends[m][0] for m in members}
                # a projection whose slice would be a kernel of its own (read by attention, a
                # matmul, a reshape, the output) keeps its own matmul: same kernels, no extra copy
                members = [m for m in members if self.copy_slices or absorbs_slice(site[m], users)]
                if len(members) < 2:
                    continue
                merger.first[members[0]] = (members, heads)
                for member in members:
                    # the slice takes the place of the projection's end (or of its head reshape)
                    merger.replace[site[member]] = member
            if not merger.first:
                continue
            new_func = relax.analysis.remove_all_unused(merger.visit_expr(func))
            merger.builder_.update_func(gv, new_func)
            changed = True
        if not changed:
            return mod
        logger.info("MergeProjections merged %d group(s) of projections", merger.count)
        return merger.builder_.get()
