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

from tvm import tirx
from tvm.script import tirx as T

QUERY_TILE = 32  # query rows sharing one key tile: its transposed keys and values are loaded once for all
# (measured, llama-block shapes, n = 128..1024: 10-15% faster than 16, 64 no better; key tile 64 no better than 32)
KEY_TILE = 32  # keys per online-softmax step
ATTR = "relaxtune.kernel"  # function attribute naming the kernel kind for the schedule rules
KIND = "fused_attention"
KEY_MASK_ATTR = "relaxtune.key_mask"  # function attribute: the key_mask variant (absent without a mask)
BLOCKS_UNIFORM = ("v_sum",)  # only in the key_mask="uniform" variant
BLOCKS = ("query_tile", "q_tile", "row_init", "acc_zero", "key_tile", "k_tile", "v_tile", "score", "tile_max", "rescale", "prob", "tile_sum", "acc", "output")
CAUSAL_MASKS = (None, "TopLeft", "BottomRight")
# key-padding mask variants, by what a query row with no visible key gives: None: no mask input;
# "zero": zeros (torch SDPA's guard); "uniform": the mean of all m values (an additive mask of the
# float32 minimum, as torch's eager attention builds it: every score of the row rounds to it)
KEY_MASKS = (None, "zero", "uniform")
_LOWEST = -3.4028234663852886e38  # the running max before any key: exp(_LOWEST - x) == 0


def attention_kernel(heads: int, kv_heads: int, head_dim: int, dtype: str, causal_mask: str | None,
                     scale: float | None = None, query_tile: int = QUERY_TILE,
                     key_tile: int = KEY_TILE, key_mask: str | None = None, mask_dtype: str = "int64") -> tirx.PrimFunc:
    """The PrimFunc ``(q, k, v, out)``, or ``(q, k, v, mask, out)`` with a ``key_mask`` (``mask (b, m)``,
    nonzero: the key may be attended); ``scale`` defaults to ``1 / sqrt(head_dim)``."""
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
    q_heads, k_heads, dim = (tirx.const(x, "int64") for x in (heads, kv_heads, head_dim))

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
    def fused_attention(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_mask: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True, ATTR: KIND})
        b, n, m = T.int64(), T.int64(), T.int64()
        q = T.match_buffer(var_q, (b, n, q_heads, dim), dtype)
        k = T.match_buffer(var_k, (b, m, k_heads, dim), dtype)
        v = T.match_buffer(var_v, (b, m, k_heads, dim), dtype)
        mask = T.match_buffer(var_mask, (b, m), mask_dtype)
        out = T.match_buffer(var_out, (b, n, q_heads, dim), dtype)
        for i0, i1, i2 in T.grid(b, q_heads, (n + qt - 1) // qt):
            with T.sblock("query_tile"):
                vb, vh, vq = T.axis.remap("SSS", [i0, i1, i2])
                if key_mask is None:
                    T.reads(q[vb, 0:n, vh, 0:head_dim], k[vb, 0:m, vh // group, 0:head_dim], v[vb, 0:m, vh // group, 0:head_dim])
                else:
                    T.reads(q[vb, 0:n, vh, 0:head_dim], k[vb, 0:m, vh // group, 0:head_dim], v[vb, 0:m, vh // group, 0:head_dim], mask[vb, 0:m])
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
                            v_sum[0, vd] = v_sum[0, vd] + T.Cast(acc, v[vb, vj, vh // group, vd])
                for ii, dd in T.grid(qt, head_dim):
                    with T.sblock("q_tile"):
                        vi, vd = T.axis.remap("SS", [ii, dd])
                        T.where(vq * qt + ii < n)
                        q_t[vi, vd] = T.Cast(acc, q[vb, T.min(vq * qt + vi, n - 1), vh, vd])
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
                                k_t[vd, vj] = T.Cast(acc, k[vb, vt * kt + vj, vh // group, vd])
                        for jj, dd in T.grid(kt, head_dim):
                            with T.sblock("v_tile"):
                                vj, vd = T.axis.remap("SS", [jj, dd])
                                v_t[vj, vd] = T.if_then_else(
                                    vt * kt + vj < m, T.Cast(acc, v[vb, T.min(vt * kt + vj, m - 1), vh // group, vd]), T.float32(0)
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

    if key_mask is None:  # the mask parameter is unused: drop it
        params = [p for i, p in enumerate(fused_attention.params) if i != 3]
        return tirx.PrimFunc(params, fused_attention.body, fused_attention.ret_type, fused_attention.attrs)
    return fused_attention.with_attr(KEY_MASK_ATTR, key_mask)
