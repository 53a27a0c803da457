"""The prefill kernels of relaxtune's CPU attention for TVM's paged KV cache: `prefill_kernel`, with
`paged` False TVM's ``batch_prefill_ragged_kv`` (the new tokens of each sequence attending to themselves),
with `paged` True ``batch_prefill_paged_kv_cpu`` (the new tokens attending to a sequence's cached
positions). `paged_attention_tir.py` states their signatures and what they compute; compute definitions,
TIR with blocks, no schedule (the rule `schedules/rules/cpu_paged_attention.py` schedules them by the block
names below; the pass `paged_kv_kernels.py` puts them in place of TVM's).

Work is split per sequence (batch loop, serial) into independent tasks for parallel loops. A
prefill kernel first gathers each tile of `PAGE_SIZE` keys of a sequence (block ``kv_gather``, tasks
(kv head, tile)): keys transposed into contiguous (head_dim, tile) tiles, so a row's 16 scores are one
vector of sums over head_dim, and values as (tile, head_dim) rows; keys past the sequence's length
repeat its last key (never uninitialised memory; they are masked). Then the tasks are (query head,
tile of `QUERY_TILE` rows) (block ``query_tile``), whose rows go `ROW_GROUP` at a time (block
``row_group``): per key tile ``score``, ``mask``, ``row_max``, ``prob``, ``rescale``, ``row_sum``,
``acc`` (the running output rescaled, then P·V), ``acc_store``, and after the last tile ``output``,
``lse``. The gather is the only difference between the two prefill forms. A row group's buffers stay
under 1 KiB, so TVM keeps them on the stack.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .paged_attention_tir import ATTR, LOG2E, LOWEST, PAGE_SIZE, PAGED_ATTR, PREFILL, ROTATED

QUERY_TILE = 32  # query rows per prefill task
ROW_GROUP = 4  # rows sharing each key tile and value row: independent accumulation chains


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
