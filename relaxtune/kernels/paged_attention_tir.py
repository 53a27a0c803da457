"""The contract of relaxtune's CPU attention kernels for TVM's paged KV cache, their shared names and
constants, and the merge kernel. The kernels are compute definitions: TIR with blocks, no schedule (the
rule `schedules/rules/cpu_paged_attention.py` schedules them; the pass `paged_kv_kernels.py` puts them in
place of TVM's). The prefill kernels are in `paged_prefill_tir.py`, the decode kernel in `paged_decode_tir.py`;
they, `paged_copy_tir.py` and the schedule rules take `ATTR` and the kinds from here.

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
- `merge_kernel` (here): ``(v, s, v_other, s_other)``, two partial results merged into the first in place
  by their log-sum-exps (``merge_state_inplace_cpu``); written scheduled (parallel over positions,
  vectorized along head_dim): s_tir refuses both primitives on blocks that update in place.

What they compute: ``softmax(sm_scale q kᵀ + mask) v`` per query head, key/value head ``h // (h_q / h_kv)``,
with an online softmax over tiles of `PAGE_SIZE` keys (a page of the cache), and ``lse`` the base-2
log-sum-exp of the scaled scores, as TVM's kernels give it (the merge reads it). ``causal``: query row
i of a sequence of ``q_len`` new tokens sees key j when ``j < kv_len - q_len + i + 1``. Keys are read
rotated: the cache's split kernel rotated them before they were stored (RopeMode.NORMAL), so
``rotary_mode`` must be 0 (a kernel asserts it, with the message `ROTATED`).

Work is split into independent tasks for parallel loops (the prefill's per sequence, the decode's per
sequence and query head: their files). Buffers of a row group or a decode task stay under 1 KiB, so TVM
keeps them on the stack.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

ATTR = "relaxtune.kernel"  # the kind of kernel, for the schedule rule (never a name)
PREFILL, DECODE, MERGE = "paged_prefill", "paged_decode", "attention_merge"
PAGED_ATTR = "relaxtune.paged"  # prefill kernels: 1 when keys come from the cache's pages
PAGE_SIZE = 16  # the tokens of a page of TVM's CPU paged KV cache (its kernels are built for 16)
LOG2E = math.log2(math.e)
LOWEST = -3.4028234663852886e38  # a masked score: exp(LOWEST - m) == 0 for any finite m
ROTATED = "relaxtune's CPU attention kernels read keys rotated before they were stored (RopeMode.NORMAL)"


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
