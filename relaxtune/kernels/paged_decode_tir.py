"""The decode kernel of relaxtune's CPU attention for TVM's paged KV cache: `decode_kernel`, TVM's
``batch_decode_paged_kv_cpu`` (one new token per sequence attending to its cached positions, itself
included). `paged_attention_tir.py` states its signature and what it computes; a compute definition, TIR
with blocks, no schedule (the rule `schedules/rules/cpu_paged_attention.py` schedules it by its block
names; the pass `paged_kv_kernels.py` puts it in place of TVM's).

Work is split into independent tasks (sequence, query head; block ``head``) for a parallel loop. A task
reads its keys and values in place from the pages, a page (`PAGE_SIZE` keys) per online-softmax step
(block ``key_tile``): each score a dot product along head_dim, in `DECODE_LANES` partial sums
(``score_partial``, then ``score``), then ``mask``, ``row_max``, ``prob``, ``rescale``, ``row_sum``,
``acc``, ``acc_store``, and after the last page ``output``, ``lse``. A task's buffers stay under 1 KiB,
so TVM keeps them on the stack.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .paged_attention_tir import ATTR, DECODE, LOG2E, LOWEST, PAGE_SIZE, ROTATED

DECODE_LANES = 8  # partial sums per decode score: 16 keys x 8 float32 stay under TVM's 1 KiB stack limit


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
