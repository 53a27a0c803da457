"""What the GPU element-wise rule asks of a kernel (not a rule): its blocks inlined into one, every
buffer access of that block, whether each reads the last axis contiguously, and its selects on the column.

`inline_all` inlines every block of a schedule into its consumers (and a trailing epilogue into its
producer) and returns the blocks left. `buffer_accesses` lists every load and store under a block body
as (buffer name, element type, indices); `contiguous` holds when a var appears in no index but the last,
and there as `var + offset` with the offset free of it (or nowhere). `conditions_on` gives the conditions
of every Select / if_then_else that use a var; `constant_per_half` holds when each is provably constant on
[0, L/2) and on [L/2, L) (RoPE's rotate-half). `tvm_dtype_bytes` is an element type's size (at least 1).
TVM 0.27 has no Python visitor for tirx: the walk reads the nodes' fields (`_FIELDS`).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx


def inline_all(sch: s_tir.Schedule, root) -> list:
    """Inline every block into its consumers (and a trailing epilogue into its producer); the blocks left."""
    changed = True
    while changed:
        changed = False
        blocks = sch.get_child_blocks(root)
        for block in blocks[:-1]:
            try:
                sch.compute_inline(block)
                changed = True
                break
            except Exception:  # noqa: BLE001 - an output or a non-injective block: the checks below decide
                continue
    blocks = sch.get_child_blocks(root)
    while len(blocks) >= 2:
        try:
            sch.reverse_compute_inline(blocks[-1])
        except Exception:  # noqa: BLE001
            break
        blocks = sch.get_child_blocks(root)
    return list(blocks)


def uses(expr, var) -> bool:
    """`expr` reads `var`."""
    return any(v.same_as(var) for v in tirx.analysis.undefined_vars(expr))


def contiguous(index_exprs, var, analyzer) -> bool:
    """`var` appears in no index but the last, and there as `var + offset` (offset free of `var`), or nowhere."""
    if not index_exprs:
        return True
    *lead, last = index_exprs
    if any(uses(analyzer.simplify(e), var) for e in lead):  # e.g. a reshape's `(v // 128 + row) % U`
        return False
    return not uses(last, var) or not uses(analyzer.simplify(last - var), var)


_FIELDS = (
    "a",
    "b",
    "value",
    "args",
    "indices",
    "condition",
    "true_value",
    "false_value",
    "body",
    "seq",
    "then_case",
    "else_case",
    "base",
)


def _nodes(node):
    """`node` and every TIR node under it, parents first (TVM 0.27 has no Python visitor for tirx)."""
    yield node
    for field in _FIELDS:
        child = getattr(node, field, None)
        if child is None or isinstance(child, (int, float, str)):
            continue
        for item in child if isinstance(child, (list, tuple, tvm_ffi.Array)) else [child]:
            if hasattr(item, "same_as"):
                yield from _nodes(item)


def conditions_on(node, var) -> list:
    """The conditions of every Select / if_then_else under `node` that use `var` (RoPE's rotate-half concat)."""
    found = []
    for item in _nodes(node):
        kind = type(item).__name__
        if kind == "Select" and uses(item.condition, var):
            found.append(item.condition)
        elif kind == "Call" and str(getattr(item.op, "name", "")).endswith("if_then_else") and uses(item.args[0], var):
            found.append(item.args[0])
    return found


def constant_per_half(body, var, length: int) -> bool:
    """Every select condition on `var` is provably true or provably false for `var` in [0, L/2) and in [L/2, L)."""
    conditions = conditions_on(body, var)
    for lo, hi in ((0, length // 2), (length // 2, length)):
        analyzer = tvm.sym.Analyzer()
        dtype = str(var.ty.dtype)
        analyzer.bind(var, tvm.ir.Range(tirx.IntImm(dtype, lo), tirx.IntImm(dtype, hi)))
        for cond in conditions:
            if not (analyzer.can_prove(cond) or analyzer.can_prove(tirx.Not(cond))):
                return False
    return bool(conditions)


def buffer_accesses(node) -> list:
    """Every load and store under `node` (the block body): (buffer name, element type, indices)."""
    found = []
    for item in _nodes(node):
        if type(item).__name__ not in (
            "BufferLoad",
            "BufferStore",
            "TensorLoad",
            "TensorStore",
        ):  # 0.27: loads are TensorLoad nodes
            continue
        if hasattr(item, "buffer"):  # a store: the buffer is a Var typed as a buffer
            found.append((item.buffer.name, str(item.buffer.dtype), list(item.indices)))
        else:
            found.append((item.source.name, str(item.ty.dtype), list(item.indices)))
    return found


def tvm_dtype_bytes(dtype) -> int:
    import tvm

    return max(1, tvm.runtime.DataType(str(dtype)).bits // 8)
