"""CPU matmul rule: dense / linear / batched matmul with symbolic rows, fused prologue and epilogue.

Matches a PrimFunc with exactly one reduction block of the form ``C[S, I, J] += A[S, I, K] * B[S, K, J]``
(any axis order and layout; ``S`` = batch axes shared by A, B and C, ``I`` = rows, ``J`` = columns,
``K`` = reduction; several axes of one kind are fused, e.g. ``b`` and ``n`` of ``x(b, n, K)`` become
one row axis) plus any number of injective prologue / epilogue blocks (bias, gelu, silu, residual ...).
Typical kernels: ``x(b, n, K) @ W(K, N)``, ``q @ k^T`` and ``p @ v`` of attention.

How it schedules:
1. Normalize with ``reindex`` + ``transform_layout`` into ``C[S, I, J] += A[S, I, K] * B[S, K, J]``.
2. ``pad_einsum`` the rows I (and J when it is symbolic) up to the register tile, so no predicate is
   left inside the inner loops: a symbolic loop is only split at the outer, parallel level.
   Measured (b=1, K=256, N=704, 1 thread, through the Relax VM, n=1/32/64/128 in us): padded
   3x64 tile 11/114/228/443; no row tiling 8/208/413/826; split rows with the predicate inside
   15/296/598/1193; the same plus ``pragma_loop_partition_hint`` 16/252/525/1006.
3. Register tile ``MR x NR`` (3 rows x 4 vectors with AVX-512, 4 x 3 with AVX2) accumulated in a
   "global"-scope buffer of < 1024 bytes, which TVM 0.27 keeps on the stack (so in registers); a
   "local" or larger tile becomes a workspace allocation and runs 2.3x slower. Loops:
   ``[S*J/NR * I/MR] (parallel) > K > MR (unroll) > NR/VL (unroll) > VL (vector)``.
   The padded A panel (MR x K) is copied per tile; B is read in place when it is contiguous along J
   and packed per column panel (K x NR, then rows serial inside) otherwise or when J is padded.
4. Epilogue blocks are inlined into the write-back, which is computed per tile and vectorized;
   float32 exp / erf / tanh in them (gelu, silu) become vectorizable approximations (``fast_math``).
5. With a symbolic row count the function gets two bodies, ``if rows == 1`` (decode) and else:
   the single-row body uses a 1-row tile (x(1, 256) @ W(256, 704): 8.5 us instead of 12 us with
   the 3-row tile) or, for a K-contiguous weight, ``cpu_gemv``'s dot products (11 us instead of 128 us).
"""

from __future__ import annotations

import logging

from tvm import DataType, s_tir, tirx
from tvm.ir.expr import TensorLoad  # TVM 0.27: tirx.BufferLoad is a factory function
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target
from tvm.tirx.analysis import undefined_vars

from . import _utils as U
from . import fast_math

logger = logging.getLogger(__name__)

# TVM 0.27 lowers an intermediate buffer to a stack array (which LLVM keeps in registers) only when
# its scope is "global" and it is smaller than 1024 bytes; otherwise it becomes a
# TVMBackendAllocWorkspace call and the accumulators live in memory (2.3x slower here).
_STACK_LIMIT = 1024
_S, _I, _J, _K, _T = "S", "I", "J", "K", "T"


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
            kinds.append(_T)
        elif iv.iter_type == tirx.IterVar.DataPar:
            ina, inb, inc = var in a_vars, var in b_vars, var in c_vars
            kinds.append({(1, 1, 1): _S, (1, 0, 1): _I, (0, 1, 1): _J}.get((ina, inb, inc)))
        elif iv.iter_type == tirx.IterVar.CommReduce:
            kinds.append(_K if (var in a_vars and var in b_vars and var not in c_vars) else None)
        else:
            kinds.append(None)
    if None in kinds or _J not in kinds or _K not in kinds:
        return None
    # J must be the output's contiguous axis; swap the operands when the first read carries it.
    c_last = block.writes[0].region[-1].min
    kind_of = {iv.var: k for iv, k in zip(block.iter_vars, kinds)}
    if isinstance(c_last, tirx.Var) and kind_of.get(c_last) == _I:
        kinds = [{_I: _J, _J: _I}.get(k, k) for k in kinds]
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
        if kind == _T:
            continue
        fused[kind] = fused[kind] * iv.dom.extent + var if kind in fused else var
    zero = tirx.IntImm(iters[0].dom.extent.ty, 0)
    return tirx.IndexMap(inputs, [fused.get(k, zero) for k in order], None)


