"""Shared schedule steps of the CPU rules: the register-tiled matmul, the GEMV dot products, the
epilogue per tile, two bodies under one condition, vector partial reductions. Rules import this
module (and `analysis`), never each other.
"""

from __future__ import annotations

import logging

from tvm import DataType, s_tir, tirx
from tvm.s_tir.dlight.analysis.common_analysis import get_sblockrealize
from tvm.target import Target
from tvm.tirx.analysis import undefined_vars

from . import _utils as U
from .analysis import J, K, S, detect, normalize
from .decisions import Defaults

logger = logging.getLogger(__name__)

DOT_COLUMNS = 8  # output columns per dot-product tile (schedule_dot)

# TVM 0.27 lowers an intermediate buffer to a stack array (which LLVM keeps in registers) only when
# its scope is "global" and it is smaller than 1024 bytes; otherwise it becomes a
# TVMBackendAllocWorkspace call and the accumulators live in memory (2.3x slower here).
STACK_LIMIT = 1024


def to_tile_domain(sch: s_tir.Schedule, blk, acc) -> None:
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


def two_versions(cond, then_func: tirx.PrimFunc, else_func: tirx.PrimFunc) -> tirx.PrimFunc:
    """One PrimFunc running ``then_func``'s body when ``cond`` holds, else ``else_func``'s (same params)."""
    then_root, else_root = then_func.body.block, else_func.body.block
    body = tirx.IfThenElse(cond, then_root.body, else_root.body)
    allocs = list(then_root.alloc_buffers) + list(else_root.alloc_buffers)
    root = s_tir.SBlock([], [], [], "root", body, alloc_buffers=allocs)
    return else_func.with_body(s_tir.SBlockRealize([], True, root))


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
        to_tile_domain(sch, blk, acc)
        sch.reverse_compute_at(blk, tile, preserve_unit_loops=True)
        U.vectorize_inner(sch, sch.get_loops(blk)[-1], vec)


ROW_TILES = (1, 2, 3, 4, 5, 6, 8)  # rows per register tile the search may choose (tiled_matmul)
K_UNROLLS = (1, 2, 4, 8)  # reduction steps unrolled per iteration of the register tile (tiled_matmul)
DOT_COLUMNS_CHOICES = (1, 2, 4, 8, 16)  # output columns per dot-product tile (schedule_dot)
DOT_LANE_FACTORS = (1, 2, 4)  # reduction lanes per partial-sum vector, in SIMD widths (schedule_dot)
# packing B copies a K x NR panel per column panel, paid back only by the row tiles that reuse it: the search may
# pack a contiguous B only where a panel serves this many row tiles (measured in one llama-block job: 5-10x the
# rule's time at 16 rows, 1.0-4x at 128, 0.89x-1.8x at 1024, 20-50x at 1 row)
PACK_MIN_ROW_TILES = 64
# accumulator vectors per tile the search may choose: the rules' own tiles stay under STACK_LIMIT, but larger
# ones measured faster at some shapes (a 6 x 4-vector tile of llama-block's matmuls on AVX-512: 0.55-0.6x the
# rule's 3 x 4 at n = 16 and 128), so the search may try up to one register file's worth (32 vectors) and more
MAX_TILE_VECTORS = 32


def _fits_stack(rows: int, cols: int, dtype: str) -> bool:
    return rows * cols * DataType(dtype).bits // 8 < STACK_LIMIT


def _divides(extent: int | None, factor: int) -> bool:
    return extent is None or extent % factor == 0


