"""The fused attention kernel's compute definition: one TIR PrimFunc, no schedule.

``O = softmax(scale * Q Kᵀ + causal mask) V`` for ``Q (b, n, heads, d)``, ``K, V (b, m, kv_heads, d)``
and ``O (b, n, heads, d)``, with grouped-query heads (query head ``h`` reads key/value head
``h // (heads // kv_heads)``, as ``repeat_kv`` / ``R.repeat(axis=2)`` lays them out).

Queries are taken ``query_tile`` rows at a time and keys ``key_tile`` at a time, with an online
softmax over the key tiles (running max and sum per row; the partial output is rescaled when the
max grows). Each query tile is one block (``query_tile``) whose scratch lives inside it: its query
rows, one key tile of keys (transposed to ``(d, key)``), values, scores and probabilities, and the
running state. No ``n x m`` tensor exists. ``b``, ``n`` and ``m`` are symbolic.

Causal masks follow TVM's ``R.nn.attention`` legalisation: key ``j`` is visible to query ``i`` when
``j <= i + offset``, ``offset = 0`` (``TopLeft``) or ``|n - m|`` (``BottomRight``; with one query
against a longer key sequence, the decode step, that query sees every key). A key tile past the
diagonal of the whole query tile is skipped (the ``key_tile`` block's predicate); inside a tile
the mask is applied to the values, so the inner blocks have no predicates (affine bindings, which
``decompose_reduction`` and ``vectorize`` require).
Rows past ``n`` and keys past ``m`` are neither loaded nor used (values past ``m`` are zeros).

With ``key_mask`` the kernel takes a fifth input, the model's ``(b, m)`` padding mask (nonzero:
the key may be attended), and a key is visible when it is causal *and* unmasked; no ``n x m``
mask exists. A query row with no visible key (left padding) gives what the imported model gives
(``KEY_MASKS``): zeros (``"zero"``, torch SDPA's guard), or the mean of all ``m`` values
(``"uniform"``: masked keys enter with the float32 minimum, so such a row's softmax is uniform).
For ``"uniform"`` the block ``v_sum`` (in ``query_tile``, before the key tiles) sums the values
over all keys, and ``output`` uses that sum / ``m`` for those rows. Masked keys of other rows get
weight 0 in every variant (``exp(lowest - max)`` is 0 in float32 too), and tiles past the
diagonal are skipped as without a mask.
Accumulation is float32 for every input dtype.

With ``operands`` (``Operands``; FuseAttentionPrologue sets it) q, k and v are read where the
model computed them: each from a ``(b, seq, total heads, d)`` tensor (the merged projection's
output, viewed as heads) at a head offset, not from sliced copies; with ``rope`` q and k are also
rotated, rotate-half form ``x·cos + rot(x)·sin``, ``rot(x)[i] = -x[i + d/2]`` for ``i < d/2`` else
``x[i - d/2]``, from ``(rows >= n, d)`` cos and sin tables (inputs after v; position ``i`` reads row ``i``): q as its tile is loaded
(``q_tile``, loops (row, half, i)), k once per call by the block ``k_rope`` before the query tiles
into a ``(b, m, kv_heads, d)`` float32 scratch that ``k_tile`` reads (rotating it per query tile
instead cost 17% at n = 512). The signature is then ``(q, k, v, cos, sin, [mask], out)``.

Blocks (``BLOCKS``; schedules look them up by name): in ``query_tile``: ``q_tile``, ``row_init``,
``acc_zero``, then per key tile (``key_tile``) ``k_tile`` and ``v_tile`` (shared by the tile's
rows), and per query row ``score`` (Q·Kᵀ), ``tile_max``, ``rescale`` (``exp(old max - new max)``,
max updated), ``prob``, ``tile_sum``, ``acc`` (P·V; the partial output rescaled in its init), and
after the last key tile ``output``. Rows past ``n`` in the last query tile are skipped by an ``if``
(a decode step, n = 1, computes one row, not ``query_tile``). The CPU schedule is
``schedules/rules/cpu_attention.py``; a GPU schedule (threads over query rows / key tiles) can
reuse this definition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

QUERY_TILE = 32  # query rows sharing one key tile: its transposed keys and values are loaded once for all
# (measured, llama-block shapes, n = 128..1024: 10-15% faster than 16, 64 no better; key tile 64 no better than 32)
KEY_TILE = 32  # keys per online-softmax step
ATTR = "relaxtune.kernel"  # function attribute naming the kernel kind for the schedule rules
KIND = "fused_attention"
ARGS_ATTR = "relaxtune.attention_args"  # function attribute: the arguments that built the kernel (FuseAttentionPrologue)
KEY_MASK_ATTR = "relaxtune.key_mask"  # function attribute: the key_mask variant (absent without a mask)
BLOCKS_UNIFORM = ("v_sum",)  # only in the key_mask="uniform" variant
ROPE_ATTR = "relaxtune.rope"  # function attribute: q and k rotated on load (Operands.rope)
BLOCKS_ROPE = ("k_rope",)  # only with ROPE_ATTR: the keys rotated once, before the query tiles
BLOCKS = ("query_tile", "q_tile", "row_init", "acc_zero", "key_tile", "k_tile", "v_tile", "score", "tile_max", "rescale", "prob", "tile_sum", "acc", "output")
CAUSAL_MASKS = (None, "TopLeft", "BottomRight")
# key-padding mask variants, by what a query row with no visible key gives: None: no mask input;
# "zero": zeros (torch SDPA's guard); "uniform": the mean of all m values (an additive mask of the
# float32 minimum, as torch's eager attention builds it: every score of the row rounds to it)
KEY_MASKS = (None, "zero", "uniform")
_LOWEST = -3.4028234663852886e38  # the running max before any key: exp(_LOWEST - x) == 0


@dataclass(frozen=True)
class Operands:
    """Where the kernel reads q, k and v (module docstring): each from a tensor of ``*_heads`` heads
    starting at head ``*_offset``; ``rope``: q and k rotated (rotate-half) on load."""

    q_heads: int
    k_heads: int
    v_heads: int
    q_offset: int = 0
    k_offset: int = 0
    v_offset: int = 0
    rope: bool = False


def _plus(base, offset: int):
    return base if offset == 0 else base + tirx.const(offset, "int64")


def attention_kernel(heads: int, kv_heads: int, head_dim: int, dtype: str, causal_mask: str | None,
                     scale: float | None = None, query_tile: int = QUERY_TILE,
                     key_tile: int = KEY_TILE, key_mask: str | None = None, mask_dtype: str = "int64",
                     operands: Operands | None = None) -> tirx.PrimFunc:
    """The PrimFunc ``(q, k, v, out)``, or ``(q, k, v, mask, out)`` with a ``key_mask`` (``mask (b, m)``,
    nonzero: the key may be attended); ``scale`` defaults to ``1 / sqrt(head_dim)``. ``operands``:
    q, k, v read in place, q and k maybe rotated (module docstring; cos, sin follow v)."""
    if causal_mask not in CAUSAL_MASKS:
        raise ValueError(f"causal_mask {causal_mask!r} is not one of {CAUSAL_MASKS}")
    if key_mask not in KEY_MASKS:
        raise ValueError(f"key_mask {key_mask!r} is not one of {KEY_MASKS}")
    if heads % kv_heads:
        raise ValueError(f"heads {heads} is not a multiple of kv_heads {kv_heads}")
    group = heads // kv_heads
    scale = float(1.0 / math.sqrt(head_dim) if scale is None else scale)
    acc = "float32"
    qt, kt = query_tile, key_tile
    # int64 extents, like legalised kernels: SpecializePrimFuncBasedOnCallSite matches them to call sites
    ops = operands or Operands(heads, kv_heads, kv_heads)
    if ops.q_offset + heads > ops.q_heads or ops.k_offset + kv_heads > ops.k_heads or ops.v_offset + kv_heads > ops.v_heads:
        raise ValueError(f"operands {ops} do not hold {heads} query and {kv_heads} key/value heads")
    if ops.rope and head_dim % 2:
        raise ValueError(f"rotate-half needs an even head_dim, not {head_dim}")
    q_heads, k_heads, dim = (tirx.const(x, "int64") for x in (heads, kv_heads, head_dim))
    src_heads = [tirx.const(x, "int64") for x in (ops.q_heads, ops.k_heads, ops.v_heads)]
    half = head_dim // 2

    def rotated(x, table_cos, table_sin, bi, row, head, side, i):
        """Element ``side * d/2 + i`` of x[bi, row, head] rotated (rotate-half) with the tables, as float32."""
        d = side * half + i
        partner = T.Cast(acc, x[bi, row, head, (1 - side) * half + i])
        turned = T.if_then_else(side == 0, -partner, partner)
        return T.Cast(acc, x[bi, row, head, d]) * T.Cast(acc, table_cos[row, d]) + turned * T.Cast(acc, table_sin[row, d])

    def tile_reads(q, k, v, table_cos, table_sin, mask, vb, vh, n, m):
        # with rope, `k` is the rotated copy ``k_rot`` (heads from 0)
        k_head = vh // group if ops.rope else _plus(vh // group, ops.k_offset)
        reads = [q[vb, 0:n, _plus(vh, ops.q_offset), 0:head_dim], k[vb, 0:m, k_head, 0:head_dim],
                 v[vb, 0:m, _plus(vh // group, ops.v_offset), 0:head_dim]]
        if ops.rope:
            reads += [table_cos[0:n, 0:head_dim], table_sin[0:n, 0:head_dim]]
        return reads + ([] if key_mask is None else [mask[vb, 0:m]])

    def offset(n, m):
        if causal_mask == "BottomRight":
            return tirx.abs(n - m)
        return tirx.const(0, "int64")

    def causal(i, j, n, m):
        """Key ``j`` (< m) is inside the causal window of query ``i``."""
        if causal_mask is None:
            return j < m
        return tirx.all(j < m, j <= i + offset(n, m))

    def visible(mask, bi, i, j, n, m):
        """Key ``j`` (< m) is visible to query ``i`` of batch row ``bi``."""
        if key_mask is None:
            return causal(i, j, n, m)
        return tirx.all(causal(i, j, n, m), mask[bi, tirx.min(j, m - 1)] != tirx.const(0, mask_dtype))

    def finish(acc_value, total, fallback):
        """The output of a row: with a key mask, a row with no visible key (``total`` 0) gives
        `fallback` (zeros or the mean of all values, ``KEY_MASKS``), never 0 / 0."""
        if key_mask is None:
            return acc_value / total
        return T.if_then_else(total > T.float32(0), acc_value / total, fallback)

    @T.prim_func(private=True, s_tir=True)
    def fused_attention(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_cos: T.handle, var_sin: T.handle,
                        var_mask: T.handle, var_out: T.handle):
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
        if ops.rope:  # keys rotated once, not once per query tile
            k_rot = T.alloc_buffer((b, m, k_heads, dim), acc)
            for i0, j, h, side, i in T.grid(b, m, k_heads, 2, half):
                with T.sblock("k_rope"):
                    vb, vj, vh, vs, vi = T.axis.remap("SSSSS", [i0, j, h, side, i])
                    k_rot[vb, vj, vh, vs * half + vi] = rotated(k, table_cos, table_sin, vb, vj, _plus(vh, ops.k_offset), vs, vi)
        for i0, i1, i2 in T.grid(b, q_heads, (n + qt - 1) // qt):
            with T.sblock("query_tile"):
                vb, vh, vq = T.axis.remap("SSS", [i0, i1, i2])
                if ops.rope:
                    T.reads(tile_reads(q, k_rot, v, table_cos, table_sin, mask, vb, vh, n, m))
                else:
                    T.reads(tile_reads(q, k, v, table_cos, table_sin, mask, vb, vh, n, m))
                T.writes(out[vb, vq * qt:vq * qt + qt, vh, 0:head_dim])
                q_t = T.alloc_buffer((qt, head_dim), acc)
                run_max = T.alloc_buffer((qt,), acc)
                new_max = T.alloc_buffer((qt,), acc)
                alpha = T.alloc_buffer((qt,), acc)
                run_sum = T.alloc_buffer((qt,), acc)
                out_acc = T.alloc_buffer((qt, head_dim), acc)
                k_t = T.alloc_buffer((head_dim, kt), acc)
                v_t = T.alloc_buffer((kt, head_dim), acc)
                score = T.alloc_buffer((qt, kt), acc)
                prob = T.alloc_buffer((qt, kt), acc)
                if key_mask == "uniform":
                    v_sum = T.alloc_buffer((1, head_dim), acc)
                    for jj, dd in T.grid(m, head_dim):
                        with T.sblock("v_sum"):
                            vj, vd = T.axis.remap("RS", [jj, dd])
                            with T.init():
                                v_sum[0, vd] = T.float32(0)
                            v_sum[0, vd] = v_sum[0, vd] + T.Cast(acc, v[vb, vj, _plus(vh // group, ops.v_offset), vd])
                if ops.rope:
                    for ii, side, dd in T.grid(qt, 2, half):
                        with T.sblock("q_tile"):
                            vi, vs, vd = T.axis.remap("SSS", [ii, side, dd])
                            T.where(vq * qt + ii < n)
                            q_t[vi, vs * half + vd] = rotated(q, table_cos, table_sin, vb, T.min(vq * qt + vi, n - 1), _plus(vh, ops.q_offset), vs, vd)
                else:
                    for ii, dd in T.grid(qt, head_dim):
                        with T.sblock("q_tile"):
                            vi, vd = T.axis.remap("SS", [ii, dd])
                            T.where(vq * qt + ii < n)
                            q_t[vi, vd] = T.Cast(acc, q[vb, T.min(vq * qt + vi, n - 1), _plus(vh, ops.q_offset), vd])
                for ii in range(qt):
                    with T.sblock("row_init"):
                        vi = T.axis.remap("S", [ii])
                        T.where(vq * qt + ii < n)
                        run_max[vi] = T.float32(_LOWEST)
                        run_sum[vi] = T.float32(0)
                for ii, dd in T.grid(qt, head_dim):
                    with T.sblock("acc_zero"):
                        vi, vd = T.axis.remap("SS", [ii, dd])
                        T.where(vq * qt + ii < n)
                        out_acc[vi, vd] = T.float32(0)
                for t in range((m + kt - 1) // kt):
                    with T.sblock("key_tile"):
                        vt = T.axis.opaque((m + kt - 1) // kt, t)
                        T.where(causal(T.min(vq * qt + qt - 1, n - 1), t * kt, n, m))  # else: past the diagonal
                        for dd, jj in T.grid(head_dim, kt):
                            with T.sblock("k_tile"):
                                vd, vj = T.axis.remap("SS", [dd, jj])
                                T.where(vt * kt + jj < m)  # keys past m: their scores are masked, never read
                                if ops.rope:
                                    k_t[vd, vj] = k_rot[vb, vt * kt + vj, vh // group, vd]
                                else:
                                    k_t[vd, vj] = T.Cast(acc, k[vb, vt * kt + vj, _plus(vh // group, ops.k_offset), vd])
                        for jj, dd in T.grid(kt, head_dim):
                            with T.sblock("v_tile"):
                                vj, vd = T.axis.remap("SS", [jj, dd])
                                v_t[vj, vd] = T.if_then_else(
                                    vt * kt + vj < m, T.Cast(acc, v[vb, T.min(vt * kt + vj, m - 1), _plus(vh // group, ops.v_offset), vd]), T.float32(0)
                                )
                        for ii in range(qt):
                            if vq * qt + ii < n:  # rows past n (in the last query tile) do no work
                                for dd, jj in T.grid(head_dim, kt):
                                    with T.sblock("score"):
                                        vi, vd, vj = T.axis.remap("SRS", [ii, dd, jj])
                                        with T.init():
                                            score[vi, vj] = T.float32(0)
                                        score[vi, vj] = score[vi, vj] + q_t[vi, vd] * k_t[vd, vj]
                                for jj in range(kt):
                                    with T.sblock("tile_max"):
                                        vi, vj = T.axis.remap("SR", [ii, jj])
                                        with T.init():
                                            new_max[vi] = run_max[vi]
                                        new_max[vi] = T.max(new_max[vi], T.if_then_else(
                                            visible(mask, vb, vq * qt + vi, vt * kt + vj, n, m), score[vi, vj] * T.float32(scale), T.float32(_LOWEST)
                                        ))
                                with T.sblock("rescale"):
                                    vi = T.axis.remap("S", [ii])
                                    alpha[vi] = T.exp(run_max[vi] - new_max[vi])
                                    run_max[vi] = new_max[vi]
                                for jj in range(kt):
                                    with T.sblock("prob"):
                                        vi, vj = T.axis.remap("SS", [ii, jj])
                                        prob[vi, vj] = T.if_then_else(
                                            visible(mask, vb, vq * qt + vi, vt * kt + vj, n, m),
                                            T.exp(score[vi, vj] * T.float32(scale) - run_max[vi]),
                                            T.float32(0),
                                        )
                                for jj in range(kt):
                                    with T.sblock("tile_sum"):
                                        vi, vj = T.axis.remap("SR", [ii, jj])
                                        with T.init():
                                            run_sum[vi] = run_sum[vi] * alpha[vi]
                                        run_sum[vi] = run_sum[vi] + prob[vi, vj]
                                for jj, dd in T.grid(kt, head_dim):
                                    with T.sblock("acc"):
                                        vi, vj, vd = T.axis.remap("SRS", [ii, jj, dd])
                                        with T.init():
                                            out_acc[vi, vd] = out_acc[vi, vd] * alpha[vi]
                                        out_acc[vi, vd] = out_acc[vi, vd] + prob[vi, vj] * v_t[vj, vd]
                if key_mask == "uniform":  # rows with no visible key: the mean of all values
                    for ii, dd in T.grid(qt, head_dim):
                        with T.sblock("output"):
                            vi, vd = T.axis.remap("SS", [ii, dd])
                            T.where(vq * qt + ii < n)
                            out[vb, vq * qt + vi, vh, vd] = T.Cast(dtype, finish(out_acc[vi, vd], run_sum[vi], v_sum[0, vd] / T.Cast(acc, m)))
                else:
                    for ii, dd in T.grid(qt, head_dim):
                        with T.sblock("output"):
                            vi, vd = T.axis.remap("SS", [ii, dd])
                            T.where(vq * qt + ii < n)
                            out[vb, vq * qt + vi, vh, vd] = T.Cast(dtype, finish(out_acc[vi, vd], run_sum[vi], T.float32(0)))

    unused = ({3, 4} if not ops.rope else set()) | ({5} if key_mask is None else set())  # cos, sin; mask
    params = [p for i, p in enumerate(fused_attention.params) if i not in unused]
    kernel = tirx.PrimFunc(params, fused_attention.body, fused_attention.ret_type, fused_attention.attrs)
    kernel = kernel.with_attr(ARGS_ATTR, {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype, "scale": scale,
                                          "causal_mask": causal_mask or "none", "query_tile": qt, "key_tile": kt})
    if ops.rope:
        kernel = kernel.with_attr(ROPE_ATTR, True)
    return kernel if key_mask is None else kernel.with_attr(KEY_MASK_ATTR, key_mask)
