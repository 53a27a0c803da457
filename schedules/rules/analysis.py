"""Shared analysis of the CPU rules: what kind of kernel a PrimFunc is, and its normal form.

A contraction block is ``C[S, I, J] += A[S, I, K] * B[...]`` in any axis order and layout (``S``:
batch axes shared by A, B and C; ``I``: rows; ``J``: columns; ``K``: reduction; ``T``: unit axes).
`detect` classifies a block's iters; `normalize` rewrites it into that form through reindex
stages; `main_contraction` finds a kernel's one contraction; `dot_eligible` and `row_extent`
answer what the GEMV-shaped schedules need. Rules import this module, never each other.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad  # TVM 0.27: tirx.BufferLoad is a factory function
from tvm.tirx.analysis import undefined_vars

from . import _utils as U

S, I, J, K, T = "S", "I", "J", "K", "T"  # noqa: E741 (the iter kinds)


def _access_vars(region) -> set | None:
    found = set()
    for rng in region:
        if not (isinstance(rng.extent, tirx.IntImm) and int(rng.extent) == 1):
            return None
        found |= set(undefined_vars(rng.min))
    return found


def _is_mul_add(block: tirx.Stmt) -> bool:
    """Body is ``C[...] = C[...] + <expr containing a multiply>``."""
    body = block.body
    if not isinstance(body, tirx.BufferStore) or not isinstance(body.value, tirx.Add):
        return False
    lhs, rhs = body.value.a, body.value.b
    if isinstance(rhs, TensorLoad) and rhs.source.same_as(body.buffer):
        lhs, rhs = rhs, lhs
    if not (isinstance(lhs, TensorLoad) and lhs.source.same_as(body.buffer)):
        return False
    while isinstance(rhs, tirx.Cast):
        rhs = rhs.value
    return isinstance(rhs, tirx.Mul)


def detect(block) -> tuple[list[str], int, int] | None:
    """Iter kinds (S/I/J/K/T per block iter) and the read indices of A and B, or None."""
    if len(block.reads) != 2 or len(block.writes) != 1 or not _is_mul_add(block):
        return None
    acc = [_access_vars(r.region) for r in (block.reads[0], block.reads[1], block.writes[0])]
    if any(a is None for a in acc):
        return None
    a_vars, b_vars, c_vars = acc
    kinds = []
    for iv in block.iter_vars:
        var = iv.var
        if isinstance(iv.dom.extent, tirx.IntImm) and int(iv.dom.extent) == 1:
            kinds.append(T)
        elif iv.iter_type == tirx.IterVar.DataPar:
            ina, inb, inc = var in a_vars, var in b_vars, var in c_vars
            kinds.append({(1, 1, 1): S, (1, 0, 1): I, (0, 1, 1): J}.get((ina, inb, inc)))
        elif iv.iter_type == tirx.IterVar.CommReduce:
            kinds.append(K if (var in a_vars and var in b_vars and var not in c_vars) else None)
        else:
            kinds.append(None)
    if None in kinds or J not in kinds or K not in kinds:
        return None
    # J must be the output's contiguous axis; swap the operands when the first read carries it.
    c_last = block.writes[0].region[-1].min
    kind_of = {iv.var: k for iv, k in zip(block.iter_vars, kinds)}
    if isinstance(c_last, tirx.Var) and kind_of.get(c_last) == I:
        kinds = [{I: J, J: I}.get(k, k) for k in kinds]
        return kinds, 1, 0
    return kinds, 0, 1


def _fusion_map(block, kinds: list[str], order: list[str], region=None) -> tirx.IndexMap:
    """Index map from (the given access of) the block's iters to the fused ``order`` axes."""
    iters = list(block.iter_vars)
    if region is not None:
        used = set().union(*[set(undefined_vars(r.min)) for r in region])
        pairs = [(iv, k) for iv, k in zip(iters, kinds) if iv.var in used]
    else:
        pairs = list(zip(iters, kinds))
    inputs, fused = [], {}
    for idx, (iv, kind) in enumerate(pairs):
        var = tirx.Var(f"i{idx}", iv.dom.extent.ty)
        inputs.append(var)
        if kind == T:
            continue
        fused[kind] = fused[kind] * iv.dom.extent + var if kind in fused else var
    zero = tirx.IntImm(iters[0].dom.extent.ty, 0)
    return tirx.IndexMap(inputs, [fused.get(k, zero) for k in order], None)


def normalize(sch: s_tir.Schedule, main, b_order=(S, K, J)) -> None:
    """Rewrite the block to ``C[S, I, J] += A[S, I, K] * B[b_order]`` through reindex stages."""
    kinds, ai, bi = detect(sch.get(main))
    rd_a = sch.reindex(main, ("read", ai))
    rd_b = sch.reindex(main, ("read", bi))
    rd_c = sch.reindex(main, ("write", 0))
    stmt = sch.get(main)
    sch.transform_layout(rd_a, ("write", 0), _fusion_map(stmt, kinds, [S, I, K], stmt.reads[ai].region))
    sch.transform_layout(rd_b, ("write", 0), _fusion_map(stmt, kinds, list(b_order), stmt.reads[bi].region))
    sch.transform_layout(rd_c, ("read", 0), _fusion_map(stmt, kinds, [S, I, J], stmt.writes[0].region))
    sch.transform_block_layout(main, _fusion_map(stmt, kinds, [S, I, J, K]))


def main_contraction(sch: s_tir.Schedule):
    """The kernel's one contraction block when every other block is spatial, else None."""
    blocks = U.root_children(sch)
    if not blocks:
        return None
    kinds_of = [{iv.iter_type for iv in sch.get(b).iter_vars} for b in blocks]
    if any(k - {tirx.IterVar.DataPar, tirx.IterVar.CommReduce} for k in kinds_of):
        return None
    reductions = [b for b, k in zip(blocks, kinds_of) if tirx.IterVar.CommReduce in k]
    if len(reductions) != 1 or detect(sch.get(reductions[0])) is None:
        return None
    return reductions[0]


def dot_eligible(block) -> bool:
    """A matmul block reading both operands along their (static) reduction axis."""
    found = detect(block)
    if found is None:
        return False
    kinds, ai, bi = found
    k_iters = [iv for iv, kind in zip(block.iter_vars, kinds) if kind == "K"]
    last_k = k_iters[-1].var
    contiguous = all(block.reads[i].region[-1].min.same_as(last_k) for i in (ai, bi))
    return contiguous and all(U.static(iv.dom.extent) is not None for iv in k_iters)


def row_extent(block):
    """Product of the row (I) extents of a matmul block, static int or PrimExpr."""
    kinds, _, _ = detect(block)
    rows = 1
    for iv, kind in zip(block.iter_vars, kinds):
        if kind == "I":
            rows = rows * iv.dom.extent
    return U.static(rows) if U.static(rows) is not None else rows