def tiled_matmul(
    sch: s_tir.Schedule,
    main,
    target: Target,
    rows: int | None = None,
    units: int | None = None,
    a_at_root: bool = False,
    decide: Defaults | None = None,
) -> None:
    """Register-tiled, padded, parallel schedule of the contraction ``main`` (see cpu_matmul's docstring);
    ``rows`` x ``units`` vectors per tile (None: the target's default); ``a_at_root``: A is computed
    before the matmul at root (`cpu_norm_gemv`), read there in place.

    ``decide`` (`decisions.py`; default: the defaults) answers its choices: ``rows`` per tile,
    ``units`` vectors per tile row and ``pack_b`` (structural) and ``k_unroll`` reduction steps per
    iteration. The defaults are the
    values this rule always chose."""
    decide = decide or Defaults()
    kinds, ai, bi = detect(sch.get(main))
    stmt = sch.get(main)
    j_vars = [iv.var for iv, k in zip(stmt.iter_vars, kinds) if k == J]
    b_contig = stmt.reads[bi].region[-1].min.same_as(j_vars[-1])
    root_allocs = list(sch.mod["main"].body.block.alloc_buffers)
    a_prologue = not a_at_root and any(stmt.reads[ai].source.same_as(buf) for buf in root_allocs)

    # Step 1. Normalize to C[S, I, J] += A[S, I, K] * B[S, K, J].
    normalize(sch, main, b_order=(S, K, J))

    # Step 2. Tile sizes and padding.
    ext_i, ext_j, ext_k = (U.static(iv.dom.extent) for iv in sch.get(main).iter_vars[1:4])
    dtype = sch.get(main).writes[0].source.dtype
    vec = U.lanes(target, dtype)
    wide = U.vector_bits(target) >= 512
    rows = rows or (3 if wide else 4)
    units = units or (4 if wide else 3)
    while rows * units * vec * DataType(dtype).bits // 8 >= STACK_LIMIT and units > 1:
        units -= 1
    mr = rows if ext_i is None else max(1, min(rows, ext_i))
    # 1 or 2 rows per tile only where there are fewer than 3: a thin tile re-reads the B panel per row or two
    rows_ok = [r for r in ROW_TILES if ext_i is None or min(3, ext_i) <= r <= ext_i]
    mr = decide.choose(sch, "rows", rows_ok, mr, structural=True)
    pad_j = ext_j is None
    if ext_j is not None:
        vec = U.largest_pow2_divisor(ext_j, vec)
        units = next(u for u in range(min(units, ext_j // vec), 0, -1) if ext_j % (u * vec) == 0)
    fitting = [u for u in range(1, 9) if _divides(ext_j, u * vec) and mr * u <= MAX_TILE_VECTORS]
    # structural: the epilogue's vectorisation (epilogue_at) is worked out from the tile's width
    units = decide.choose(sch, "units", fitting, units, structural=True)
    packable = b_contig and not pad_j and (ext_i is None or ext_i >= PACK_MIN_ROW_TILES * mr)
    pack_b = decide.choose(sch, "pack_b", [0, 1] if packable else [], int(pad_j or not b_contig), True)
    k_unroll = decide.choose(sch, "k_unroll", [u for u in K_UNROLLS if ext_k is not None and ext_k % u == 0], 1)
    for name, value in (("extent_i", ext_i), ("extent_j", ext_j), ("extent_k", ext_k), ("lanes", vec)):
        decide.note(sch, name, value)
    sch.pad_einsum(main, [1, mr, units * vec if pad_j else 1, 1])

    # Step 3. Loop nest.
    s_loop, i_loop, j_loop, k_loop = sch.get_loops(main)
    i_o, i_i = sch.split(i_loop, [None, mr])
    j_o, j_u, j_v = sch.split(j_loop, [None, units, vec])
    k_loops = sch.split(k_loop, [None, k_unroll])  # an inner loop of 1 by default: the same code, one decision
    a_prod = [b for b in sch.get_producers(main) if sch.get(b).writes[0].source.same_as(sch.get(main).reads[0].source)]
    b_prod = [b for b in sch.get_producers(main) if sch.get(b).writes[0].source.same_as(sch.get(main).reads[1].source)]
    if pack_b:  # B panel packed once per column panel, row tiles serial inside
        sch.reorder(s_loop, j_o, i_o, *k_loops, i_i, j_u, j_v)
        outer = sch.fuse(s_loop, j_o)
        a_at = tile = i_o
    elif a_prologue:  # A panel (with its prologue math) computed once per row tile
        sch.reorder(s_loop, i_o, j_o, *k_loops, i_i, j_u, j_v)
        outer = a_at = sch.fuse(s_loop, i_o)
        tile = j_o
    else:  # every (row tile, column panel) pair is an independent task
        sch.reorder(s_loop, j_o, i_o, *k_loops, i_i, j_u, j_v)
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
    sch.unroll(k_loops[1])
    sch.decompose_reduction(main, k_loops[0])


def schedule_dot(
    sch: s_tir.Schedule, main, target: Target, rows: int, decide: Defaults | None = None, rows_inner: bool = False
) -> None:
    """Vectorized dot products over K; ``rows`` rows per tile (the row extent must divide by it).

    ``decide`` (`decisions.py`) answers ``k_lanes`` (reduction elements per partial-sum vector: one
    SIMD width or a multiple, for independent accumulators) and ``cols`` (outputs per tile,
    structural); the defaults are the values this rule always chose. ``rows_inner``: the parallel tasks
    ordered columns first, so that the tasks one thread runs in a row share the tile's weight rows (in
    cache) across the row tiles, instead of reading the whole weight once per row tile."""
    decide = decide or Defaults()
    normalize(sch, main, b_order=("S", "J", "K"))
    stmt = sch.get(main)
    ext_i, ext_j, ext_k = (U.static(iv.dom.extent) for iv in stmt.iter_vars[1:4])
    dtype = stmt.writes[0].source.dtype
    simd = U.lanes(target, dtype)
    vec = U.largest_pow2_divisor(ext_k, simd)
    cols = U.largest_pow2_divisor(ext_j, DOT_COLUMNS) if ext_j is not None else 1
    while not _fits_stack(rows, cols * vec, dtype) and cols > 1:
        cols //= 2  # keep the partial sums on the stack (see cpu_matmul)
    lanes = decide.choose(sch, "k_lanes", [vec * f for f in DOT_LANE_FACTORS if ext_k % (vec * f) == 0], vec)
    fitting = [c for c in DOT_COLUMNS_CHOICES if _divides(ext_j, c) and rows * c <= MAX_TILE_VECTORS]
    cols = decide.choose(sch, "cols", fitting if ext_j is not None else [], cols, structural=True)  # sets the epilogue
    for name, value in (("extent_i", ext_i), ("extent_j", ext_j), ("extent_k", ext_k), ("lanes", vec)):
        decide.note(sch, name, value)
    s_loop, i_loop, j_loop, k_loop = sch.get_loops(main)
    i_o, i_i = sch.split(i_loop, [None, rows])
    j_o, j_i = sch.split(j_loop, [None, cols])
    k_o, k_v = sch.split(k_loop, [None, lanes])
    outer = (s_loop, j_o, i_o) if rows_inner else (s_loop, i_o, j_o)
    sch.reorder(*outer, k_o, i_i, j_i, k_v)
    tile = sch.fuse(*outer)
    sch.parallel(tile)
    for prod in sch.get_producers(main):  # reindex copies and prologues read in place
        U.inline_producers(sch, prod)
        sch.compute_inline(prod)
    partial = sch.rfactor(k_v, factor_axis=3)
    sch.set_scope(partial, 0, "global")
    loops = sch.get_loops(partial)
    sch.vectorize(loops[-1])
    sch.unroll(loops[-2])
    sch.unroll(loops[-3])
    sch.decompose_reduction(partial, loops[-4])
    tile = loops[0]  # rfactor left the horizontal sum in a copy of the nest: bring it back
    sch.reverse_compute_at(main, tile, preserve_unit_loops=True)
    epilogue_at(sch, main, tile, vec)


def rfactor(sch: s_tir.Schedule, blk, inner, width: int):
    """Vector partial reduction ``rf[lane] op= x[o * width + lane]``; None if rfactor refuses."""
    r_o, r_i = sch.split(inner, [None, width])
    try:
        return sch.rfactor(r_i, factor_axis=len(sch.get(blk).writes[0].region))
    except Exception as err:  # pylint: disable=broad-except  # unknown reducer etc.
        logger.debug("rfactor refused: %s", err)
        sch.fuse(r_o, r_i)
        return None


def vectorize_rf(sch: s_tir.Schedule, rf_block, loops) -> None:
    """Put the lane loop innermost, vectorize it, and hoist the init out of the reduction."""
    stmt = sch.get(rf_block)
    values = get_sblockrealize(sch, rf_block).iter_values
    lane_vars = [v for iv, v in zip(stmt.iter_vars, values) if iv.iter_type == tirx.IterVar.DataPar]
    lane = [lp for lp in loops if any(sch.get(lp).loop_var.same_as(v) for v in lane_vars)]
    red = [lp for lp in loops if not any(sch.get(lp).same_as(sch.get(x)) for x in lane)]
    if len(lane) != 1 or len(red) != 1:
        return
    sch.reorder(red[0], lane[0])
    sch.vectorize(lane[0])
    sch.decompose_reduction(rf_block, red[0])
