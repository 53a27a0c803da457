"""CPU rule for a row normalization and the matmul that reads it in one kernel (`FuseNormIntoGemv`).

Matches a PrimFunc with exactly one contraction (``cpu_matmul.detect``) whose A operand is an
intermediate computed at root by blocks before it, at least one of them a one-operand reduction
(the LayerNorm's sums), and only spatial blocks after it (the epilogue). The kernel is what
FuseTIR makes of ``layer_norm -> matmul -> bias / activation`` at a decode-sized bucket.

How it schedules: the matmul and its epilogue exactly as ``cpu_matmul`` does (parallel register
tiles, the 1-row version for ``rows == 1``), except that A is read in place from the normalized
rows, which the blocks before it compute once, at root, on one thread, before the parallel loop:
the sums split by the SIMD width and ``rfactor``-ed into vector partial sums, the normalized rows
vectorized. Recomputing the rows per column tile instead (``cpu_matmul``'s A panel) would redo the
statistics for every tile; for rows <= 16 and K = 256 the root pass is a few hundred vector ops.
The matmul's choices are decisions (`decisions.py`, ``sketch``; see ``cpu_matmul``).
"""

from __future__ import annotations

import logging

import tvm_ffi
from tvm import s_tir, tirx
from tvm.target import Target

from . import _utils as U
from . import fast_math
from .analysis import detect
from .decisions import Defaults
from .tiling import rfactor, tiled_matmul, vectorize_rf

logger = logging.getLogger(__name__)


def _reduces(stmt) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in stmt.iter_vars)


def _parts(sch: s_tir.Schedule):
    """(blocks before the matmul, the matmul) when the kernel has this rule's form, else None."""
    blocks = U.root_children(sch)
    if not blocks:
        return None
    stmts = [sch.get(b) for b in blocks]
    if any({iv.iter_type for iv in s.iter_vars} - {tirx.IterVar.DataPar, tirx.IterVar.CommReduce} for s in stmts):
        return None
    contractions = [i for i, s in enumerate(stmts) if _reduces(s) and detect(s) is not None]
    if len(contractions) != 1:
        return None
    at = contractions[0]
    before, after = stmts[:at], stmts[at + 1 :]
    if not any(_reduces(s) for s in before) or any(_reduces(s) for s in after):
        return None
    _, ai, _ = detect(stmts[at])
    a_buf = stmts[at].reads[ai].source
    allocs = list(sch.mod["main"].body.block.alloc_buffers)
    if not any(a_buf.same_as(b) for b in allocs) or not any(w.source.same_as(a_buf) for s in before for w in s.writes):
        return None
    return [s.name_hint for s in before], stmts[at].name_hint


def _schedule_rows(sch: s_tir.Schedule, names: list[str], target: Target) -> None:
    """The blocks before the matmul, at root on one thread: sums as vector partial sums, rows vectorized."""
    for name in names:
        blk = sch.get_sblock(name)
        stmt = sch.get(blk)
        loops = sch.get_loops(blk)
        if not loops:
            continue
        ext = U.static(U.extent(sch, loops[-1]))
        vec = U.lanes(target, stmt.writes[0].source.dtype)
        if _reduces(stmt):
            width = U.largest_pow2_divisor(ext, vec) if ext else 1
            if width >= 2 and ext // width >= 2:
                rf_block = rfactor(sch, blk, loops[-1], width)
                if rf_block is not None:
                    vectorize_rf(sch, rf_block, sch.get_loops(rf_block)[-2:])
        elif ext and ext > 1:
            U.vectorize_inner(sch, loops[-1], vec)


def _schedule(sch: s_tir.Schedule, target: Target, rows: int | None, decide: Defaults | None = None) -> None:
    names, main = _parts(sch)
    tiled_matmul(sch, sch.get_sblock(main), target, rows=rows, a_at_root=True, decide=decide)
    _schedule_rows(sch, names, target)


def _version(func: tirx.PrimFunc, target: Target, rows: int | None, decide: Defaults | None = None) -> tirx.PrimFunc:
    sch = s_tir.Schedule(func)
    _schedule(sch, target, rows, decide)
    return sch.mod["main"]


def _rows_first(func: tirx.PrimFunc) -> tuple[list, list]:
    """The root statements before the matmul's parallel loop (the rows' pass) and from it on."""
    body = func.body.block.body
    stmts = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    for i, stmt in enumerate(stmts):
        found = []
        tvm_ffi.structural_walk(
            stmt, (tirx.For, lambda n: found.append(1) if n.kind == tirx.ForKind.PARALLEL else None)
        )
        if found:
            return stmts[:i], stmts[i:]
    raise ValueError("no parallel loop in the scheduled kernel")


def _rows_then_branch(cond, small: tirx.PrimFunc, general: tirx.PrimFunc) -> tirx.PrimFunc:
    """The rows' pass once, then ``small``'s matmul when ``cond`` holds, else ``general``'s."""
    rows_pass, general_rest = _rows_first(general)
    _, small_rest = _rows_first(small)
    seq = lambda stmts: stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts)  # noqa: E731  # no SeqStmt of one
    body = seq([*rows_pass, tirx.IfThenElse(cond, seq(small_rest), seq(general_rest))])
    allocs = list(general.body.block.alloc_buffers)
    allocs += [b for b in small.body.block.alloc_buffers if not any(b.same_as(a) for a in allocs)]
    root = s_tir.SBlock([], [], [], "root", body, alloc_buffers=allocs)
    return general.with_body(s_tir.SBlockRealize([], True, root))


class NormGemv(fast_math.FastMathRule):
    """Row normalization + matmul + epilogue in one kernel: rows at root, the matmul as cpu_matmul
    (module docstring)."""

    def apply(
        self, func: tirx.PrimFunc, target: Target, _tunable: bool, decide: Defaults | None = None
    ) -> s_tir.Schedule | None:
        """The rule's schedule of `func`, with `decide`'s choices (default: the rule's own) for its general
        body; None where the rule does not apply."""
        sch = self.schedule_of(func, target)
        if sch is None or _parts(sch) is None:
            return None
        func = sch.mod["main"]
        _, main = _parts(sch)
        stmt = sch.get(sch.get_sblock(main))
        rows = 1
        for iv, kind in zip(stmt.iter_vars, detect(stmt)[0]):
            rows = rows * iv.dom.extent if kind == "I" else rows
        try:
            general = _version(func, target, None, decide)
            if U.static(rows) is not None:
                return s_tir.Schedule(general)
            # symbolic rows: a 1-row tile for rows == 1 (decode), cpu_matmul's tile else; the rows' pass once before
            return s_tir.Schedule(_rows_then_branch(rows == 1, _version(func, target, 1), general))
        except Exception as err:  # pylint: disable=broad-except  # a primitive refused: leave it to the other rules
            logger.debug("cpu NormGemv rule gave up on %s: %s", func.attrs.get("global_symbol", "?"), err)
            return None

    def sketch(self, sch: s_tir.Schedule, target: Target, decide: Defaults) -> bool:
        """Schedule the static kernel held by `sch` in place with `decide`'s choices; False where this rule does
        not apply (nothing is changed then)."""
        if _parts(sch) is None or not self.is_target_available(target):
            return False
        decide.begin(sch, type(self).__name__)
        _schedule(sch, target, None, decide)
        return True
