"""relaxtune's decode attention for TVM's paged KV cache on cuda: the keys of each sequence split across blocks.

TVM's CUDA decode kernel (``batch_decode_paged_kv``) gives each (sequence, key/value head) one block, which walks
every cached key in turn: one sequence of a model with 3 key/value heads runs on 3 SMs, and its time grows with the
context (docs/results.md, "Decode attention split over the keys"). This kernel has the same signature (what the
runtime's paged KV cache calls: ``(q, pages, page_indptr, page_values, length_info, k_rope_pos_offset,
q_rope_position, output, lse, rotary_mode, rope_scale, rope_theta, sm_scale)``) and runs as two launches of one
PrimFunc:

1. ``split``: blocks (sequence, key/value head, split); a sequence's `kv_len` keys fall in `splits` runs of
   ceil(kv_len / splits), one per block. A block's `rows` rows of `bdx` lanes take the run's keys in turns, UNROLL
   keys a row at a time (their loads issued together); each lane holds `vec` of head_dim for every query head of
   the group (K and V read once for the group), each score a sum over the row's lanes (a shuffle reduction), then
   an online softmax per head (base 2: scores scaled by sm_scale * log2(e)). The rows' states meet in shared
   memory; the block writes its unnormalized output and its (max, sum) per head to a workspace of (sequence,
   query head, split).
2. ``merge``: blocks (sequence, query head), whose MERGE_ROWS rows take the splits in turns, each row loading all
   of its splits' states at once (unrolled, no load behind a branch: one round trip, not one a split): the
   states rescaled to their common max, summed (per row, then the rows' in shared memory), divided:
   ``output``, and ``lse`` = max + log2(sum), the base-2 log-sum-exp as TVM's kernels give it.

`splits` is min(MAX_SPLITS, ceil(TARGET_BLOCKS / (sequences * key/value heads)), ceil(nnz_pages / sequences)), at
least 1: known at launch from the buffers' shapes (a run of about a page or more on average); runs past a short
sequence's keys are empty (sum 0, skipped by the merge). Below SPLIT_FROM_PAGES pages a sequence on average it is 1:
the first launch writes output and lse itself and the merge is not launched (a decode step with short sequences is
bound by its launches, not by this kernel). A sequence with no keys gets output 0 and lse -5e4, as TVM's kernel
gives. Keys are read as stored: rotated before they were stored (RopeMode.NORMAL), so ``rotary_mode`` must be 0
(asserted). No sliding window: the pass (`relax_passes/paged_decode_cuda.py`) replaces only the plain decode
kernel. Sizes it takes: `refusal`.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

PAGE_SIZE = 16  # tokens of a page of TVM's paged KV cache (its kernels are built for 16)
THREADS = 256  # threads of a block of the first launch (rows x bdx)
UNROLL = 2  # keys a row loads at once
SHARED_BYTES = 32768  # the most shared memory the rows' states take (fewer rows where a group is large)
MERGE_ROWS = 8  # rows of lanes of a merge block, splits taken in turns
TARGET_BLOCKS = 1024  # blocks of the first launch aimed at (several per SM of a large GPU)
SPLIT_FROM_PAGES = 16  # sequences of fewer pages on average: one split, one launch (a second costs more there)
MAX_SPLITS = 128
MAX_GROUP = 8  # query heads a key/value head at most (each lane keeps the group's q and outputs in registers)
LOG2E = math.log2(math.e)
EMPTY_LSE = -5e4  # the lse of a sequence without keys (TVM's kernel's)
ROTATED = "relaxtune's cuda decode attention reads keys rotated before they were stored (RopeMode.NORMAL)"


def lanes(d: int) -> tuple[int, int]:
    """(bdx, vec): the lanes over head_dim (at most a warp) and the elements each holds (4 up to head_dim 128)."""
    if d < 8 or d > 256 or d & (d - 1):
        raise ValueError(f"head_dim {d}: relaxtune's cuda decode attention takes a power of two from 8 to 256")
    vec = max(4, d // 32)
    return d // vec, vec


def refusal(h_q: int, h_kv: int, d: int) -> str | None:
    """Why the kernel does not take a cache of these sizes, or None where it does."""
    if h_q % h_kv or h_q // h_kv > MAX_GROUP:
        return f"{h_q} query heads over {h_kv} key/value heads: the kernel takes groups of 1 to {MAX_GROUP}"
    try:
        lanes(d)
    except ValueError as err:
        return str(err)
    return None


def rows(group: int, d: int) -> int:
    """The rows of lanes of a block: THREADS / bdx, halved while their states passed to shared memory would take
    more than SHARED_BYTES."""
    bdx, _ = lanes(d)
    out = THREADS // bdx
    while out > 1 and out * group * (d + 2) * 4 > SHARED_BYTES:
        out //= 2
    return out


def splits(batch, h_kv: int, nnz_pages):
    """The number of runs each sequence's keys are split into (module docstring)."""
    heads = T.max(batch, 1) * h_kv  # (no division by zero where a call has no sequence)
    wanted = T.min(T.truncdiv(TARGET_BLOCKS + heads - 1, heads), MAX_SPLITS)
    pages = T.truncdiv(nnz_pages + T.max(batch, 1) - 1, T.max(batch, 1))  # a sequence's on average
    return T.if_then_else(pages < SPLIT_FROM_PAGES, 1, T.max(T.min(wanted, pages), 1))