def _to_tile_domain(sch: s_tir.Schedule, blk, acc) -> None:
    """Re-express an epilogue block over the fused (S, I, J) axes of the accumulator it reads.

    Needed for correctness, not speed: with two symbolic row axes (b, n) fused into one, the
    region that ``reverse_compute_at`` derives for ``row // n`` and ``row % n`` over a tile of rows
    is the box of the end points, which misses rows when the tile wraps around n (TVM 0.27).

    A column read through one scaled iter (``acc[row, 2 * f : 2 * f + 2]``, the gate/up pairs of
    a SwiGLU kernel over an interleaved weight) keeps that iter as its own axis: only the rows
    are re-expressed, and ``reverse_compute_at`` covers the pairs of each column tile.
    """
    stmt = sch.get(blk)
    reads = [r for r in stmt.reads if r.source.same_as(acc)]
    if not reads:
        return
    iters = [iv.var for iv in stmt.iter_vars]
    dims = []
    for rng in reads[0].region:
        if isinstance(rng.min, tirx.IntImm):
            continue
        used = [v for v in iters if any(v.same_as(u) for u in undefined_vars(rng.min))]
        dims.append(used[0] if len(used) == 1 else rng.min)
    # even when already in the accumulator's coordinates, the (identity) layout gives the block
    # fresh iter vars, so the decode and the general body of _two_versions never share a definition
    sch.transform_block_layout(blk, tirx.IndexMap(iters, dims, None))


def _two_versions(cond, then_func: tirx.PrimFunc, else_func: tirx.PrimFunc) -> tirx.PrimFunc:
    """One PrimFunc running ``then_func``'s body when ``cond`` holds, else ``else_func``'s (same params)."""
    then_root, else_root = then_func.body.block, else_func.body.block
    body = tirx.IfThenElse(cond, then_root.body, else_root.body)
    allocs = list(then_root.alloc_buffers) + list(else_root.alloc_buffers)
    root = s_tir.SBlock([], [], [], "root", body, alloc_buffers=allocs)
    return else_func.with_body(s_tir.SBlockRealize([], True, root))


def normalize(sch: s_tir.Schedule, main, b_order=(_S, _K, _J)) -> None:
    """Rewrite the block to ``C[S, I, J] += A[S, I, K] * B[b_order]`` through reindex stages."""
    kinds, ai, bi = detect(sch.get(main))
    rd_a = sch.reindex(main, ("read", ai))
    rd_b = sch.reindex(main, ("read", bi))
    rd_c = sch.reindex(main, ("write", 0))
    stmt = sch.get(main)
    sch.transform_layout(rd_a, ("write", 0), _fusion_map(stmt, kinds, [_S, _I, _K], stmt.reads[ai].region))
    sch.transform_layout(rd_b, ("write", 0), _fusion_map(stmt, kinds, list(b_order), stmt.reads[bi].region))
    sch.transform_layout(rd_c, ("read", 0), _fusion_map(stmt, kinds, [_S, _I, _J], stmt.writes[0].region))
    sch.transform_block_layout(main, _fusion_map(stmt, kinds, [_S, _I, _J, _K]))


def epilogue_at(sch: s_tir.Schedule, main, tile, vec: int) -> None:
    """Inline the epilogue where possible and compute the remaining consumers per tile."""
    for blk in U.collect_consumers(sch, main):
        if not U.writes_param(sch, blk):
            try:
                sch.compute_inline(blk)
            except Exception:  # pylint: disable=broad-except  # keep it as its own stage
                pass
    acc = sch.get(main).writes[0].source
    for blk in U.collect_consumers(sch, main):
        _to_tile_domain(sch, blk, acc)
        sch.reverse_compute_at(blk, tile, preserve_unit_loops=True)
        U.vectorize_inner(sch, sch.get_loops(blk)[-1], vec)


