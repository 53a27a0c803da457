"""MergeQuantProjections: 4-bit projections in the GPU layout that read the same activation (q / k / v, gate / up)
become one projection over their weights concatenated along the output rows at load, then one slice each (CUDA).

A projection is `y_i = R.call_tir(k_i, (x, packed_i, scale_i))` of a kernel whose dequantization block is
annotated ``ir_attrs.GPU_Q4_ATTR`` (PackQuantWeightsCuda's form), packed_i and scale_i weights of `f` read by
nothing else. Two or more with the same x, K and group size are one group (program order). The transform
function returns `concat(packed_i, axis=0)` and `concat(scale_i, axis=0)` in place of the first member's parts
(rows are independent in the GPU layout and the scales, so the concatenation is exact), `f` takes those, and
`y = linear(x, packed, scale)` is emitted where the first member was. When every y_i is read only by a reshape to
heads `(.., h_i, d)` with one d (q / k / v), `y` is reshaped to `(.., sum h_i, d)` and each reshape becomes a
slice on the head axis: the form MergeProjections gives float projections, which the flash kernel reads in place
(flash_attention_cuda.py); otherwise each y_i becomes a slice of y's last axis (gate / up: the slices fuse into
silu(gate) * up). Matched by operators, annotations and types, never by names.

Why: at n = 1 the 7B block's 4-bit projections are 9.4 MB (q, k, v, o) and 25 MB (gate, up) each: one launch per
group instead of three and two, each GEMV larger, the activation read once.

Run after PackQuantWeightsCuda and before BucketDispatch; the pipeline adds it with it under relaxtune fusion
(the default).
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..kernels import quant_gpu_tir
from .fusion_utils import consumers, is_gpu_q4_kernel, is_op, lifted_functions, output_binding, rewrite_output_tuple

logger = logging.getLogger(__name__)


def _projection(mod, value, weights: set, users: dict):
    """(x, packed, scale) of a 4-bit GPU-layout projection whose parts only it reads, else None."""
    if not (isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.call_tir")) or len(value.args) != 2:
        return None
    gv, args = value.args
    if gv not in mod.get_global_vars() or not is_gpu_q4_kernel(mod[gv]) or len(args.fields) != 3:
        return None
    x, packed, scale = args.fields
    if not all(p in weights and len(users.get(p, [])) == 1 for p in (packed, scale)):
        return None
    return x, packed, scale


def _readers(func: relax.Function) -> dict:
    """var -> the binding vars whose values read it."""
    out: dict = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            for var in relax.analysis.free_vars(binding.value):
                out.setdefault(var, []).append(binding.var)
    return out


def _heads(var, readers: dict, var2val: dict, returned: set) -> tuple | None:
    """(reshape var, h, d) when `var`'s one reader is a reshape to (.., h, d) of static h and d, else None."""
    found = readers.get(var, [])
    if var in returned or len(found) != 1 or not is_op(var2val[found[0]], "relax.reshape"):
        return None
    shape = found[0].ty.shape.values
    if len(shape) < 2 or not all(isinstance(d, tirx.IntImm) for d in shape[-2:]):
        return None
    return found[0], int(shape[-2]), int(shape[-1])


def _groups(mod, func: relax.Function, num_input: int) -> list[list[tuple]]:
    """Groups of >= 2 projections [(y var, x, packed, scale)] sharing x, K and the group size."""
    weights, users = set(func.params[num_input:]), consumers(func)
    by_key: dict = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            found = _projection(mod, binding.value, weights, users)
            if found is not None:
                x, packed, scale = found
                key = (x, int(packed.ty.shape.values[1]), int(scale.ty.shape.values[1]))
                by_key.setdefault(key, []).append((binding.var, *found))
    return [group for group in by_key.values() if len(group) >= 2]


