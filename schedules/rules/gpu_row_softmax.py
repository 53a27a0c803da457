"""RowSoftmax: a CUDA schedule for softmax over the last axis, plain or with an additive bias/mask
(`softmax_bias`, emitted by relax_passes/cublas_batched_gemm.py), one thread block per row.

Tried in gpu_rules.py before dlight's `GeneralReduction`, which took 813 us for the (1, 32, 2048,
2048) fp16 masked softmax of the Llama-7B block on an H200 (issue 8): about 6x the time of reading
and writing the scores once at copy bandwidth. Runs after `FuseOps -> FuseTIR`, on kernels not
marked `tirx.is_scheduled`.

Matches by structure, not by name: after the injective producers are inlined (the bias add, the
exp block of some softmax forms, casts), the kernel must be one or more row reductions over the
innermost axis (max, then sum of exp) followed by one spatial block over the same rows that
reads them (the normalisation, the only output). The schedule:

- the leading (row) axes fused onto `blockIdx.x`: one block of `threads` (256) threads per row;
- each reduction's row loop split as (serial chunk, unroll 8, threadIdx.x): every load is
  coalesced across the warp and each thread issues 8 independent loads before using them. dlight's
  GeneralReduction has the same block/thread layout but one guarded load per serial step: a GPU
  issues in order, so each thread likely waits out a memory latency per element (not yet
  measured apart: reading 268 MB with ~4 KB in flight per SM would take about the 813 us above). Each thread folds its
  elements in a register,
  then a warp-shuffle all-reduce (TVM's cross-thread reduction) gives every thread the result;
  the reduced values live in shared memory (one per row);
- the output loop the same way; with a static row length divisible by 8 x threads each thread
  writes 8 elements at once (vectorised);
- the row length may be symbolic (the key length of a bucket): the chunk loops carry
  `pragma_loop_partition_hint`, so TVM's LoopPartition emits whole 2048-element chunks without
  bound checks (straight-line loads) and one checked tail.

- a static row that is a multiple of threads x V long (V = 16 bytes of the widest row operand;
  RMSNorm at hidden 4096, a static softmax row): each reduction reads its row operands 16 bytes at
  a time into registers (`cache_read` to local, vectorised; element (o * threads + tx) * V + v,
  o and v unrolled) instead of one scalar load per element (`_vector_reduce`; `vector_bytes=0`
  keeps the scalar loads). The output pass of a row with fp32 math (RMSNorm's scale, the fp32
  softmax) writes 4 elements per step, not 8: TVM's CUDA codegen emits a float32 x 8 broadcast as
  an 8-argument make_ulonglong4 that nvcc rejects (`_output_vector`).
  H200, 7B block, n = 2048 (benchmarks/gpu_job.py, llama7b-rf-cublas-flash vs -h8cprev): each
  RMSNorm 15.1-15.4 us (then dlight's Reduction rule, 1024 threads, scalar loads: this rule now
  runs before it, gpu_rules.ROW_SOFTMAX_FIRST) -> 7.8-7.9 us (~4.2 TB/s for the 33.5 MB read and
  written); 5.4-5.7 us at n = 1 and 128 (launch-bound) either way.

The row is read from global memory by each pass (max, sum, normalise), but a row is 4 KB at
m = 2048 and the 2nd and 3rd reads hit L1 (8 blocks of 256 threads per SM: 64 KB of rows);
exp is recomputed in the normalisation rather than stored. The accumulation type is the compute
definition's: `softmax_bias` accumulates in fp32 (see cublas_batched_gemm._softmax_bias), a
legalized `R.nn.softmax` in its own dtype. Not done: skipping the masked half of causal rows
(the rule sees only an additive bias, not that it is causal).
"""

from __future__ import annotations

import logging

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl

from .elementwise_analysis import uses

logger = logging.getLogger(__name__)

DATA_PAR, COMM_REDUCE = 0, 2  # tirx.IterVar.iter_type values


def _kinds(sch: s_tir.Schedule, block) -> list[int]:
    return [int(iv.iter_type) for iv in sch.get(block).iter_vars]


def _is_spatial(sch, block) -> bool:
    return all(k == DATA_PAR for k in _kinds(sch, block))


