"""Compute definitions of relaxtune's CPU attention kernels for TVM's paged KV cache: TIR with blocks,
no schedule (the rule `schedules/rules/cpu_paged_attention.py` schedules them; the pass
`paged_kv_kernels.py` puts them in place of TVM's).

Each kernel has the signature of the TVM kernel it replaces (what the runtime's paged KV cache calls):
- `prefill_kernel(..., paged=False)`: ``(q, q_indptr, k, v, kv_indptr, q_rope_position,
  k_rope_pos_offset, output, lse, causal, rotary_mode, rope_scale, rope_theta, sm_scale)``, the new
  tokens of each sequence attending to themselves (TVM's ``batch_prefill_ragged_kv``);
- `prefill_kernel(..., paged=True)`: ``(q, q_indptr, pages, page_indptr, page_values, length_info,
  k_rope_pos_offset, q_rope_position, output, lse, causal, rotary_mode, rope_scale, rope_theta,
  sm_scale)``, the new tokens attending to a sequence's cached positions (``batch_prefill_paged_kv_cpu``);
- `decode_kernel`: ``(q, pages, page_indptr, page_values, length_info, k_rope_pos_offset,
  q_rope_position, output, lse, rotary_mode, rope_scale, rope_theta, sm_scale)``, one new token per
  sequence attending to its cached positions, itself included (``batch_decode_paged_kv_cpu``);
- `merge_kernel`: ``(v, s, v_other, s_other)``, two partial results merged into the first in place
  by their log-sum-exps (``merge_state_inplace_cpu``); written scheduled (parallel over positions,
  vectorized along head_dim): s_tir refuses both primitives on blocks that update in place.

What they compute: ``softmax(sm_scale q kᵀ + mask) v`` per query head, key/value head ``h // (h_q / h_kv)``,
with an online softmax over tiles of `PAGE_SIZE` keys (a page of the cache), and ``lse`` the base-2
log-sum-exp of the scaled scores, as TVM's kernels give it (the merge reads it). ``causal``: query row
i of a sequence of ``q_len`` new tokens sees key j when ``j < kv_len - q_len + i + 1``. Keys are read
rotated: the cache's split kernel rotated them before they were stored (RopeMode.NORMAL), so
``rotary_mode`` must be 0 (a kernel asserts it).

Work is split per sequence (batch loop, serial) into independent tasks for parallel loops. A
prefill kernel first gathers each tile of `PAGE_SIZE` keys of a sequence (block ``kv_gather``, tasks
(kv head, tile)): keys transposed into contiguous (head_dim, tile) tiles, so a row's 16 scores are one
vector of sums over head_dim, and values as (tile, head_dim) rows; keys past the sequence's length
repeat its last key (never uninitialised memory; they are masked). Then the tasks are (query head,
tile of `QUERY_TILE` rows) (block ``query_tile``), whose rows go `ROW_GROUP` at a time (block
``row_group``): per key tile ``score``, ``mask``, ``row_max``, ``prob``, ``rescale``, ``row_sum``,
``acc`` (the running output rescaled, then P·V), ``acc_store``, and after the last tile ``output``,
``lse``. The gather is the only difference between the two prefill forms. A decode task (sequence,
query head; block ``head``) reads its keys in place, each score a dot product along head_dim.
Buffers of a row group or a decode task stay under 1 KiB, so TVM keeps them on the stack.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

ATTR = "relaxtune.kernel"  # the kind of kernel, for the schedule rule (never a name)
PREFILL, DECODE, MERGE = "paged_prefill", "paged_decode", "attention_merge"
PAGED_ATTR = "relaxtune.paged"  # prefill kernels: 1 when keys come from the cache's pages
PAGE_SIZE = 16  # the tokens of a page of TVM's CPU paged KV cache (its kernels are built for 16)
QUERY_TILE = 32  # query rows per prefill task
ROW_GROUP = 4  # rows sharing each key tile and value row: independent accumulation chains
DECODE_LANES = 8  # partial sums per decode score: 16 keys x 8 float32 stay under TVM's 1 KiB stack limit
LOG2E = math.log2(math.e)
LOWEST = -3.4028234663852886e38  # a masked score: exp(LOWEST - m) == 0 for any finite m
ROTATED = "relaxtune's CPU attention kernels read keys rotated before they were stored (RopeMode.NORMAL)"


def _row_groups(h_q: int, group: int, d: int, dtype: str, query_tile: int, row_group: int):
    """The query tiles of one sequence (shared by both prefill forms): a macro over the gathered tiles."""
    kt, qt, rg = PAGE_SIZE, query_tile, row_group

    @T.macro
    def run(q, output, lse, Kt, Vs, q_start, q_len, kv_len, tiles, causal, sm_scale):
        row_tiles: T.let[T.int32] = (q_len + qt - 1) // qt
        for task in T.serial(h_q * row_tiles):
            with T.sblock("query_tile"):
                vt = T.axis.spatial(h_q * row_tiles, task)
                T.reads(
                    q[q_start : q_start + q_len, 0:h_q, 0:d],
                    Kt[0 : Kt.shape[0], 0:tiles, 0:d, 0:kt],
                    Vs[0 : Vs.shape[0], 0:tiles, 0:kt, 0:d],
                )
                T.writes(output[q_start : q_start + q_len, 0:h_q, 0:d], lse[q_start : q_start + q_len, 0:h_q])
                Qs = T.sblock_alloc_buffer((qt, d), "float32")
                O = T.sblock_alloc_buffer((qt, d), "float32")  # noqa: E741 (the rows' running outputs)
                On = T.sblock_alloc_buffer((qt, d), "float32")
                h: T.let[T.int32] = vt // row_tiles
                g: T.let[T.int32] = h // group
                row0: T.let[T.int32] = (vt % row_tiles) * qt
                for r, dd in T.grid(qt, d):
                    with T.sblock("q_load"):
                        vr, vd = T.axis.remap("SS", [r, dd])
                        Qs[vr, vd] = T.Cast("float32", q[q_start + T.min(row0 + vr, q_len - 1), h, vd]) * sm_scale
                for grp in T.serial((T.min(qt, q_len - row0) + rg - 1) // rg):
                    with T.sblock("row_group"):
                        vg = T.axis.spatial(qt // rg, grp)
                        T.reads(Qs[vg * rg : vg * rg + rg, 0:d], Kt[g, 0:tiles, 0:d, 0:kt], Vs[g, 0:tiles, 0:kt, 0:d])
                        T.writes(output[q_start : q_start + q_len, h, 0:d], lse[q_start : q_start + q_len, h])
                        S = T.sblock_alloc_buffer((rg, kt), "float32")
                        Sm = T.sblock_alloc_buffer((rg, kt), "float32")
                        P = T.sblock_alloc_buffer((rg, kt), "float32")
                        M = T.sblock_alloc_buffer((rg,), "float32")
                        L = T.sblock_alloc_buffer((rg,), "float32")
                        Mn = T.sblock_alloc_buffer((rg,), "float32")
                        A = T.sblock_alloc_buffer((rg,), "float32")
                        first: T.let[T.int32] = row0 + vg * rg  # the group's first row in the sequence's new tokens
                        last_limit: T.let[T.int32] = T.if_then_else(
                            causal > 0, T.min(kv_len, kv_len - q_len + first + rg), kv_len
                        )
                        for r in T.serial(rg):
                            with T.sblock("row_init"):
                                vr = T.axis.remap("S", [r])
                                M[vr] = T.float32(LOWEST)
                                L[vr] = T.float32(0)
                        for r, dd in T.grid(rg, d):
                            with T.sblock("acc_zero"):
                                vr, vd = T.axis.remap("SS", [r, dd])
                                O[vg * rg + vr, vd] = T.float32(0)
                        for tile in T.serial((last_limit + kt - 1) // kt):
                            with T.sblock("key_tile"):
                                vk = T.axis.spatial(tiles, tile)
                                T.reads(
                                    Qs[vg * rg : vg * rg + rg, 0:d],
                                    Kt[g, vk, 0:d, 0:kt],
                                    Vs[g, vk, 0:kt, 0:d],
                                    M[0:rg],
                                    L[0:rg],
                                    O[vg * rg : vg * rg + rg, 0:d],
                                )
                                T.writes(
                                    S[0:rg, 0:kt],
                                    Sm[0:rg, 0:kt],
                                    P[0:rg, 0:kt],
                                    M[0:rg],
                                    L[0:rg],
                                    Mn[0:rg],
                                    A[0:rg],
                                    O[vg * rg : vg * rg + rg, 0:d],
                                    On[vg * rg : vg * rg + rg, 0:d],
                                )
                                for r, j, dd in T.grid(rg, kt, d):
                                    with T.sblock("score"):
                                        vr, vj, vd = T.axis.remap("SSR", [r, j, dd])
                                        with T.init():
                                            S[vr, vj] = T.float32(0)
                                        S[vr, vj] = S[vr, vj] + Qs[vg * rg + vr, vd] * Kt[g, vk, vd, vj]
                                for r, j in T.grid(rg, kt):
                                    with T.sblock("mask"):
                                        vr, vj = T.axis.remap("SS", [r, j])
                                        Sm[vr, vj] = T.Select(
                                            vk * kt + vj
                                            < T.if_then_else(causal > 0, kv_len - q_len + first + vr + 1, kv_len),
                                            S[vr, vj],
                                            T.float32(LOWEST),
                                        )
                                for r, j in T.grid(rg, kt):
                                    with T.sblock("row_max"):
                                        vr, vj = T.axis.remap("SR", [r, j])
                                        with T.init():
                                            Mn[vr] = M[vr]
                                        Mn[vr] = T.max(Mn[vr], Sm[vr, vj])
                                for r, j in T.grid(rg, kt):
                                    with T.sblock("prob"):
                                        vr, vj = T.axis.remap("SS", [r, j])
                                        P[vr, vj] = T.exp(Sm[vr, vj] - Mn[vr])
                                for r in T.serial(rg):
                                    with T.sblock("rescale"):
                                        vr = T.axis.remap("S", [r])
                                        A[vr] = T.exp(M[vr] - Mn[vr])
                                        M[vr] = Mn[vr]
                                for r, j in T.grid(rg, kt):
                                    with T.sblock("row_sum"):
                                        vr, vj = T.axis.remap("SR", [r, j])
                                        with T.init():
                                            L[vr] = L[vr] * A[vr]
                                        L[vr] = L[vr] + P[vr, vj]
                                for r, dd, j in T.grid(rg, d, kt):
                                    with T.sblock("acc"):
                                        vr, vd, vj = T.axis.remap("SSR", [r, dd, j])
                                        with T.init():
                                            On[vg * rg + vr, vd] = O[vg * rg + vr, vd] * A[vr]
                                        On[vg * rg + vr, vd] = On[vg * rg + vr, vd] + P[vr, vj] * Vs[g, vk, vj, vd]
                                for r, dd in T.grid(rg, d):
                                    with T.sblock("acc_store"):
                                        vr, vd = T.axis.remap("SS", [r, dd])
                                        O[vg * rg + vr, vd] = On[vg * rg + vr, vd]
                        for r, dd in T.grid(rg, d):
                            with T.sblock("output"):
                                vr, vd = T.axis.remap("SS", [r, dd])
                                T.where(first + r < q_len)
                                output[q_start + first + vr, h, vd] = T.Cast(dtype, O[vg * rg + vr, vd] / L[vr])
                        for r in T.serial(rg):
                            with T.sblock("lse"):
                                vr = T.axis.remap("S", [r])
                                T.where(first + r < q_len)
                                lse[q_start + first + vr, h] = (M[vr] + T.log(L[vr])) * T.float32(LOG2E)

    return run


def prefill_kernel(
    h_kv: int, h_q: int, d: int, dtype: str, paged: bool, query_tile: int = QUERY_TILE, row_group: int = ROW_GROUP
):
    """The prefill kernel (module docstring); `paged` selects the cached-keys form."""
    run = _row_groups(h_q, h_q // h_kv, d, dtype, query_tile, row_group)
    return _paged_prefill(h_kv, h_q, d, dtype, run) if paged else _ragged_prefill(h_kv, h_q, d, dtype, run)


def _ragged_prefill(h_kv: int, h_q: int, d: int, dtype: str, run):
    kt = PAGE_SIZE

    @T.prim_func(s_tir=True, private=True)
    def ragged(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        var_kv_indptr: T.handle,
        var_q_rope_position: T.handle,
        var_k_rope_pos_offset: T.handle,
        var_output: T.handle,
        var_lse: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({ATTR: PREFILL, PAGED_ATTR: 0, "tirx.noalias": True})
        batch_size, qo_len, kv_all = T.int32(), T.int32(), T.int32()
        q_off, kv_off, qr_off, kr_off = T.int32(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(var_q, (qo_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_off)
        k = T.match_buffer(var_k, (kv_all, h_kv, d), dtype)
        v = T.match_buffer(var_v, (kv_all, h_kv, d), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_off)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32", elem_offset=qr_off)  # noqa: F841 (the signature the runtime calls)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=kr_off)  # noqa: F841 (the signature the runtime calls)
        output = T.match_buffer(var_output, (qo_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (qo_len, h_q), "float32")
        Kt = T.alloc_buffer((h_kv, (kv_all + kt - 1) // kt, d, kt), "float32")
        Vs = T.alloc_buffer((h_kv, (kv_all + kt - 1) // kt, kt, d), "float32")
        T.Assert(rotary_mode == 0, ROTATED)
        for b in T.serial(batch_size):
            with T.sblock("sequence"):
                T.reads(
                    q[0:qo_len, 0:h_q, 0:d],
                    q_indptr[0 : batch_size + 1],
                    k[0:kv_all, 0:h_kv, 0:d],
                    v[0:kv_all, 0:h_kv, 0:d],
                    kv_indptr[0 : batch_size + 1],
                )
                T.writes(output[0:qo_len, 0:h_q, 0:d], lse[0:qo_len, 0:h_q])
                q_start: T.let[T.int32] = q_indptr[b]
                q_len: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                kv_start: T.let[T.int32] = kv_indptr[b]
                kv_len: T.let[T.int32] = kv_indptr[b + 1] - kv_indptr[b]
                tiles: T.let[T.int32] = (kv_len + kt - 1) // kt
                for task in T.serial(h_kv * tiles):
                    for j, dd in T.grid(kt, d):
                        with T.sblock("kv_gather"):
                            vt = T.axis.spatial(h_kv * tiles, task)
                            vj, vd = T.axis.remap("SS", [j, dd])
                            Kt[vt // tiles, vt % tiles, vd, vj] = T.Cast(
                                "float32", k[kv_start + T.min((vt % tiles) * kt + vj, kv_len - 1), vt // tiles, vd]
                            )
                            Vs[vt // tiles, vt % tiles, vj, vd] = T.Cast(
                                "float32", v[kv_start + T.min((vt % tiles) * kt + vj, kv_len - 1), vt // tiles, vd]
                            )
                run(q, output, lse, Kt, Vs, q_start, q_len, kv_len, tiles, causal, sm_scale)

    return ragged


def _paged_prefill(h_kv: int, h_q: int, d: int, dtype: str, run):
    kt = PAGE_SIZE

    @T.prim_func(s_tir=True, private=True)
    def paged_form(
        var_q: T.handle,
        var_q_indptr: T.handle,
        var_pages: T.handle,
        var_page_indptr: T.handle,
        var_page_values: T.handle,
        var_length_info: T.handle,
        var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle,
        var_output: T.handle,
        var_lse: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({ATTR: PREFILL, PAGED_ATTR: 1, "tirx.noalias": True})
        batch_size, qo_len, nnz_pages, max_pages = T.int32(), T.int32(), T.int32(), T.int32()
        q_off, pi_off, pv_off, kr_off, qr_off, li_off = T.int32(), T.int32(), T.int32(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(var_q, (qo_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_off)
        pages = T.match_buffer(var_pages, (max_pages, 2, h_kv, kt, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=pi_off)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=pv_off)
        length_info = T.match_buffer(var_length_info, (batch_size,), "int32", elem_offset=li_off)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=kr_off)  # noqa: F841 (the signature the runtime calls)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32", elem_offset=qr_off)  # noqa: F841 (the signature the runtime calls)
        output = T.match_buffer(var_output, (qo_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (qo_len, h_q), "float32")
        Kt = T.alloc_buffer((h_kv, nnz_pages, d, kt), "float32")
        Vs = T.alloc_buffer((h_kv, nnz_pages, kt, d), "float32")
        T.Assert(rotary_mode == 0, ROTATED)
        for b in T.serial(batch_size):
            with T.sblock("sequence"):
                T.reads(
                    q[0:qo_len, 0:h_q, 0:d],
                    q_indptr[0 : batch_size + 1],
                    pages[0:max_pages, 0:2, 0:h_kv, 0:kt, 0:d],
                    page_indptr[0 : batch_size + 1],
                    page_values[0:nnz_pages],
                    length_info[0:batch_size],
                )
                T.writes(output[0:qo_len, 0:h_q, 0:d], lse[0:qo_len, 0:h_q])
                q_start: T.let[T.int32] = q_indptr[b]
                q_len: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                page_start: T.let[T.int32] = page_indptr[b]
                tiles: T.let[T.int32] = page_indptr[b + 1] - page_indptr[b]
                kv_len: T.let[T.int32] = T.if_then_else(tiles > 0, (tiles - 1) * kt + length_info[b], 0)
                for task in T.serial(h_kv * tiles):
                    for j, dd in T.grid(kt, d):
                        with T.sblock("kv_gather"):
                            vt = T.axis.spatial(h_kv * tiles, task)
                            vj, vd = T.axis.remap("SS", [j, dd])
                            Kt[vt // tiles, vt % tiles, vd, vj] = T.Cast(
                                "float32",
                                pages[
                                    page_values[page_start + vt % tiles],
                                    0,
                                    vt // tiles,
                                    T.min(vj, kv_len - 1 - (vt % tiles) * kt),
                                    vd,
                                ],
                            )
                            Vs[vt // tiles, vt % tiles, vj, vd] = T.Cast(
                                "float32",
                                pages[
                                    page_values[page_start + vt % tiles],
                                    1,
                                    vt // tiles,
                                    T.min(vj, kv_len - 1 - (vt % tiles) * kt),
                                    vd,
                                ],
                            )
                run(q, output, lse, Kt, Vs, q_start, q_len, kv_len, tiles, causal, sm_scale)

    return paged_form


def decode_kernel(h_kv: int, h_q: int, d: int, dtype: str, lanes: int = DECODE_LANES):
    """The decode kernel (module docstring): tasks (sequence, query head), keys read from the pages; each
    score a sum of `lanes` partial sums along head_dim (one vector per key, block ``score_partial``)."""
    group, kt = h_q // h_kv, PAGE_SIZE
    lanes = lanes if d % lanes == 0 else 1

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
        T.func_attr({ATTR: DECODE, "tirx.noalias": True})
        batch_size, nnz_pages, max_pages = T.int32(), T.int32(), T.int32()
        pi_off, pv_off, li_off, kr_off, qr_off = T.int32(), T.int32(), T.int32(), T.int32(), T.int32()
        q = T.match_buffer(var_q, (batch_size, h_q, d), dtype)
        pages = T.match_buffer(var_pages, (max_pages, 2, h_kv, kt, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=pi_off)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=pv_off)
        length_info = T.match_buffer(var_length_info, (batch_size,), "int32", elem_offset=li_off)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=kr_off)  # noqa: F841 (the signature the runtime calls)
        q_rope_position = T.match_buffer(var_q_rope_position, (batch_size,), "int32", elem_offset=qr_off)  # noqa: F841 (the signature the runtime calls)
        output = T.match_buffer(var_output, (batch_size, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (batch_size, h_q), "float32")
        T.Assert(rotary_mode == 0, ROTATED)
        for task in T.serial(batch_size * h_q):
            with T.sblock("head"):
                vt = T.axis.spatial(batch_size * h_q, task)
                T.reads(
                    q[vt // h_q, vt % h_q, 0:d],
                    pages[0:max_pages, 0:2, 0:h_kv, 0:kt, 0:d],
                    page_indptr[0 : batch_size + 1],
                    page_values[0:nnz_pages],
                    length_info[0:batch_size],
                )
                T.writes(output[vt // h_q, vt % h_q, 0:d], lse[vt // h_q, vt % h_q])
                Qs = T.sblock_alloc_buffer((d,), "float32")
                Sp = T.sblock_alloc_buffer((kt, lanes), "float32")  # per key, partial sums over head_dim
                S = T.sblock_alloc_buffer((kt,), "float32")
                Sm = T.sblock_alloc_buffer((kt,), "float32")
                P = T.sblock_alloc_buffer((kt,), "float32")
                O = T.sblock_alloc_buffer((d,), "float32")  # noqa: E741
                On = T.sblock_alloc_buffer((d,), "float32")
                M = T.sblock_alloc_buffer((1,), "float32")
                L = T.sblock_alloc_buffer((1,), "float32")
                Mn = T.sblock_alloc_buffer((1,), "float32")
                A = T.sblock_alloc_buffer((1,), "float32")
                b: T.let[T.int32] = vt // h_q
                h: T.let[T.int32] = vt % h_q
                g: T.let[T.int32] = h // group
                page_start: T.let[T.int32] = page_indptr[b]
                tiles: T.let[T.int32] = page_indptr[b + 1] - page_indptr[b]
                kv_len: T.let[T.int32] = T.if_then_else(tiles > 0, (tiles - 1) * kt + length_info[b], 0)
                for dd in T.serial(d):
                    with T.sblock("q_load"):
                        vd = T.axis.remap("S", [dd])
                        Qs[vd] = T.Cast("float32", q[b, h, vd]) * sm_scale
                with T.sblock("row_init"):
                    M[0] = T.float32(LOWEST)
                    L[0] = T.float32(0)
                for dd in T.serial(d):
                    with T.sblock("acc_zero"):
                        vd = T.axis.remap("S", [dd])
                        O[vd] = T.float32(0)
                for tile in T.serial(tiles):
                    with T.sblock("key_tile"):
                        vk = T.axis.spatial(nnz_pages, tile)
                        T.reads(
                            Qs[0:d], pages[0:max_pages, 0:2, g, 0:kt, 0:d], page_values[0:nnz_pages], M[0], L[0], O[0:d]
                        )
                        T.writes(
                            Sp[0:kt, 0:lanes], S[0:kt], Sm[0:kt], P[0:kt], M[0], L[0], Mn[0], A[0], O[0:d], On[0:d]
                        )
                        for j, do, lane in T.grid(kt, d // lanes, lanes):
                            with T.sblock("score_partial"):
                                vj, vo, vl = T.axis.remap("SRS", [j, do, lane])
                                with T.init():
                                    Sp[vj, vl] = T.float32(0)
                                Sp[vj, vl] = Sp[vj, vl] + Qs[vo * lanes + vl] * T.Cast(
                                    "float32",
                                    pages[
                                        page_values[page_start + vk],
                                        0,
                                        g,
                                        T.min(vj, kv_len - vk * kt - 1),
                                        vo * lanes + vl,
                                    ],
                                )
                        for j, lane in T.grid(kt, lanes):
                            with T.sblock("score"):
                                vj, vl = T.axis.remap("SR", [j, lane])
                                with T.init():
                                    S[vj] = T.float32(0)
                                S[vj] = S[vj] + Sp[vj, vl]
                        for j in T.serial(kt):
                            with T.sblock("mask"):
                                vj = T.axis.remap("S", [j])
                                Sm[vj] = T.Select(vk * kt + vj < kv_len, S[vj], T.float32(LOWEST))
                        for j in T.serial(kt):
                            with T.sblock("row_max"):
                                vj = T.axis.remap("R", [j])
                                with T.init():
                                    Mn[0] = M[0]
                                Mn[0] = T.max(Mn[0], Sm[vj])
                        for j in T.serial(kt):
                            with T.sblock("prob"):
                                vj = T.axis.remap("S", [j])
                                P[vj] = T.exp(Sm[vj] - Mn[0])
                        with T.sblock("rescale"):
                            A[0] = T.exp(M[0] - Mn[0])
                            M[0] = Mn[0]
                        for j in T.serial(kt):
                            with T.sblock("row_sum"):
                                vj = T.axis.remap("R", [j])
                                with T.init():
                                    L[0] = L[0] * A[0]
                                L[0] = L[0] + P[vj]
                        for dd, j in T.grid(d, kt):
                            with T.sblock("acc"):
                                vd, vj = T.axis.remap("SR", [dd, j])
                                with T.init():
                                    On[vd] = O[vd] * A[0]
                                On[vd] = On[vd] + P[vj] * T.Cast(
                                    "float32",
                                    pages[page_values[page_start + vk], 1, g, T.min(vj, kv_len - vk * kt - 1), vd],
                                )
                        for dd in T.serial(d):
                            with T.sblock("acc_store"):
                                vd = T.axis.remap("S", [dd])
                                O[vd] = On[vd]
                for dd in T.serial(d):
                    with T.sblock("output"):
                        vd = T.axis.remap("S", [dd])
                        output[b, h, vd] = T.Cast(dtype, O[vd] / L[0])
                with T.sblock("lse"):
                    lse[b, h] = (M[0] + T.log(L[0])) * T.float32(LOG2E)

    return decode


def merge_kernel(heads: int, d: int, dtype: str):
    """``(v, s, v_other, s_other)``: v, s (base-2 log-sum-exps) become the merge of both, in place."""

    @T.prim_func(s_tir=True, private=True)
    def merge(var_v: T.handle, var_s: T.handle, var_v_other: T.handle, var_s_other: T.handle):
        # in place (each block reads what it writes), which s_tir's parallel and vectorize refuse: written scheduled
        T.func_attr({ATTR: MERGE, "tirx.noalias": True, "tirx.is_scheduled": True})
        n = T.int32()
        v = T.match_buffer(var_v, (n, heads, d), dtype)
        s = T.match_buffer(var_s, (n, heads), "float32")
        v_other = T.match_buffer(var_v_other, (n, heads, d), dtype)
        s_other = T.match_buffer(var_s_other, (n, heads), "float32")
        for task in T.parallel(n * heads):
            with T.sblock("position"):
                vt = T.axis.spatial(n * heads, task)
                T.reads(
                    v[vt // heads, vt % heads, 0:d],
                    s[vt // heads, vt % heads],
                    v_other[vt // heads, vt % heads, 0:d],
                    s_other[vt // heads, vt % heads],
                )
                T.writes(v[vt // heads, vt % heads, 0:d], s[vt // heads, vt % heads])
                top: T.let[T.float32] = T.max(s[vt // heads, vt % heads], s_other[vt // heads, vt % heads])
                mine: T.let[T.float32] = T.exp2(s[vt // heads, vt % heads] - top)
                other: T.let[T.float32] = T.exp2(s_other[vt // heads, vt % heads] - top)
                for dd in T.vectorized(d):
                    with T.sblock("merge_values"):
                        vd = T.axis.remap("S", [dd])
                        v[vt // heads, vt % heads, vd] = T.Cast(
                            dtype,
                            (
                                T.Cast("float32", v[vt // heads, vt % heads, vd]) * mine
                                + T.Cast("float32", v_other[vt // heads, vt % heads, vd]) * other
                            )
                            / (mine + other),
                        )
                with T.sblock("merge_lse"):
                    s[vt // heads, vt % heads] = T.log2(mine + other) + top

    return merge