@mutator
class _Main(PyExprMutator):
    def __init__(self, mod, func: relax.Function, groups: list, parts: dict):
        super().__init__(mod)
        self.parts, self.first, self.member, self.reshapes = parts, {}, {}, {}
        var2val = {b.var: b.value for block in func.body.blocks for b in block.bindings}
        readers, returned = _readers(func), set(relax.analysis.free_vars(func.body.body))
        for gi, group in enumerate(groups):
            self.first[group[0][0]] = gi
            heads = [_heads(y, readers, var2val, returned) for y, *_ in group]
            same_d = all(h is not None for h in heads) and len({h[2] for h in heads}) == 1
            offset = 0
            for (y, _x, packed, _s), h in zip(group, heads):
                rows = int(packed.ty.shape.values[0])
                if same_d:
                    self.reshapes[h[0]] = (gi, offset, offset + h[1])
                    offset += h[1]
                else:
                    self.member[y] = (gi, offset, offset + rows)
                    offset += rows
            if same_d:
                self.member.update({y: None for y, *_ in group})  # read only through their reshapes
        self.groups, self.merged = groups, {}

    def emit_merged(self, gi: int, binding) -> None:
        y0, x, *_ = self.groups[gi][0]
        packed, scale = self.parts[gi]
        merged = self.builder_.emit(
            self.builder_.call_te(
                quant_gpu_tir.linear, self.visit_expr(x), packed, scale, primfunc_name_hint="q4_gpu_linear"
            )
        )
        self.merged[gi] = merged
        reshape = next((v for v, (g, *_r) in self.reshapes.items() if g == gi), None)
        if reshape is not None:
            lead, d = list(reshape.ty.shape.values[:-2]), reshape.ty.shape.values[-1]
            total = sum(end - start for g, start, end in self.reshapes.values() if g == gi)
            self.merged[gi] = self.builder_.emit(relax.op.reshape(merged, [*lead, total, d]))

    def slice_of(self, gi: int, axis: int, start: int, end: int, var):
        value = relax.op.strided_slice(self.merged[gi], axes=[axis], begin=[start], end=[end])
        bb = self.builder_
        new = bb.emit_output(value, var.name) if not isinstance(var, relax.DataflowVar) else bb.emit(value, var.name)
        self.set_var_remap(var, new)

    def visit_var_binding_(self, binding):
        var = binding.var
        if var in self.first:
            self.emit_merged(self.first[var], binding)
        if var in self.reshapes:
            gi, start, end = self.reshapes[var]
            return self.slice_of(gi, var.ty.ndim - 2, start, end, var)
        if var in self.member:
            if self.member[var] is not None:
                gi, start, end = self.member[var]
                self.slice_of(gi, var.ty.ndim - 1, start, end, var)
            return None
        return super().visit_var_binding_(binding)


def _concatenated(concat: dict, dropped: set):
    """The transform function's new outputs: each group's parts concatenated in place of its first member's."""

    def rewrite(bb: relax.BlockBuilder, fields: list) -> list:
        out = []
        for i, field in enumerate(fields):
            if i in concat:
                out.append(bb.emit(relax.op.concat([fields[j] for j in concat[i]], axis=0)))
            elif i not in dropped:
                out.append(field)
        return out

    return rewrite


@tvm.transform.module_pass(opt_level=0, name="MergeQuantProjections")
class MergeQuantProjections:
    """4-bit projections of one activation: one projection over concatenated weights, then slices (see above)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gv, func, transform, num_input in lifted_functions(mod):
            binding = output_binding(mod[transform])
            if binding is None or len(binding.value.fields) != len(func.params) - num_input:
                continue
            groups = _groups(mod, func, num_input)
            if not groups:
                continue
            index = {p: i for i, p in enumerate(func.params)}
            params, concat, dropped, parts = list(func.params), {}, set(), {}
            for gi, group in enumerate(groups):
                for part in (2, 3):  # packed, scale
                    first = index[group[0][part]]
                    rows = sum(int(m[part].ty.shape.values[0]) for m in group)
                    ty = group[0][part].ty
                    new = relax.Var(group[0][part].name, relax.TensorType([rows, ty.shape.values[1]], ty.dtype))
                    params[first] = new
                    concat[first - num_input] = [index[m[part]] - num_input for m in group]
                    dropped.update(index[m[part]] - num_input for m in group[1:])
                    parts.setdefault(gi, []).append(new)
            keep = [p for i, p in enumerate(params) if i < num_input or i - num_input not in dropped]
            main = _Main(mod, func, groups, parts)
            new_func = main.visit_expr(relax.Function(keep, func.body, func.ret_ty, func.is_pure, func.attrs))
            mod = main.builder_.get()
            mod[gv] = relax.analysis.remove_all_unused(new_func)
            mod = rewrite_output_tuple(mod, transform, mod[transform], _concatenated(concat, dropped))
            logger.info(
                "%s: %d group(s) of 4-bit projections merged (%s)",
                gv.name_hint,
                len(groups),
                ", ".join(str(len(g)) for g in groups),
            )
        return mod
