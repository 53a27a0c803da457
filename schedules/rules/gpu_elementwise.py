"""RowElementwise: a CUDA schedule for injective kernels whose last axis is static and read and
written contiguously (issue 8): silu(gate) * up, the residual adds, casts, k's RoPE (below).

Tried in gpu_rules.py before dlight's rules; dlight's `Fallback` (its element-wise schedule) fuses
every loop into one flat index, splits it over (blockIdx, threadIdx) and recovers the row and
column with an int64 `/` and `%` by the row length per element, one scalar load per element. On
an H200 that took 110-123 us for the n = 2048 silu(gate) * up of the Llama-7B block (135 MB of
traffic: ~32 us at copy bandwidth) and 30 + 18 us for the two residual adds (50 MB).

Matches by structure, not by name: after every producer block is inlined into the output, one
spatial block is left, with one output, whose innermost loop is the output's last axis with a
static extent, and every buffer access reads that axis contiguously (index = innermost var + an
offset free of it, e.g. the gate/up halves of the merged projection) or
not at all (a broadcast over it, e.g. a per-row scale). It declines reductions, several outputs,
a symbolic last axis, and transposes (the innermost var in another index, or scaled).

The schedule, with V = 16 bytes / the widest element (8 for fp16) when V divides the last
extent L (else V = 1), and C = L / V vectors per row:

- the leading (row) axes fused into one row loop; the last axis split as (C, V), V vectorised:
  each thread reads and writes 16 bytes at a time (one LDG.128 per operand);
- C >= 64 (the MLP's 1376, hidden 4096's 512): rows on blockIdx.x (up to 2^31 - 1, so a symbolic
  n is fine), the vectors of a row over (blockIdx.y, threadIdx.x) with the thread count among
  512/256/128/64 that wastes the fewest threads in the last block of the row (128 for 1376);
- C < 64 (e.g. 16 for 128-wide rows): T / C rows per block of T = 256 threads.

No element needs a division: the row is the block index and the column the thread index
(times V), so the remaining index arithmetic is one multiply-add per vector. It is 32-bit
(`ForceNarrowIndexToInt32` on the scheduled kernel) when every buffer's element count provably
fits in int32: static shapes, or symbolic ones whose upper bounds `var_bounds.annotate_var_bounds` (run
before the rules, see gpu_rules.gpu_schedule_pass) wrote on the kernel as `relaxtune.var_upper_bound`
from its callers' `tir_var_upper_bound` (the bucket bounds: n <= 2048 at max_seq 2048). Otherwise
(no bound, a bound too large, scalar parameters) it stays int64.

A select on the column (RoPE's `if_then_else`, which picks the rotated half) is taken only when
every such condition is constant on each half of the row (`elementwise_analysis.constant_per_half`):
the last axis is then split into its two halves with `loop_partition`, so that TVM's simplifier folds each half's
condition (the half's column range is known before VectorizeLoop) and both halves get 16-byte
loads and stores (`_schedule_halves`: rows on threadIdx.y, a half's vectors on threadIdx.x). A
vector condition would make TVM's vectoriser scalarise the lane loop: the layouts tried before
that lost to dlight's `Fallback` on k's RoPE (7B block, H200; dlight 22.9-23.3 us at n = 2048,
3.65 us at n = 128): 8 scalar lanes per thread (16 bytes apart, uncoalesced) 27.0 us; one element
per thread (128 threads per head row, n * 32 blocks) 42.3 us (4.58 us at n = 128). Per half
(H200, same run as the RMSNorm figures in gpu_row_softmax.py): 24.5 -> 7.9 us at n = 2048, 5.6 ->
5.8 us at n = 128 (launch-bound). `halves=False` declines every select on the column (the rule
before). The leading indices are simplified over the block's domains before the contiguity check,
so a reshape's `(v // 128 + row) % U` (the whole rotary table read in place, SliceAfterReshape)
counts as free of the column.

Measured on the H200 (benchmarks/gpu_job.py, llama7b-rf-cublas-flash vs -prev, per kernel):
silu(gate) * up 109.9-116.5 -> 43.1-44.1 us at n = 2048 (7.4 -> 4.1-4.2 us at n = 128); the
residual adds 29.7-29.9 + 18.0-18.1 -> 13.3-13.4 + 8.1-8.2 us at n = 2048; n = 1 unchanged
(~3.6-5.5 us, launch-bound). The block with CUDA graphs at n = 2048: 1.721 -> 1.604 ms (second
run; the first, with RoPE still on this rule, 1.719 -> 1.671 ms).
"""