def _inline_producers(sch: s_tir.Schedule, root) -> list:
    """Inline every spatial block except the last (the output) that can be inlined; the blocks left."""
    changed = True
    while changed:
        changed = False
        blocks = sch.get_child_blocks(root)
        for block in blocks[:-1]:
            if not _is_spatial(sch, block):
                continue
            try:
                sch.compute_inline(block)
                changed = True
                break
            except Exception:  # noqa: BLE001 - not inlinable: the structure check below decides
                continue
    blocks = sch.get_child_blocks(root)
    if len(blocks) >= 2 and _is_spatial(sch, blocks[-1]) and _is_spatial(sch, blocks[-2]):
        try:  # an epilogue after the normalisation (a cast): into the normalisation
            sch.reverse_compute_inline(blocks[-1])
        except Exception:  # noqa: BLE001
            pass
    return list(sch.get_child_blocks(root))


def _row_reduction(sch, block, rank: int) -> bool:
    """`block` reduces over exactly one axis, its innermost loop, and keeps `rank - 1` spatial axes."""
    kinds = _kinds(sch, block)
    loops = sch.get_loops(block)
    if (
        kinds.count(COMM_REDUCE) != 1
        or kinds[-1] != COMM_REDUCE
        or any(k not in (DATA_PAR, COMM_REDUCE) for k in kinds)
    ):
        return False
    return len(kinds) == rank and len(loops) == rank


def _same_extents(sch, loops_a, loops_b) -> bool:
    ana = tvm.sym.Analyzer()
    return len(loops_a) == len(loops_b) and all(
        ana.can_prove_equal(sch.get(a).extent, sch.get(b).extent) for a, b in zip(loops_a, loops_b)
    )


