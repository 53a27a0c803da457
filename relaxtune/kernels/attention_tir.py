"""The fused attention kernel's compute definition: `attention_kernel`, one TIR PrimFunc, no schedule.
FuseAttention and FuseAttentionPrologue build it; the CPU schedule is `schedules/rules/cpu_attention.py`, and a
GPU schedule (threads over query rows / key tiles) can reuse this definition. Its attributes, block names and
default tiles: `attention_spec.py`; where it reads q, k, v: `attention_operands.py`; which keys a query sees:
`attention_masks.py`; the kernel built again with other tiles: `attention_retile.py`.

``O = softmax(scale * Q Kᵀ + causal mask) V`` for ``Q (b, n, heads, d)``, ``K, V (b, m, kv_heads, d)``
and ``O (b, n, heads, d)``, with grouped-query heads (query head ``h`` reads key/value head
``h // (heads // kv_heads)``, as ``repeat_kv`` / ``R.repeat(axis=2)`` lays them out).

Queries are taken ``query_tile`` rows at a time and keys ``key_tile`` at a time, with an online
softmax over the key tiles (running max and sum per row; the partial output is rescaled when the
max grows). The keys are transposed once per call (block ``k_transpose``, before the query tiles)
into a float32 scratch of one contiguous ``(d, key_tile)`` tile per key tile, zeros past ``m``
(loops (batch, kv head, key tile, key, d): each key's row is read along ``d``).
Each query tile is one block (``query_tile``) whose scratch lives inside it: its query rows (zeros
past ``n``) and the running state; values are read in place. Inside a key tile the rows are taken
``ROW_GROUP`` at a time (block ``row_group``), whose scores, probabilities and P·V sums (``head_dim``
in parts, block ``pv_part``) are small arrays of its own: under 1 KiB each, so TVM puts them on the
stack and LLVM keeps them in registers, as the schedule accumulates each key vector / value vector
into every row of the group. No ``n x m`` tensor exists. ``b``, ``n`` and ``m`` are symbolic.

A key tile past the diagonal of the whole query tile is skipped (the ``key_tile`` block's predicate); inside a
tile the mask is applied to the values, so the inner blocks have no predicates (affine bindings, which
``decompose_reduction`` and ``vectorize`` require); with a key mask as without one.
Rows past ``n`` and keys past ``m`` are never loaded: their q rows and keys are zeros, so a row
group that straddles ``n`` computes finite values for its extra rows, which are never written; P·V
reads the value row ``min(key, m - 1)``, which a key past ``m`` multiplies by its probability 0.
Only row groups below ``n`` load their q rows and initialise their state (``q_tile``, ``row_init``,
``acc_zero`` have a row group loop and its predicate): a decode step touches 1 group, not 8.
With the key mask ``"uniform"`` the block ``v_sum`` (in ``query_tile``, before the key tiles) sums the values
over all keys, and ``output`` uses that sum / ``m`` for rows with no visible key.
Accumulation is float32 for every input dtype.

With ``operands`` q, k and v are read in place; with ``rope`` q is rotated as its tile is loaded (``q_tile``,
loops (row group, row, half, i)) and k once per call as ``k_transpose`` transposes it (loops (batch, head, key
tile, key, half, i); rotating it per query tile instead cost 17% at n = 512), with the cos and sin tables
(inputs after v): the signature is then ``(q, k, v, cos, sin, [mask], out)``.
"""

from __future__ import annotations

import math
from functools import partial

from tvm import tirx
from tvm.script import tirx as T

from .attention_masks import Masks
from .attention_operands import OPERAND_FIELDS, Operands, plus, rotated
from .attention_spec import ARGS_ATTR, ATTR, KEY_MASK_ATTR, KEY_TILE, KIND, QUERY_TILE, ROPE_ATTR, ROW_GROUP

_LOWEST = -3.4028234663852886e38  # the running max before any key: exp(_LOWEST - x) == 0


