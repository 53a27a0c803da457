"""Helpers shared by the CPU schedule rules: target vector width, loop extents, inlining.

Not a rule itself. Every helper works on a ``tvm.s_tir.Schedule`` and tolerates symbolic
(``T.int64`` var) extents: an extent is returned as ``int`` when static and as a PrimExpr otherwise.
"""

from __future__ import annotations

import logging

from tvm import DataType, s_tir, tirx
from tvm.target import Target
from tvm.target.codegen import target_has_features

logger = logging.getLogger(__name__)


def vector_bits(target: Target) -> int:
    """SIMD register width of an llvm target, in bits.

    ``tvm.target.codegen.llvm_get_vector_width`` returns 512 for every x86 target in TVM 0.27
    (even ``mcpu=haswell``), so the width is derived from the CPU features instead.
    """
    try:
        if target_has_features("avx512f", target):
            return 512
        if target_has_features("avx", target):
            return 256
    except Exception:  # pylint: disable=broad-except  # non-x86 llvm targets
        logger.debug("feature query failed for %s", target)
    return 128


def lanes(target: Target, dtype: str) -> int:
    """Number of ``dtype`` elements in one SIMD register (at least 1)."""
    bits = DataType(dtype).bits
    return max(1, vector_bits(target) // max(bits, 8))


def extent(sch: s_tir.Schedule, loop) -> int | tirx.PrimExpr:
    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, tirx.IntImm) else ext


def static(value) -> int | None:
    """The value as ``int`` when it is a compile-time constant, else None."""
    if isinstance(value, int):
        return value
    if isinstance(value, tirx.IntImm):
        return int(value)
    return None


def largest_pow2_divisor(value: int, limit: int) -> int:
    """The largest power of two that divides ``value`` and is <= ``limit``; 1 for an empty extent
    (``value`` 0: a loop of extent 0 is never vectorized, LLVM's codegen refuses it)."""
    if value <= 0:
        return 1
    best = 1
    while best * 2 <= limit and value % (best * 2) == 0:
        best *= 2
    return best


def root_children(sch: s_tir.Schedule) -> list | None:
    """The blocks directly under the root block; None for a function without one (plain TIR)."""
    try:
        return list(sch.get_child_blocks(sch.get_sblock("root")))
    except Exception:  # pylint: disable=broad-except
        return None


def writes_param(sch: s_tir.Schedule, block) -> bool:
    """Whether the block writes a function parameter (such a block cannot be compute-inlined)."""
    stmt = sch.get(block)
    root_allocs = {buf for buf in sch.mod["main"].body.block.alloc_buffers}
    return any(w.source not in root_allocs for w in stmt.writes)


def collect_consumers(sch: s_tir.Schedule, block) -> list:
    """All blocks downstream of ``block``, in topological (program) order, without duplicates."""
    seen, order, stack = set(), [], list(sch.get_consumers(block))
    while stack:
        cur = stack.pop()
        key = sch.get(cur).name_hint
        if key in seen:
            continue
        seen.add(key)
        order.append(cur)
        stack.extend(sch.get_consumers(cur))
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    order.sort(key=lambda b: names.index(sch.get(b).name_hint) if sch.get(b).name_hint in names else 0)
    return order


def inline_producers(sch: s_tir.Schedule, block) -> None:
    """compute_inline every producer of ``block`` (recursively) that allows it."""
    changed = True
    while changed:
        changed = False
        for prod in sch.get_producers(block):
            try:
                sch.compute_inline(prod)
                changed = True
            except Exception:  # pylint: disable=broad-except  # not inlinable: keep it
                continue


def inline_all_spatial(sch: s_tir.Schedule, blocks: list) -> list:
    """compute_inline (then reverse_compute_inline) what can be inlined; return what is left."""
    remaining = list(blocks)
    progress = True
    while progress:
        progress = False
        for prim in (sch.compute_inline, sch.reverse_compute_inline):
            for blk in list(remaining):
                try:
                    prim(blk)
                except Exception:  # pylint: disable=broad-except
                    continue
                remaining.remove(blk)
                progress = True
    return remaining


def vectorize_inner(sch: s_tir.Schedule, loop, vec: int, max_vec: int | None = None) -> bool:
    """Vectorize a static loop: split to a divisor of its extent that is a power of two <= vec."""
    ext = static(extent(sch, loop))
    if ext is None or ext < 2:
        return False
    width = largest_pow2_divisor(ext, max_vec or vec)
    if width < 2:
        return False
    if width == ext:
        sch.vectorize(loop)
    else:
        _, inner = sch.split(loop, [None, width])
        sch.vectorize(inner)
    return True


# iterations (every loop of a block, static) below which a kernel runs on the calling thread: a parallel
# launch costs a fork and a join of the pool (a few us quiet); on a loaded machine each one waits for a
# descheduled worker. A SmolLM2 decode step, load ~8 on 2 cores: rms_norm over 576 values 567 us per
# call, silu * up over 1536 values 975 us, against GEMVs of 0.3-0.9 ms over megabytes of weights
PARALLEL_MIN_WORK = 4096


def too_small_to_parallelize(sch: s_tir.Schedule, loops: list) -> bool:
    """Whether `loops` (a block's whole nest) are all static with fewer than PARALLEL_MIN_WORK iterations."""
    total = 1
    for loop in loops:
        ext = static(extent(sch, loop))
        if ext is None:
            return False
        total *= ext
    return total < PARALLEL_MIN_WORK


def parallel_depth(sch: s_tir.Schedule, loops: list, lane_work: int) -> int:
    """How many outer loops to fuse into the parallel loop.

    The fused index is split back with div / mod by the extents of the loops fused after each one;
    a symbolic divisor is a real division per iteration. So: a symbolic loop is fused only as the
    outermost loop (free) or as the last one when each iteration still has >= 256 elements of
    work; static loops are always fused. A (b, 4, n, 64) transpose, n=128, 1 thread: 13.6 us with
    every loop fused, 3.4 us with (b, 4, n), 2.4 us with (b, 4).
    """
    exts = [static(extent(sch, lp)) for lp in loops]
    depth = 0
    for i, ext in enumerate(exts):
        if ext is None and i > 0:
            work = lane_work
            for inner in exts[i + 1 :]:
                work *= inner or 1
            if work >= 256:
                depth = i + 1
            break
        depth = i + 1
    return max(depth, 1)