class RowSoftmax(dl.ScheduleRule):
    """Softmax-shaped kernels (row reductions, then one normalising output pass): a block per row."""

    def __init__(self, threads: int = 256, vector: int = 8, unroll: int = 8, vector_bytes: int = 16):
        # vector_bytes: 16-byte loads in the reduction passes of a static row (0: scalar loads, the rule before issue
        # 8's RMSNorm work)
        self.threads, self.vector, self.unroll, self.vector_bytes = threads, vector, unroll, vector_bytes

    def apply(self, func, target, _tunable):
        if not isinstance(func, tirx.PrimFunc):
            return None
        if func.attrs is not None and func.attrs.get("tirx.is_scheduled", False):
            return None
        sch = s_tir.Schedule(func)
        root = sch.get_sblock("root")
        blocks = _inline_producers(sch, root)
        if len(blocks) < 2:
            return None
        *reductions, output = blocks
        if not _is_spatial(sch, output):
            return None
        out_loops = sch.get_loops(output)
        rank = len(out_loops)
        if rank < 2 or len(sch.get(output).writes) != 1:
            return None
        for red in reductions:
            if not _row_reduction(sch, red, rank) or not _same_extents(sch, sch.get_loops(red), out_loops):
                return None
        # each reduction's result must be read by the output (else this is not a normalisation)
        out_reads = {r.source.name for r in sch.get(output).reads}
        if not all(any(w.source.name in out_reads for w in sch.get(red).writes) for red in reductions):
            return None
        if not all(len(sch.get(red).writes) == 1 for red in reductions):
            return None
        return self._schedule(sch, reductions, output, target)

    def _threads(self, sch, row_loop, target) -> int:
        limit = int(target.attrs.get("max_threads_per_block", 1024)) if target is not None else 1024
        threads = min(self.threads, limit)
        extent = sch.get(row_loop).extent
        if isinstance(extent, tirx.IntImm):
            while threads > 32 and threads // 2 >= int(extent):
                threads //= 2
        return threads

    def _schedule(self, sch: s_tir.Schedule, reductions: list, output, target) -> s_tir.Schedule:
        *lead, row = sch.get_loops(output)
        threads = self._threads(sch, row, target)
        extent = sch.get(row).extent
        static = int(extent) if isinstance(extent, tirx.IntImm) else None
        vector = self._output_vector(sch, output)
        vector = vector if static and static % (threads * vector) == 0 else 1
        unroll = self.unroll if static is None else max(1, min(self.unroll, static // threads))
        bx = sch.fuse(*lead)
        sch.bind(bx, "blockIdx.x")
        if vector > 1:
            _o, tx, vec = sch.split(row, [None, threads, vector])
            sch.vectorize(vec)
        else:
            o, step, tx = sch.split(row, [None, unroll, threads])
            sch.unroll(step)
            sch.annotate(o, "pragma_loop_partition_hint", 1)  # whole chunks without bound checks
        sch.bind(tx, "threadIdx.x")
        for red in reversed(reductions):
            sch.compute_at(red, bx, preserve_unit_loops=True)
            if self._vector_reduce(sch, red, static, threads):
                continue
            red_row = sch.get_loops(red)[-1]
            # element (r_o * unroll + r_step) * threads + r_tx: each load coalesced across the warp,
            # `unroll` independent loads in flight per thread (a GPU issues in order: without them
            # every load waits for the previous one, about 0.5 TB/s on an H200)
            r_o, r_step, r_tx = sch.split(red_row, [None, unroll, threads])
            sch.reorder(r_tx, r_o, r_step)  # thread loop outside: the all-reduce is over threadIdx.x
            sch.bind(r_tx, "threadIdx.x")
            sch.unroll(r_step)
            sch.annotate(r_o, "pragma_loop_partition_hint", 1)  # LoopPartition: whole chunks unchecked, then the tail
            sch.set_scope(red, 0, "shared")
        logger.debug(
            "RowSoftmax: %d reduction(s), %d threads, vector %d, unroll %d", len(reductions), threads, vector, unroll
        )
        return sch

    def _output_vector(self, sch, output) -> int:
        """`self.vector`, at most 16 bytes of the widest type in the output's expression: TVM's CUDA
        codegen writes a float32 x 8 broadcast (RMSNorm's fp32 scale) as an 8-argument
        make_ulonglong4, which nvcc rejects."""
        widest = 4 if "float32" in str(sch.get(output).body) else 2  # fp32 math in the expression
        return max(1, min(self.vector, 16 // widest))

    def _vector_reduce(self, sch: s_tir.Schedule, red, static: int | None, threads: int) -> bool:
        """A static row whose length is a multiple of `threads` x V (V = 16 bytes of the widest row
        operand): each row operand is read into registers V elements at a time (one 16-byte load,
        `cache_read` to local, vectorised), element (o * threads + tx) * V + v, the o loop unrolled
        (RMSNorm at hidden 4096, fp16: 2 x 16 bytes per thread of 256). False: nothing was done."""
        if not self.vector_bytes or static is None:
            return False
        block = sch.get(red)
        reads, k = block.reads, block.iter_vars[-1].var  # k: the reduced (row) axis
        analyzer = tvm.sym.Analyzer()

        def along_row(region) -> bool:  # the last index is k + an offset free of k, the others free of k
            if not len(region) or any(uses(r.min, k) for r in region[:-1]):
                return False
            last = region[-1]
            return (
                isinstance(last.extent, tirx.IntImm)
                and int(last.extent) == 1
                and uses(last.min, k)
                and not uses(analyzer.simplify(last.min - k), k)
            )

        rows = [i for i, r in enumerate(reads) if along_row(r.region)]
        if not rows or any(uses(r.region[-1].min, k) for i, r in enumerate(reads) if i not in rows):
            return False
        names = {reads[i].source.name for i in rows}
        widest = max(tvm.runtime.DataType(str(reads[i].source.dtype)).bits // 8 for i in rows)
        vector = self.vector_bytes // max(1, widest)
        if vector <= 1 or static % (threads * vector):
            return False
        r_o, r_tx, r_v = sch.split(sch.get_loops(red)[-1], [None, threads, vector])
        sch.reorder(r_tx, r_o, r_v)  # thread loop outside: the all-reduce is over threadIdx.x
        sch.bind(r_tx, "threadIdx.x")
        for name in sorted(names):
            index = next(i for i, r in enumerate(sch.get(red).reads) if r.source.name == name)
            cache = sch.cache_read(red, index, "local", consumer_blocks=[red])
            sch.compute_at(cache, r_o, preserve_unit_loops=True)
            sch.vectorize(sch.get_loops(cache)[-1])
        sch.unroll(r_o)
        sch.unroll(r_v)
        sch.set_scope(red, 0, "shared")
        return True
