"""Compute definitions of relaxtune's CPU kernels that move each new token's data through TVM's paged KV
cache (`paged_kv_kernels.py` puts them in place of TVM's; `schedules/rules/cpu_paged_copy.py` schedules
them): `rope_kernel` splits the merged q/k/v and rotates q and k (the cache's ``f_split_rotary``),
`append_kernel` writes k and v into their pages (``f_transpose_append``).

`rope_kernel`'s signature (what the runtime calls): ``(qkv (n, h_q + 2 h_kv, d), position_map (n,) int32,
q (n, h_q, d), k (n, h_kv, d), v (n, h_kv, d), apply_rope: int64)``. With ``apply_rope`` > 0, q and k are rotated in
the rotate-half form of transformers' Llama: feature ``i < d/2`` is ``x_i cos - x_{i + d/2} sin`` and
feature ``i + d/2`` is ``x_{i + d/2} cos + x_i sin``, with angle ``position * theta^(-2i/d)`` computed in
float32 as transformers does (inverse frequencies by ``pow``, then one multiply). TVM's kernel computes
``pow``, ``cos`` and ``sin`` for every element of every head; here each position's d/2 cosines and sines
are computed once (block ``angle``, into stack arrays) and every q and k head reads them (blocks
``rotate_q``, ``rotate_k``: loops (head, side, i) over the two halves, branch-free), v copied
(``copy_v``); each position is one block (``position``).

`append_kernel`'s signature: ``(pages (num_pages, 2, h_kv, page, d), k (n, h_kv, d), v (n, h_kv, d),
position_map (n,) int32)``: token i goes to slot ``position_map[i]`` (page ``slot // page``, row
``slot % page``), none where it is -1 (block ``append``: loops (token, head, head_dim), k and v).
"""

from __future__ import annotations

from tvm.script import tirx as T

from .paged_attention_tir import ATTR

ROPE = "paged_rope"
APPEND = "paged_append"


def rope_kernel(h_q: int, h_kv: int, d: int, dtype: str, theta: float):
    """The split-and-rotate kernel (module docstring) for base frequency `theta`."""
    half, heads = d // 2, h_q + 2 * h_kv

    @T.prim_func(s_tir=True, private=True)
    def rope(
        var_qkv: T.handle,
        var_position_map: T.handle,
        var_q: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        apply_rope: T.int64,
    ):
        T.func_attr({ATTR: ROPE, "tirx.noalias": True})
        n, pm_off = T.int32(), T.int32()
        qkv = T.match_buffer(var_qkv, (n, heads, d), dtype)
        position_map = T.match_buffer(var_position_map, (n,), "int32", elem_offset=pm_off)
        q = T.match_buffer(var_q, (n, h_q, d), dtype)
        k = T.match_buffer(var_k, (n, h_kv, d), dtype)
        v = T.match_buffer(var_v, (n, h_kv, d), dtype)
        for s in T.serial(n):
            with T.sblock("position"):
                vs = T.axis.spatial(n, s)
                T.reads(qkv[vs, 0:heads, 0:d], position_map[vs])
                T.writes(q[vs, 0:h_q, 0:d], k[vs, 0:h_kv, 0:d], v[vs, 0:h_kv, 0:d])
                cos = T.sblock_alloc_buffer((half,), "float32")
                sin = T.sblock_alloc_buffer((half,), "float32")
                for i in T.serial(half):
                    with T.sblock("angle"):
                        vi = T.axis.remap("S", [i])
                        angle: T.let[T.float32] = T.Cast("float32", position_map[vs]) * (
                            T.float32(1) / T.pow(T.float32(theta), T.Cast("float32", vi * 2) / T.float32(d))
                        )
                        cos[vi] = T.if_then_else(apply_rope > 0, T.cos(angle), T.float32(1))
                        sin[vi] = T.if_then_else(apply_rope > 0, T.sin(angle), T.float32(0))
                for h, side, i in T.grid(h_q, 2, half):
                    with T.sblock("rotate_q"):
                        vh, vside, vi = T.axis.remap("SSS", [h, side, i])
                        q[vs, vh, vside * half + vi] = T.Cast(
                            dtype,
                            T.Cast("float32", qkv[vs, vh, vside * half + vi]) * cos[vi]
                            + T.Cast("float32", vside * 2 - 1)
                            * T.Cast("float32", qkv[vs, vh, (1 - vside) * half + vi])
                            * sin[vi],
                        )
                for h, side, i in T.grid(h_kv, 2, half):
                    with T.sblock("rotate_k"):
                        vh, vside, vi = T.axis.remap("SSS", [h, side, i])
                        k[vs, vh, vside * half + vi] = T.Cast(
                            dtype,
                            T.Cast("float32", qkv[vs, h_q + vh, vside * half + vi]) * cos[vi]
                            + T.Cast("float32", vside * 2 - 1)
                            * T.Cast("float32", qkv[vs, h_q + vh, (1 - vside) * half + vi])
                            * sin[vi],
                        )
                for h, dd in T.grid(h_kv, d):
                    with T.sblock("copy_v"):
                        vh, vd = T.axis.remap("SS", [h, dd])
                        v[vs, vh, vd] = qkv[vs, h_q + h_kv + vh, vd]

    return rope


def append_kernel(h_kv: int, d: int, dtype: str, page_size: int):
    """The append kernel (module docstring)."""

    @T.prim_func(s_tir=True, private=True)
    def append(var_pages: T.handle, var_k: T.handle, var_v: T.handle, var_position_map: T.handle):
        T.func_attr({ATTR: APPEND, "tirx.noalias": True})
        n, num_pages, pages_off, pm_off = T.int64(), T.int64(), T.int64(), T.int32()
        pages = T.match_buffer(var_pages, (num_pages, 2, h_kv, page_size, d), dtype, elem_offset=pages_off)
        k = T.match_buffer(var_k, (n, h_kv, d), dtype)
        v = T.match_buffer(var_v, (n, h_kv, d), dtype)
        position_map = T.match_buffer(var_position_map, (n,), "int32", elem_offset=pm_off)
        for s, h, dd in T.grid(n, h_kv, d):
            with T.sblock("append"):
                vs, vh, vd = T.axis.remap("SSS", [s, h, dd])
                T.where(position_map[s] != -1)
                T.reads(k[vs, vh, vd], v[vs, vh, vd], position_map[vs])
                T.writes(pages[0:num_pages, 0:2, vh, 0:page_size, vd])
                pages[position_map[vs] // page_size, 0, vh, position_map[vs] % page_size, vd] = k[vs, vh, vd]
                pages[position_map[vs] // page_size, 1, vh, position_map[vs] % page_size, vd] = v[vs, vh, vd]

    return append