class Matmul(CPUScheduleRule):
    """Register-tiled, padded, parallel matmul for llvm targets (see module docstring)."""

    def __init__(self, rows: int | None = None, units: int | None = None, fast_math: bool = True,
                 single_row: bool = True):
        self.rows = rows
        self.units = units
        self.single_row = single_row
        self.fast_math = fast_math  # pylint: disable=redefined-outer-name

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        func = fast_math.rewrite(func) if self.fast_math else func
        sch = s_tir.Schedule(func)
        main = self._main_block(sch)
        if main is None:
            return None
        rows = 1
        for iv, kind in zip(sch.get(main).iter_vars, detect(sch.get(main))[0]):
            rows = rows * iv.dom.extent if kind == _I else rows
        try:
            self._schedule(sch, main, target)
            if self.single_row and U.static(rows) is None:
                small = self._single_row(func, target)
                return s_tir.Schedule(_two_versions(rows == 1, small, sch.mod["main"]))
        except Exception as err:  # pylint: disable=broad-except  # a primitive refused: not ours
            logger.debug("cpu Matmul rule gave up on %s: %s", func.attrs.get("global_symbol", "?"), err)
            return None
        return sch

    @staticmethod
    def _main_block(sch: s_tir.Schedule):
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

    def _single_row(self, func: tirx.PrimFunc, target: Target) -> tirx.PrimFunc:
        """The n == 1 (decode) version: dot products for a K-contiguous weight, else a 1-row tile."""
        from .cpu_gemv import dot_eligible, schedule_dot  # pylint: disable=import-outside-toplevel

        sch = s_tir.Schedule(func)
        main = self._main_block(sch)
        if dot_eligible(sch.get(main)):
            schedule_dot(sch, main, target, rows=1)
        else:
            self._schedule(sch, main, target, rows=1)
        return sch.mod["main"]

    def _schedule(self, sch: s_tir.Schedule, main, target: Target, rows: int | None = None, a_at_root: bool = False) -> None:
        """``a_at_root``: A is computed before the matmul at root (`cpu_norm_gemv`), read there in place."""
        kinds, ai, bi = detect(sch.get(main))
        stmt = sch.get(main)
        j_vars = [iv.var for iv, k in zip(stmt.iter_vars, kinds) if k == _J]
        b_contig = stmt.reads[bi].region[-1].min.same_as(j_vars[-1])
        root_allocs = list(sch.mod["main"].body.block.alloc_buffers)
        a_prologue = not a_at_root and any(stmt.reads[ai].source.same_as(buf) for buf in root_allocs)

        # Step 1. Normalize to C[S, I, J] += A[S, I, K] * B[S, K, J].
        normalize(sch, main, b_order=(_S, _K, _J))

        # Step 2. Tile sizes and padding.
        ext_i, ext_j = (U.static(iv.dom.extent) for iv in sch.get(main).iter_vars[1:3])
        dtype = sch.get(main).writes[0].source.dtype
        vec = U.lanes(target, dtype)
        wide = U.vector_bits(target) >= 512
        rows = rows or self.rows or (3 if wide else 4)
        units = self.units or (4 if wide else 3)
        while rows * units * vec * DataType(dtype).bits // 8 >= _STACK_LIMIT and units > 1:
            units -= 1
        mr = rows if ext_i is None else max(1, min(rows, ext_i))
        pad_j = ext_j is None
        if ext_j is not None:
            vec = U.largest_pow2_divisor(ext_j, vec)
            units = next(u for u in range(min(units, ext_j // vec), 0, -1) if ext_j % (u * vec) == 0)
        nr = units * vec
        sch.pad_einsum(main, [1, mr, nr if pad_j else 1, 1])

        # Step 3. Loop nest.
        s_loop, i_loop, j_loop, k_loop = sch.get_loops(main)
        i_o, i_i = sch.split(i_loop, [None, mr])
        j_o, j_u, j_v = sch.split(j_loop, [None, units, vec])
        a_prod = [b for b in sch.get_producers(main) if sch.get(b).writes[0].source.same_as(sch.get(main).reads[0].source)]
        b_prod = [b for b in sch.get_producers(main) if sch.get(b).writes[0].source.same_as(sch.get(main).reads[1].source)]
        pack_b = pad_j or not b_contig
        if pack_b:  # B panel packed once per column panel, row tiles serial inside
            sch.reorder(s_loop, j_o, i_o, k_loop, i_i, j_u, j_v)
            outer = sch.fuse(s_loop, j_o)
            a_at = tile = i_o
        elif a_prologue:  # A panel (with its prologue math) computed once per row tile
            sch.reorder(s_loop, i_o, j_o, k_loop, i_i, j_u, j_v)
            outer = a_at = sch.fuse(s_loop, i_o)
            tile = j_o
        else:  # every (row tile, column panel) pair is an independent task
            sch.reorder(s_loop, j_o, i_o, k_loop, i_i, j_u, j_v)
            outer = a_at = tile = sch.fuse(s_loop, j_o, i_o)
        sch.parallel(outer)

        # Step 4. Operands: A panel per tile; B packed per column panel or read in place.
        for prod, at in ((a_prod[0], None if a_at_root else a_at), (b_prod[0], outer if pack_b else None)):
            if a_at_root and prod.same_as(a_prod[0]):
                sch.compute_inline(prod)  # the reindex copy only: A's producers stay at root
                continue
            U.inline_producers(sch, prod)
            if at is None:
                sch.compute_inline(prod)
                continue
            sch.compute_at(prod, at, preserve_unit_loops=True)
            U.vectorize_inner(sch, sch.get_loops(prod)[-1], vec)

        # Step 5. Epilogue: inline what can be inlined, compute the rest per tile.
        epilogue_at(sch, main, tile, vec)

        # Step 6. Register accumulator and inner loop annotations.
        sch.set_scope(main, 0, "global")
        sch.vectorize(j_v)
        sch.unroll(j_u)
        sch.unroll(i_i)
        sch.decompose_reduction(main, k_loop)
