"""RewriteResidualAddToCublas: a residual add after a cuBLAS GEMM becomes the GEMM's epilogue (CUDA only).

In bucket functions whose rows dimension starts at >= `min_rows`, a binding
`y = R.add(g, r)` (or `R.add(r, g)`) where `g = R.call_dps_packed("relaxtune_cublas_gemm", (x, w))`
(RewriteGemmToCublas's call; "relaxtune_cublas_gemm_nk" for a weight kept (N, K), whose add
becomes "relaxtune_cublas_gemm_add_nk") is used by nothing but that add, and `r` has g's shape and dtype (no
broadcast), becomes `y = R.call_dps_packed("relaxtune_cublas_gemm_add", (x, w, r))`:
`cublasLtMatmul` with C = r and beta = 1 writing a separate D (relaxtune/cuda_cublas.py), so the
add kernel and its read of g are gone. Matched by operators and types, never by names; a GEMM
whose product has another use keeps its call and the add its kernel. In the Llama block these are
`x + o_proj(attn)` and `h + down_proj(mlp)`: at n = 2048 on an H200 the two add kernels took
11 us each in sequence.

Run after RewriteGemmToCublas and before LegalizeOps (pipeline.py puts it there).
"""

from __future__ import annotations

import logging
from collections import Counter

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, PyExprVisitor, mutator, visitor

from .fusion_utils import bucket_functions, extern_call, with_functions

logger = logging.getLogger(__name__)

GEMM = "relaxtune_cublas_gemm"
FUNCTION = "relaxtune_cublas_gemm_add"
# each GEMM call and the call that takes its residual add (the weight (K, N), or (N, K): keep_weights_nk.py)
EPILOGUES = {GEMM: FUNCTION, "relaxtune_cublas_gemm_nk": "relaxtune_cublas_gemm_add_nk"}


def _gemm_args(value, names) -> tuple | None:
    """(operands, name) of `call_dps_packed(name, (x, w, ...))` for a name among `names` (x, w and, for a
    quantized weight, its scales: gemv.Q4_FUNCTION), else None."""
    found = extern_call(value, names)
    return (tuple(found[1]), found[0]) if found is not None and len(found[1]) >= 2 else None


def _same_tensor_type(a, b) -> bool:
    ta, tb = a.ty, b.ty
    if not (isinstance(ta, relax.TensorType) and isinstance(tb, relax.TensorType)) or ta.dtype != tb.dtype:
        return False
    if ta.shape is None or tb.shape is None or ta.ndim != tb.ndim:
        return False
    analyzer = tvm.sym.Analyzer()
    return all(analyzer.can_prove_equal(x, y) for x, y in zip(ta.shape.values, tb.shape.values))


@visitor
class _Matches(PyExprVisitor):
    """The GEMM bindings (calls named in `epilogues`) used once, by an add of a same-typed tensor:
    {add var: (gemm var, its operands, r, the add's call name: epilogues[the GEMM's])}."""

    def __init__(self, epilogues: dict[str, str] = EPILOGUES):
        super().__init__()
        self.epilogues = epilogues
        self.uses: Counter = Counter()
        self.gemms: dict = {}
        self.adds: list = []
        self.add = tvm.ir.Op.get("relax.add")

    def visit_var_(self, var):
        self.uses[var] += 1

    def visit_dataflow_var_(self, var):
        self.uses[var] += 1

    def visit_var_binding_(self, binding):
        super().visit_var_binding_(binding)
        value = binding.value
        args = _gemm_args(value, self.epilogues)
        if args is not None:
            self.gemms[binding.var] = args
        elif isinstance(value, relax.Call) and value.op == self.add and len(value.args) == 2:
            self.adds.append((binding.var, *value.args))

    def matches(self) -> dict:
        found = {}
        for var, a, b in self.adds:
            for g, r in ((a, b), (b, a)):
                if g in self.gemms and self.uses[g] == 1 and _same_tensor_type(g, r) and _same_tensor_type(g, var):
                    operands, name = self.gemms[g]
                    found[var] = (g, operands, r, self.epilogues[name])
                    break
        return found


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod, found: dict):
        super().__init__(mod)
        self.found = found
        self.dropped = {g for g, *_ in found.values()}

    def visit_var_binding_(self, binding):
        if binding.var in self.dropped:  # the product now lives only inside its add's call
            return
        if binding.var not in self.found:
            return super().visit_var_binding_(binding)
        _g, operands, r, function = self.found[binding.var]
        call = relax.call_dps_packed(function, [*map(self.visit_expr, operands), self.visit_expr(r)], binding.var.ty)
        bb = self.builder_
        if bb.current_block_is_dataflow() and not isinstance(binding.var, relax.DataflowVar):
            new = bb.emit_output(call, binding.var.name)  # a dataflow block's output stays one
        else:
            new = bb.emit(call, binding.var.name)
        self.set_var_remap(binding.var, new)


@tvm.transform.module_pass(opt_level=0, name="RewriteResidualAddToCublas")
class RewriteResidualAddToCublas:
    """GEMM + residual add -> one cuBLASLt call in bucket functions whose `dim` starts at >= `min_rows` (see above)."""

    def __init__(self, dim: str = "n", min_rows: int = 17):
        self.dim, self.min_rows = dim, min_rows

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func, bucket in bucket_functions(mod, self.dim):
            if int(bucket[self.dim][0]) < self.min_rows:
                continue
            matches = _Matches()
            matches.visit_expr(func)
            found = matches.matches()
            if found:
                updates[gvar] = _Rewriter(mod, found).visit_expr(func)
                logger.info("%s: %d residual add(s) -> cuBLASLt epilogue", gvar.name_hint, len(found))
        return with_functions(mod, updates)
