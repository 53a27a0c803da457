"""UnmergeLeadingDims: ``reshape(matmul(reshape(x)))`` → ``matmul(x)`` where torch merged ``b * n``.

``torch.export`` lowers ``linear`` / ``bmm`` / ``embedding`` on 3-D and 4-D tensors to 2-D / 3-D
ops over merged leading dimensions, so TVM's importer writes ``reshape(x, (b * n, d))``, the op,
and a reshape back. Each merge is a copy, and a kernel over ``(b * n, d)`` buffers cannot be
specialised per shape bucket for tuning. matmul (with a 1-D bias) and ``take`` broadcast over
leading dimensions, so they run on the unmerged tensors instead; a rewrite is kept only where
each reshape merged leading dimensions alone and the result has the final shape.

Must run before: LegalizeOps (it rewrites Relax operators). After: DeadCodeElimination (run here).
Used on imported PyTorch models (relaxtune/workloads/torch_import.py); a no-op on graphs without
such sandwiches.
"""

from __future__ import annotations

import tvm

from .fusion_utils import rewrite_functions


def _same(analyzer, xs, ys) -> bool:
    return len(xs) == len(ys) and all(analyzer.can_prove_equal(x, y) for x, y in zip(xs, ys))


def _unmerge(mod):
    """``reshape(op(reshape(x)))`` sandwiches that merge leading dims (``b * n``) → ``op(x)``.

    torch lowers ``linear``/``bmm``/``embedding`` on 3-D and 4-D tensors to 2-D/3-D ops on merged
    leading dimensions. Kernels with buffer shapes like ``(b * n, 64)`` cannot be specialised for
    tuning, and each merge is a copy. matmul (plus a 1-D bias) and ``take`` broadcast over leading
    dimensions, so they run on the unmerged tensors; a rewrite is kept only when each reshape
    merged leading dimensions alone and the result has the final shape.
    """
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator
    from tvm.sym import Analyzer

    analyzer = Analyzer()

    def op_of(expr) -> str:
        return getattr(expr.op, "name", "") if isinstance(expr, relax.Call) else ""

    def known(*exprs) -> bool:
        return all(isinstance(e.ty, relax.TensorType) and e.ty.shape is not None for e in exprs)

    @mutator
    class Unmerge(PyExprMutator):
        def value(self, expr):
            return self.lookup_binding(expr) if isinstance(expr, relax.Var) else expr

        def unmerged(self, expr):
            """The tensor a reshape merged the leading dims of (only the first dim changed), or None."""
            merged = self.value(expr)
            if op_of(merged) != "relax.reshape" or not known(expr, merged.args[0]):
                return None
            orig, m = merged.args[0].ty.shape.values, expr.ty.shape.values
            ok = len(orig) > len(m) and _same(analyzer, orig[len(orig) - len(m) + 1 :], m[1:])
            return merged.args[0] if ok else None

        def candidate(self, inner):
            inner_value = self.value(inner)
            if op_of(inner_value) == "relax.take" and int(inner_value.attrs.axis) == 0:
                ids = self.unmerged(inner_value.args[1])
                return (
                    None
                    if ids is None
                    else relax.op.take(inner_value.args[0], ids, axis=0, mode=inner_value.attrs.mode)
                )
            bias = None
            if op_of(inner_value) == "relax.add":  # torch's addmm imports as add(bias, matmul)
                first, second = inner_value.args
                bias, inner_value = (
                    (first, self.value(second))
                    if op_of(self.value(second)) == "relax.matmul"
                    else (second, self.value(first))
                )
            if op_of(inner_value) != "relax.matmul":
                return None
            lhs, rhs = self.unmerged(inner_value.args[0]), inner_value.args[1]
            if lhs is None or not known(rhs):
                return None
            if rhs.ty.ndim != 2:
                rhs = self.unmerged(rhs)
                if rhs is None or not _same(analyzer, lhs.ty.shape.values[:-2], rhs.ty.shape.values[:-2]):
                    return None
            new = self.builder_.normalize(relax.op.matmul(lhs, rhs, out_dtype=inner_value.attrs.out_dtype))
            if bias is not None:
                if not known(bias) or not _same(analyzer, bias.ty.shape.values, new.ty.shape.values[-1:]):
                    return None
                new = relax.op.add(new, bias)
            return new

        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            if op_of(call) == "relax.reshape" and known(call):
                new = self.candidate(call.args[0])
                if new is not None:
                    new = self.builder_.normalize(new)
                    if known(new) and _same(analyzer, new.ty.shape.values, call.ty.shape.values):
                        return new
            return call

    return relax.transform.DeadCodeElimination()(rewrite_functions(mod, Unmerge(mod)))


@tvm.transform.module_pass(opt_level=0, name="UnmergeLeadingDims")
class UnmergeLeadingDims:
    """Run the rewrite on every Relax function of the module (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return _unmerge(mod)