def attention_kernel(
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    causal_mask: str | None,
    scale: float | None = None,
    query_tile: int = QUERY_TILE,
    key_tile: int = KEY_TILE,
    key_mask: str | None = None,
    mask_dtype: str = "int64",
    operands: Operands | None = None,
) -> tirx.PrimFunc:
    """The PrimFunc ``(q, k, v, out)``, or ``(q, k, v, mask, out)`` with a ``key_mask`` (``mask (b, m)``,
    nonzero: the key may be attended); ``scale`` defaults to ``1 / sqrt(head_dim)``. ``operands``:
    q, k, v read in place, q and k maybe rotated (module docstring; cos, sin follow v)."""
    masks = Masks(causal_mask, key_mask, mask_dtype)  # checks both variants
    if heads % kv_heads:
        raise ValueError(f"heads {heads} is not a multiple of kv_heads {kv_heads}")
    group = heads // kv_heads
    scale = float(1.0 / math.sqrt(head_dim) if scale is None else scale)
    acc = "float32"
    # a row group's arrays (rows x key_tile scores, rows x dp P·V sums, float32) must stay under 1 KiB, TVM's
    # limit for a stack array (larger ones are heap workspaces, which LLVM cannot keep in registers)
    qt, kt, rg = query_tile, key_tile, ROW_GROUP
    while rg > 1 and rg * kt * 4 >= 1024:
        rg //= 2
    dp = max(d for d in range(1, head_dim + 1) if head_dim % d == 0 and rg * d * 4 < 1024)  # head_dim per P·V part
    if qt % rg:
        raise ValueError(f"query_tile {qt} is not a multiple of the row group {rg}")
    # int64 extents, like legalised kernels: SpecializePrimFuncBasedOnCallSite matches them to call sites
    ops = operands or Operands(heads, kv_heads, kv_heads)
    ops.check(heads, kv_heads, head_dim)
    q_heads, k_heads, dim = (tirx.const(x, "int64") for x in (heads, kv_heads, head_dim))
    src_heads = [tirx.const(x, "int64") for x in (ops.q_heads, ops.k_heads, ops.v_heads)]
    half = head_dim // 2
    rotate = partial(rotated, half=half)  # an element of q or k rotated with the tables

    def tile_reads(q, k_trans, v, table_cos, table_sin, mask, vb, vh, n, m):
        reads = [
            q[vb, 0:n, plus(vh, ops.q_offset), 0:head_dim],
            k_trans[vb, vh // group, 0 : (m + kt - 1) // kt, 0:head_dim, 0:kt],
            v[vb, 0:m, plus(vh // group, ops.v_offset), 0:head_dim],
        ]
        if ops.rope:
            reads += [table_cos[0:n, 0:head_dim], table_sin[0:n, 0:head_dim]]
        return reads + ([] if key_mask is None else [mask[vb, 0:m]])

    def group_reads(q_t, k_trans, v, run_max, run_sum, out_acc, mask, vb, vh, vt, vg, m):
        rows = slice(vg * rg, vg * rg + rg)
        reads = [
            q_t[rows, 0:head_dim],
            k_trans[vb, vh // group, vt, 0:head_dim, 0:kt],
            v[vb, 0:m, plus(vh // group, ops.v_offset), 0:head_dim],
            run_max[rows],
            run_sum[rows],
            out_acc[rows, 0:head_dim],
        ]
        return reads + ([] if key_mask is None else [mask[vb, 0:m]])

    def group_writes(new_max, alpha, run_max, run_sum, out_acc, vg):
        rows = slice(vg * rg, vg * rg + rg)
        return [new_max[rows], alpha[rows], run_max[rows], run_sum[rows], out_acc[rows, 0:head_dim]]

    def part_reads(prob, v, out_acc, alpha, vb, vh, vg, vp, m):
        rows, cols = slice(vg * rg, vg * rg + rg), slice(vp * dp, vp * dp + dp)
        return [prob[0:rg, 0:kt], v[vb, 0:m, plus(vh // group, ops.v_offset), cols], out_acc[rows, cols], alpha[rows]]

    def part_writes(out_acc, vg, vp):
        return [out_acc[vg * rg : vg * rg + rg, vp * dp : vp * dp + dp]]

    @T.prim_func(private=True, s_tir=True)
    def fused_attention(
        var_q: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        var_cos: T.handle,
        var_sin: T.handle,
        var_mask: T.handle,
        var_out: T.handle,
    ):
        T.func_attr({"tirx.noalias": True, ATTR: KIND})
        b, n, m = T.int64(), T.int64(), T.int64()
        q = T.match_buffer(var_q, (b, n, src_heads[0], dim), dtype)
        k = T.match_buffer(var_k, (b, m, src_heads[1], dim), dtype)
        v = T.match_buffer(var_v, (b, m, src_heads[2], dim), dtype)
        rows = T.int64()  # rope only: the tables' rows (>= n; position i reads row i, key j < m = n row j)
        table_cos = T.match_buffer(var_cos, (rows, dim), dtype)
        table_sin = T.match_buffer(var_sin, (rows, dim), dtype)
        mask = T.match_buffer(var_mask, (b, m), mask_dtype)
        out = T.match_buffer(var_out, (b, n, q_heads, dim), dtype)
        # the keys transposed (and rotated) once per call, one contiguous (d, key) tile per key tile (rows of a
        # tile a whole key row apart alias in L1), keys past m zeros
        k_trans = T.alloc_buffer((b, k_heads, (m + kt - 1) // kt, dim, kt), acc)
        if ops.rope:
            for i0, h, t, jj, side, i in T.grid(b, k_heads, (m + kt - 1) // kt, kt, 2, half):
                with T.sblock("k_transpose"):
                    vb, vh, vt, vj, vs, vi = T.axis.remap("SSSSSS", [i0, h, t, jj, side, i])
                    k_trans[vb, vh, vt, vs * half + vi, vj] = T.if_then_else(
                        vt * kt + vj < m,
                        rotate(k, table_cos, table_sin, vb, T.min(vt * kt + vj, m - 1), plus(vh, ops.k_offset), vs, vi),
                        T.float32(0),
                    )
        else:
            for i0, h, t, jj, dd in T.grid(b, k_heads, (m + kt - 1) // kt, kt, head_dim):
                with T.sblock("k_transpose"):
                    vb, vh, vt, vj, vd = T.axis.remap("SSSSS", [i0, h, t, jj, dd])
                    k_trans[vb, vh, vt, vd, vj] = T.if_then_else(
                        vt * kt + vj < m,
                        T.Cast(acc, k[vb, T.min(vt * kt + vj, m - 1), plus(vh, ops.k_offset), vd]),
                        T.float32(0),
                    )
        for i0, i1, i2 in T.grid(b, q_heads, (n + qt - 1) // qt):
            with T.sblock("query_tile"):
                vb, vh, vq = T.axis.remap("SSS", [i0, i1, i2])
                T.reads(tile_reads(q, k_trans, v, table_cos, table_sin, mask, vb, vh, n, m))
                T.writes(out[vb, vq * qt : vq * qt + qt, vh, 0:head_dim])
                q_t = T.alloc_buffer((qt, head_dim), acc)
                run_max = T.alloc_buffer((qt,), acc)
                new_max = T.alloc_buffer((qt,), acc)
                alpha = T.alloc_buffer((qt,), acc)
                run_sum = T.alloc_buffer((qt,), acc)
                out_acc = T.alloc_buffer((qt, head_dim), acc)
                if key_mask == "uniform":
                    v_sum = T.alloc_buffer((1, head_dim), acc)
                    for jj, dd in T.grid(m, head_dim):
                        with T.sblock("v_sum"):
                            vj, vd = T.axis.remap("RS", [jj, dd])
                            with T.init():
                                v_sum[0, vd] = T.float32(0)
                            v_sum[0, vd] = v_sum[0, vd] + T.Cast(acc, v[vb, vj, plus(vh // group, ops.v_offset), vd])
                if ops.rope:
                    for g, r, side, dd in T.grid(qt // rg, rg, 2, half):
                        with T.sblock("q_tile"):
                            vg, vr, vs, vd = T.axis.remap("SSSS", [g, r, side, dd])
                            T.where(vq * qt + g * rg < n)
                            q_t[vg * rg + vr, vs * half + vd] = T.if_then_else(
                                vq * qt + vg * rg + vr < n,
                                rotate(
                                    q,
                                    table_cos,
                                    table_sin,
                                    vb,
                                    T.min(vq * qt + vg * rg + vr, n - 1),
                                    plus(vh, ops.q_offset),
                                    vs,
                                    vd,
                                ),
                                T.float32(0),
                            )
                else:
                    for g, r, dd in T.grid(qt // rg, rg, head_dim):
                        with T.sblock("q_tile"):
                            vg, vr, vd = T.axis.remap("SSS", [g, r, dd])
                            T.where(vq * qt + g * rg < n)
                            q_t[vg * rg + vr, vd] = T.if_then_else(
                                vq * qt + vg * rg + vr < n,
                                T.Cast(acc, q[vb, T.min(vq * qt + vg * rg + vr, n - 1), plus(vh, ops.q_offset), vd]),
                                T.float32(0),
                            )
                for g, r in T.grid(qt // rg, rg):
                    with T.sblock("row_init"):
                        vg, vr = T.axis.remap("SS", [g, r])
                        T.where(vq * qt + g * rg < n)
                        run_max[vg * rg + vr] = T.float32(_LOWEST)
                        run_sum[vg * rg + vr] = T.float32(0)
                for g, r, dd in T.grid(qt // rg, rg, head_dim):
                    with T.sblock("acc_zero"):
                        vg, vr, vd = T.axis.remap("SSS", [g, r, dd])
                        T.where(vq * qt + g * rg < n)
                        out_acc[vg * rg + vr, vd] = T.float32(0)
                for t in range((m + kt - 1) // kt):
                    with T.sblock("key_tile"):
                        vt = T.axis.opaque((m + kt - 1) // kt, t)
                        T.where(masks.causal(T.min(vq * qt + qt - 1, n - 1), t * kt, n, m))  # else: past the diagonal
                        for g in range(qt // rg):
                            with T.sblock("row_group"):  # groups past n (in the last query tile) do no work
                                vg = T.axis.opaque(qt // rg, g)
                                T.where(vq * qt + g * rg < n)
                                T.reads(
                                    group_reads(q_t, k_trans, v, run_max, run_sum, out_acc, mask, vb, vh, vt, vg, m)
                                )
                                T.writes(group_writes(new_max, alpha, run_max, run_sum, out_acc, vg))
                                # the group's scores and probabilities: stack arrays (the schedule keeps the scores in
                                # registers)
                                score = T.alloc_buffer((rg, kt), acc)
                                prob = T.alloc_buffer((rg, kt), acc)
                                for ri, dd, jj in T.grid(rg, head_dim, kt):
                                    with T.sblock("score"):
                                        vr, vd, vj = T.axis.remap("SRS", [ri, dd, jj])
                                        with T.init():
                                            score[vr, vj] = T.float32(0)
                                        score[vr, vj] = (
                                            score[vr, vj] + q_t[vg * rg + vr, vd] * k_trans[vb, vh // group, vt, vd, vj]
                                        )
                                for ri, jj in T.grid(rg, kt):
                                    with T.sblock("tile_max"):
                                        vr, vj = T.axis.remap("SR", [ri, jj])
                                        with T.init():
                                            new_max[vg * rg + vr] = run_max[vg * rg + vr]
                                        new_max[vg * rg + vr] = T.max(
                                            new_max[vg * rg + vr],
                                            T.if_then_else(
                                                masks.visible(mask, vb, vq * qt + vg * rg + vr, vt * kt + vj, n, m),
                                                score[vr, vj] * T.float32(scale),
                                                T.float32(_LOWEST),
                                            ),
                                        )
                                for ri in range(rg):
                                    with T.sblock("rescale"):
                                        vr = T.axis.remap("S", [ri])
                                        alpha[vg * rg + vr] = T.exp(run_max[vg * rg + vr] - new_max[vg * rg + vr])
                                        run_max[vg * rg + vr] = new_max[vg * rg + vr]
                                for ri, jj in T.grid(rg, kt):
                                    with T.sblock("prob"):
                                        vr, vj = T.axis.remap("SS", [ri, jj])
                                        prob[vr, vj] = T.if_then_else(
                                            masks.visible(mask, vb, vq * qt + vg * rg + vr, vt * kt + vj, n, m),
                                            T.exp(score[vr, vj] * T.float32(scale) - run_max[vg * rg + vr]),
                                            T.float32(0),
                                        )
                                for ri, jj in T.grid(rg, kt):
                                    with T.sblock("tile_sum"):
                                        vr, vj = T.axis.remap("SR", [ri, jj])
                                        with T.init():
                                            run_sum[vg * rg + vr] = run_sum[vg * rg + vr] * alpha[vg * rg + vr]
                                        run_sum[vg * rg + vr] = run_sum[vg * rg + vr] + prob[vr, vj]
                                for part in range(head_dim // dp):
                                    with T.sblock("pv_part"):  # head_dim in parts: rg x dp sums under 1 KiB
                                        vp = T.axis.opaque(head_dim // dp, part)
                                        T.reads(part_reads(prob, v, out_acc, alpha, vb, vh, vg, vp, m))
                                        T.writes(part_writes(out_acc, vg, vp))
                                        pv = T.alloc_buffer((rg, dp), acc)
                                        for ri, jj, dd in T.grid(rg, kt, dp):
                                            with T.sblock("acc"):
                                                vr, vj, vd = T.axis.remap("SRS", [ri, jj, dd])
                                                with T.init():
                                                    pv[vr, vd] = (
                                                        out_acc[vg * rg + vr, vp * dp + vd] * alpha[vg * rg + vr]
                                                    )
                                                pv[vr, vd] = pv[vr, vd] + prob[vr, vj] * T.Cast(
                                                    acc,
                                                    v[
                                                        vb,
                                                        T.min(vt * kt + vj, m - 1),
                                                        plus(vh // group, ops.v_offset),
                                                        vp * dp + vd,
                                                    ],
                                                )
                                        for ri, dd in T.grid(rg, dp):
                                            with T.sblock("acc_store"):
                                                vr, vd = T.axis.remap("SS", [ri, dd])
                                                out_acc[vg * rg + vr, vp * dp + vd] = pv[vr, vd]
                if key_mask == "uniform":  # rows with no visible key: the mean of all values
                    for ii, dd in T.grid(qt, head_dim):
                        with T.sblock("output"):
                            vi, vd = T.axis.remap("SS", [ii, dd])
                            T.where(vq * qt + ii < n)
                            out[vb, vq * qt + vi, vh, vd] = T.Cast(
                                dtype, masks.finish(out_acc[vi, vd], run_sum[vi], v_sum[0, vd] / T.Cast(acc, m))
                            )
                else:
                    for ii, dd in T.grid(qt, head_dim):
                        with T.sblock("output"):
                            vi, vd = T.axis.remap("SS", [ii, dd])
                            T.where(vq * qt + ii < n)
                            out[vb, vq * qt + vi, vh, vd] = T.Cast(
                                dtype, masks.finish(out_acc[vi, vd], run_sum[vi], T.float32(0))
                            )

    unused = ({3, 4} if not ops.rope else set()) | ({5} if key_mask is None else set())  # cos, sin; mask
    params = [p for i, p in enumerate(fused_attention.params) if i not in unused]
    kernel = tirx.PrimFunc(params, fused_attention.body, fused_attention.ret_type, fused_attention.attrs)
    kernel = kernel.with_attr(
        ARGS_ATTR,
        {
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "dtype": dtype,
            "scale": scale,
            "causal_mask": causal_mask or "none",
            "query_tile": qt,
            "key_tile": kt,
            **({} if key_mask is None else {"key_mask": key_mask, "mask_dtype": mask_dtype}),
            **({} if operands is None else {"operands": [getattr(ops, f) for f in OPERAND_FIELDS]}),
        },
    )
    if ops.rope:
        kernel = kernel.with_attr(ROPE_ATTR, True)
    return kernel if key_mask is None else kernel.with_attr(KEY_MASK_ATTR, key_mask)