from __future__ import annotations

import logging

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl

from .elementwise_analysis import (
    buffer_accesses,
    conditions_on,
    constant_per_half,
    contiguous,
    inline_all,
    tvm_dtype_bytes,
)
from .var_bounds import fits_int32

logger = logging.getLogger(__name__)

DATA_PAR = 0  # tirx.IterVar.iter_type


class RowElementwise(dl.ScheduleRule):
    """Injective kernels with a static, contiguous last axis: rows on blocks, 16-byte vectors on threads."""

    def __init__(
        self,
        vector_bytes: int = 16,
        row_threads: tuple = (512, 256, 128, 64),
        pack_threads: int = 256,
        halves: bool = True,
    ):
        # halves: a select on the column that is constant on each half of the row (RoPE) is scheduled
        # per half (False: declined, the rule before issue 8's RoPE work)
        self.vector_bytes, self.row_threads, self.pack_threads, self.halves = (
            vector_bytes,
            row_threads,
            pack_threads,
            halves,
        )

    def apply(self, func, target, _tunable):
        if not isinstance(func, tirx.PrimFunc):
            return None
        if func.attrs is not None and func.attrs.get("tirx.is_scheduled", False):
            return None
        sch = s_tir.Schedule(func)
        blocks = inline_all(sch, sch.get_sblock("root"))
        if len(blocks) != 1:
            return None
        (block,) = blocks
        stmt = sch.get(block)
        if any(int(iv.iter_type) != DATA_PAR for iv in stmt.iter_vars) or len(stmt.writes) != 1:
            return None
        loops = sch.get_loops(block)
        if not loops or len(stmt.iter_vars) != len(loops):
            return None
        # trivial binding: block var i is loop i (FuseTIR / LegalizeOps write T.axis.remap("SS..S"))
        loop_vars = [sch.get(lp).loop_var for lp in loops]
        binding = self._binding(sch, block)
        if (
            binding is None
            or len(binding) != len(loop_vars)
            or not all(b.same_as(v) for b, v in zip(binding, loop_vars))
        ):
            return None
        last_extent = sch.get(loops[-1]).extent
        if not isinstance(last_extent, tirx.IntImm):
            return None
        length = int(last_extent)
        out = stmt.writes[0].source
        if len(out.shape) == 0:
            return None
        inner = stmt.iter_vars[-1].var
        accesses = buffer_accesses(stmt.body)
        if not accesses:
            return None
        analyzer = tvm.sym.Analyzer()  # the block vars' domains: `v % 128` with v < 128 is v
        for iv in stmt.iter_vars:
            analyzer.bind(iv.var, iv.dom)
        for _name, _dtype, indices in accesses:
            if not contiguous(indices, inner, analyzer):
                return None
        # the output's last index must be the innermost var itself (a store along the last axis)
        stores = [idx for name, _dt, idx in accesses if name == out.name]
        if not stores or not all(idx and idx[-1].same_as(inner) for idx in stores):
            return None
        widest = max(tvm_dtype_bytes(dtype) for _n, dtype, _i in accesses)
        vector = max(1, self.vector_bytes // widest)
        if conditions_on(stmt.body, inner):
            # RoPE's rotate-half: one vectorised loop per half of the row, where the select is constant
            if not self.halves or length % (2 * vector) or not constant_per_half(stmt.body, inner, length):
                return None
            return self._schedule_halves(sch, block, loops, length, vector, target)
        if length % vector:
            vector = 1
        return self._schedule(sch, block, loops, length, vector, target)

    def _schedule_halves(self, sch, block, loops, length: int, vector: int, target):
        """The last axis as two halves (loop_partition), each split as (C, V): its select conditions
        fold to constants (the half's column range is known when TVM simplifies, before it vectorises),
        so both halves are 16-byte loads and stores. A block of `pack_threads` threads takes
        pack_threads / C rows (threadIdx.y), C vectors of each half (threadIdx.x)."""
        limit = int(target.attrs.get("max_threads_per_block", 1024)) if target is not None else 1024
        *lead, last = loops
        row = sch.fuse(*lead) if len(lead) > 1 else (lead[0] if lead else sch.add_unit_loop(block))
        chunks = length // 2 // vector
        per_block = max(1, min(self.pack_threads, limit) // chunks)
        bx, ty = sch.split(row, [None, per_block])
        half, col = sch.split(last, [2, None])
        sch.bind(bx, "blockIdx.x")
        sch.bind(ty, "threadIdx.y")
        for part in sch.loop_partition(half, [1, None]):
            (inner_block,) = sch.get_child_blocks(part)
            tx, vec = sch.split(sch.get_loops(inner_block)[-1], [None, vector])
            sch.bind(tx, "threadIdx.x")
            sch.vectorize(vec)
        # loop_partition (0.27) copies the block with the same iter var objects: ill-formed TIR (a var
        # defined twice) that a new Schedule refuses; printed and parsed back, each copy gets its own
        mod = tvm.script.from_source(sch.mod.script())
        narrow = fits_int32(mod["main"])
        logger.debug(
            "RowElementwise: halves, %d rows of 2 x %d vectors per block, vector %d, %s indices",
            per_block,
            chunks,
            vector,
            "int32" if narrow else "int64",
        )
        return s_tir.Schedule(tirx.transform.ForceNarrowIndexToInt32()(mod) if narrow else mod)

    @staticmethod
    def _binding(sch, block):
        """The block's iter values (the loop expressions bound to its vars)."""
        body = sch.get(sch.get_loops(block)[-1]).body  # the SBlockRealize, directly under the innermost loop
        return list(body.iter_values) if hasattr(body, "iter_values") else None

    def _threads_per_row(self, chunks: int, limit: int) -> int:
        best = None
        for t in self.row_threads:
            if t > limit:
                continue
            waste = (-chunks) % t / (chunks + (-chunks) % t)
            if best is None or waste < best[0] - 1e-9:
                best = (waste, t)
        return best[1] if best else 64

    def _schedule(self, sch, block, loops, length: int, vector: int, target):
        limit = int(target.attrs.get("max_threads_per_block", 1024)) if target is not None else 1024
        *lead, last = loops
        row = sch.fuse(*lead) if len(lead) > 1 else (lead[0] if lead else sch.add_unit_loop(block))
        chunk, vec = sch.split(last, [None, vector]) if vector > 1 else (last, None)
        chunks = length // vector
        if chunks >= 64:
            threads = self._threads_per_row(chunks, limit)
            by, tx = sch.split(chunk, [None, threads])
            sch.reorder(row, by, tx)
            sch.bind(row, "blockIdx.x")
            sch.bind(by, "blockIdx.y")
            sch.bind(tx, "threadIdx.x")
            layout = f"rows on blockIdx.x, {chunks} vectors per row over blockIdx.y x {threads} threads"
        else:
            per_block = max(1, min(self.pack_threads, limit) // chunks)
            bx, r = sch.split(row, [None, per_block])
            sch.bind(bx, "blockIdx.x")
            tx = sch.fuse(r, chunk)
            sch.bind(tx, "threadIdx.x")
            layout = f"{per_block} rows of {chunks} vectors per block"
        if vec is not None:
            sch.vectorize(vec)
        narrow = fits_int32(sch.mod["main"])
        logger.debug("RowElementwise: %s, vector %d, %s indices", layout, vector, "int32" if narrow else "int64")
        if narrow:
            return s_tir.Schedule(tirx.transform.ForceNarrowIndexToInt32()(sch.mod))
        return sch