def decode_kernel(h_kv: int, h_q: int, d: int, dtype: str):
    """The decode kernel for a cache of `h_q` query heads, `h_kv` key/value heads, head_dim `d` (module docstring)."""
    group = h_q // h_kv
    bdx, vec = lanes(d)
    bdz, kt, un = rows(group, d), PAGE_SIZE, UNROLL
    merge_turns = -(-MAX_SPLITS // MERGE_ROWS)  # the splits a merge row takes at most

    @T.prim_func(s_tir=True, private=True)
    def decode(
        var_q: T.handle,
        var_pages: T.handle,
        var_page_indptr: T.handle,
        var_page_values: T.handle,
        var_length_info: T.handle,
        var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle,
        var_output: T.handle,
        var_lse: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch, nnz_pages, max_pages = T.int32(), T.int32(), T.int32()
        pg_off = T.int64()
        pi_off, pv_off, li_off, kr_off, qr_off = T.int32(), T.int32(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(var_q, (batch, h_q, d), dtype)
        pages = T.match_buffer(var_pages, (max_pages, 2, h_kv, kt, d), dtype, elem_offset=pg_off, offset_factor=vec)
        page_indptr = T.match_buffer(var_page_indptr, (batch + 1,), "int32", elem_offset=pi_off)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=pv_off)
        length_info = T.match_buffer(var_length_info, (batch,), "int32", elem_offset=li_off)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch,), "int32", elem_offset=kr_off)  # noqa: F841 (the signature the runtime calls)
        q_rope_position = T.match_buffer(var_q_rope_position, (batch,), "int32", elem_offset=qr_off)  # noqa: F841 (the signature the runtime calls)
        output = T.match_buffer(var_output, (batch, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (batch, h_q), "float32")
        T.Assert(rotary_mode == 0, ROTATED)
        n_split: T.let[T.int32] = splits(batch, h_kv, nnz_pages)
        part_o = T.alloc_buffer((batch, h_q, n_split, d), "float32", scope="global")
        part_md = T.alloc_buffer((batch, h_q, n_split, 2), "float32", scope="global")
        for bx in T.thread_binding(batch, thread="blockIdx.x"):
            for by in T.thread_binding(h_kv * n_split, thread="blockIdx.y"):
                for tz in T.thread_binding(bdz, thread="threadIdx.y"):
                    for tx in T.thread_binding(bdx, thread="threadIdx.x"):
                        with T.sblock("split"):
                            T.reads()
                            T.writes()
                            q_loc = T.sblock_alloc_buffer((group, vec), "float32", scope="local")
                            o_loc = T.sblock_alloc_buffer((group, vec), "float32", scope="local")
                            m_loc = T.sblock_alloc_buffer((group,), "float32", scope="local")
                            d_loc = T.sblock_alloc_buffer((group,), "float32", scope="local")
                            k_loc = T.sblock_alloc_buffer((un, vec), dtype, scope="local")
                            v_loc = T.sblock_alloc_buffer((un, vec), dtype, scope="local")
                            s_part = T.sblock_alloc_buffer((1,), "float32", scope="local")
                            s_all = T.sblock_alloc_buffer((1,), "float32", scope="local")
                            m_new = T.sblock_alloc_buffer((1,), "float32", scope="local")
                            red_o = T.sblock_alloc_buffer((bdz, group, d), "float32", scope="shared")
                            red_md = T.sblock_alloc_buffer((bdz, group, 2), "float32", scope="shared")
                            h: T.let[T.int32] = T.truncdiv(by, n_split)
                            s: T.let[T.int32] = T.truncmod(by, n_split)
                            first_page: T.let[T.int32] = page_indptr[bx]
                            n_pages: T.let[T.int32] = page_indptr[bx + 1] - first_page
                            kv_len: T.let[T.int32] = T.max(n_pages - 1, 0) * kt + T.if_then_else(
                                n_pages > 0, length_info[bx], 0
                            )
                            chunk: T.let[T.int32] = T.truncdiv(kv_len + n_split - 1, n_split)
                            lo: T.let[T.int32] = T.min(s * chunk, kv_len)
                            hi: T.let[T.int32] = T.min(lo + chunk, kv_len)
                            for g in T.unroll(group):
                                m_loc[g] = T.float32(EMPTY_LSE)
                                d_loc[g] = T.float32(0)
                                for e in T.vectorized(vec):
                                    o_loc[g, e] = T.float32(0)
                                    q_loc[g, e] = T.Cast("float32", q[bx, h * group + g, tx * vec + e]) * (
                                        sm_scale * T.float32(LOG2E)
                                    )
                            for it in T.serial(T.truncdiv(hi - lo + bdz * un - 1, bdz * un)):
                                for u in T.unroll(un):  # the row's keys it * bdz * un + tz + u * bdz: loads first
                                    pos: T.let[T.int32] = T.min(lo + (it * un + u) * bdz + tz, hi - 1)
                                    page: T.let[T.int32] = page_values[first_page + T.truncdiv(pos, kt)]
                                    for e in T.vectorized(vec):
                                        k_loc[u, e] = pages[page, 0, h, T.truncmod(pos, kt), tx * vec + e]
                                    for e in T.vectorized(vec):
                                        v_loc[u, e] = pages[page, 1, h, T.truncmod(pos, kt), tx * vec + e]
                                for u, g in T.grid(un, group):  # (unrolled, it would repeat the reduction's buffers)
                                    s_part[0] = T.float32(0)
                                    for e in T.unroll(vec):
                                        s_part[0] = s_part[0] + q_loc[g, e] * T.Cast("float32", k_loc[u, e])
                                    with T.sblock("score_sum"):
                                        T.reads(s_part[0])
                                        T.writes(s_all[0])
                                        T.attr(
                                            T.comm_reducer(lambda a, b: a + b, [T.float32(0)]),
                                            "reduce_scope",
                                            T.int32(0),
                                        )
                                        T.tvm_thread_allreduce(T.uint32(1), s_part[0], True, s_all[0], tx, dtype="void")
                                    if lo + (it * un + u) * bdz + tz < hi:
                                        m_new[0] = T.max(m_loc[g], s_all[0])
                                        d_loc[g] = d_loc[g] * T.exp2(m_loc[g] - m_new[0]) + T.exp2(s_all[0] - m_new[0])
                                        for e in T.vectorized(vec):
                                            o_loc[g, e] = o_loc[g, e] * T.exp2(m_loc[g] - m_new[0]) + T.exp2(
                                                s_all[0] - m_new[0]
                                            ) * T.Cast("float32", v_loc[u, e])
                                        m_loc[g] = m_new[0]
                            for g in T.unroll(group):
                                for e in T.vectorized(vec):
                                    red_o[tz, g, tx * vec + e] = o_loc[g, e]
                                red_md[tz, g, 0] = m_loc[g]
                                red_md[tz, g, 1] = d_loc[g]
                            T.tvm_storage_sync("shared")
                            if tz == 0:
                                for g in T.unroll(group):
                                    m_new[0] = red_md[0, g, 0]
                                    for z in T.unroll(1, bdz):
                                        m_new[0] = T.max(m_new[0], red_md[z, g, 0])
                                    d_loc[g] = T.float32(0)
                                    for e in T.vectorized(vec):
                                        o_loc[g, e] = T.float32(0)
                                    for z in T.unroll(bdz):
                                        d_loc[g] = d_loc[g] + red_md[z, g, 1] * T.exp2(red_md[z, g, 0] - m_new[0])
                                        for e in T.vectorized(vec):
                                            o_loc[g, e] = o_loc[g, e] + red_o[z, g, tx * vec + e] * T.exp2(
                                                red_md[z, g, 0] - m_new[0]
                                            )
                                    if n_split == 1:  # the block's state is the sequence's: output and lse
                                        for e in T.vectorized(vec):
                                            output[bx, h * group + g, tx * vec + e] = T.Cast(
                                                dtype,
                                                T.if_then_else(
                                                    d_loc[g] > T.float32(0), o_loc[g, e] / d_loc[g], T.float32(0)
                                                ),
                                            )
                                        if tx == 0:
                                            lse[bx, h * group + g] = T.if_then_else(
                                                d_loc[g] > T.float32(0),
                                                m_new[0] + T.log2(d_loc[g]),
                                                T.float32(EMPTY_LSE),
                                            )
                                    else:
                                        for e in T.vectorized(vec):
                                            part_o[bx, h * group + g, s, tx * vec + e] = o_loc[g, e]
                                        if tx == 0:
                                            part_md[bx, h * group + g, s, 0] = m_new[0]
                                            part_md[bx, h * group + g, s, 1] = d_loc[g]
        if n_split > 1:  # (host code: one launch where the keys are not split)
            for bx in T.thread_binding(batch, thread="blockIdx.x"):
                for hq in T.thread_binding(h_q, thread="blockIdx.y"):
                    for tz in T.thread_binding(MERGE_ROWS, thread="threadIdx.y"):
                        for tx in T.thread_binding(bdx, thread="threadIdx.x"):
                            with T.sblock("merge"):
                                T.reads()
                                T.writes()
                                acc = T.sblock_alloc_buffer((vec,), "float32", scope="local")
                                m_all = T.sblock_alloc_buffer((1,), "float32", scope="local")
                                d_all = T.sblock_alloc_buffer((1,), "float32", scope="local")
                                # a split's share: exp2(its max - the common max), 0 where it is empty
                                weight = T.sblock_alloc_buffer((1,), "float32", scope="local")
                                md_loc = T.sblock_alloc_buffer((merge_turns, 2), "float32", scope="local")
                                o_part = T.sblock_alloc_buffer((merge_turns, vec), "float32", scope="local")
                                red_o = T.sblock_alloc_buffer((MERGE_ROWS, d), "float32", scope="shared")
                                red_md = T.sblock_alloc_buffer((MERGE_ROWS, 2), "float32", scope="shared")
                                # every split's state loaded at once, no load behind a branch (a run of them
                                # in turns was a global round trip each); splits past n_split weigh nothing
                                for it in T.unroll(merge_turns):
                                    at: T.let[T.int32] = T.min(it * MERGE_ROWS + tz, n_split - 1)
                                    md_loc[it, 0] = part_md[bx, hq, at, 0]
                                    md_loc[it, 1] = part_md[bx, hq, at, 1]
                                    for e in T.vectorized(vec):
                                        o_part[it, e] = part_o[bx, hq, at, tx * vec + e]
                                for it in T.unroll(merge_turns):  # a clamped repeat weighs nothing
                                    md_loc[it, 1] = T.if_then_else(
                                        it * MERGE_ROWS + tz < n_split, md_loc[it, 1], T.float32(0)
                                    )
                                m_all[0] = T.float32(EMPTY_LSE)
                                for it in T.unroll(merge_turns):
                                    m_all[0] = T.if_then_else(
                                        md_loc[it, 1] > T.float32(0), T.max(m_all[0], md_loc[it, 0]), m_all[0]
                                    )
                                d_all[0] = T.float32(0)
                                for e in T.vectorized(vec):
                                    acc[e] = T.float32(0)
                                for it in T.unroll(merge_turns):  # an empty split: sum 0, and its part 0
                                    weight[0] = T.if_then_else(
                                        md_loc[it, 1] > T.float32(0), T.exp2(md_loc[it, 0] - m_all[0]), T.float32(0)
                                    )
                                    d_all[0] = d_all[0] + md_loc[it, 1] * weight[0]
                                    for e in T.vectorized(vec):
                                        acc[e] = acc[e] + o_part[it, e] * weight[0]
                                for e in T.vectorized(vec):
                                    red_o[tz, tx * vec + e] = acc[e]
                                red_md[tz, 0] = m_all[0]
                                red_md[tz, 1] = d_all[0]
                                T.tvm_storage_sync("shared")
                                if tz == 0:
                                    m_all[0] = red_md[0, 0]
                                    for z in T.unroll(1, MERGE_ROWS):
                                        m_all[0] = T.max(m_all[0], red_md[z, 0])
                                    d_all[0] = T.float32(0)
                                    for e in T.vectorized(vec):
                                        acc[e] = T.float32(0)
                                    for z in T.unroll(MERGE_ROWS):
                                        d_all[0] = d_all[0] + red_md[z, 1] * T.exp2(red_md[z, 0] - m_all[0])
                                        for e in T.vectorized(vec):
                                            acc[e] = acc[e] + red_o[z, tx * vec + e] * T.exp2(red_md[z, 0] - m_all[0])
                                    for e in T.vectorized(vec):
                                        output[bx, hq, tx * vec + e] = T.Cast(
                                            dtype,
                                            T.if_then_else(d_all[0] > T.float32(0), acc[e] / d_all[0], T.float32(0)),
                                        )
                                    if tx == 0:
                                        lse[bx, hq] = T.if_then_else(
                                            d_all[0] > T.float32(0), m_all[0] + T.log2(d_all[0]), T.float32(EMPTY_LSE)
                                        )

    return decode
