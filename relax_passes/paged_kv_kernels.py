"""PagedKVKernels: relaxtune's CPU kernels in place of the ones TVM's paged KV cache is created with.

`TIRPagedKVCache` (``relax.frontend.nn.llm.kv_cache``) on an llvm target passes TVM's CPU kernels to
``vm.builtin.paged_attention_kv_cache_create``: serial scalar loops, the prefill ones scanning the
whole page pool with a test per slot. This pass finds each such create call (`paged_kv_calls.py`: by the
builtin's name and its argument layout, never by a kernel's name), reads the cache's sizes from its
arguments (query / key-value heads, head_dim, dtype, RoPE base), and replaces, under the same global
names, the kernels the runtime calls for a model whose keys are rotated before they are stored
(RopeMode NONE or NORMAL): the ragged and paged prefill attention, the decode attention, the merge of
two partial results (`kernels/paged_prefill_tir.py`, `paged_decode_tir.py`, `paged_attention_tir.py`), the
split-and-rotate of q/k/v and the append of k/v into the pages (`kernels/paged_copy_tir.py`). The
sliding-window, tree and page-copy kernels stay TVM's.
A cache created with RopeMode INLINE (keys rotated inside attention) is left as it is.

Runs before legalization and scheduling (first in the CPU pipeline: `pipeline.fusion_passes`); the
rules `schedules/rules/cpu_paged_attention.py` and `cpu_paged_copy.py` schedule the new kernels.
"""

from __future__ import annotations

import tvm

from ..kernels.paged_attention_tir import PAGE_SIZE, merge_kernel
from ..kernels.paged_copy_tir import append_kernel, rope_kernel
from ..kernels.paged_decode_tir import decode_kernel
from ..kernels.paged_prefill_tir import prefill_kernel
from .paged_kv_calls import (
    APPEND,
    DECODE,
    MERGE,
    NOT_HANDLED,
    PREFILL,
    RAGGED,
    SPLIT_ROTARY,
    cache_sizes,
    kernel_var,
    replace_kernels,
)


def kernels_for(args: list) -> dict | str:
    """{GlobalVar: relaxtune's kernel} for one create call's arguments, or why the call is not one this pass
    handles."""
    sizes = cache_sizes(args)
    if sizes is None:
        return NOT_HANDLED
    h_q, h_kv, d, dtype = sizes.h_q, sizes.h_kv, sizes.d, sizes.dtype
    wanted = {
        (RAGGED, 1): prefill_kernel(h_kv, h_q, d, dtype, paged=False),
        (PREFILL, 1): prefill_kernel(h_kv, h_q, d, dtype, paged=True),
        (DECODE, 1): decode_kernel(h_kv, h_q, d, dtype),
        (MERGE, 0): merge_kernel(h_q, d, dtype),
        (SPLIT_ROTARY, None): rope_kernel(h_q, h_kv, d, dtype, sizes.rope_theta),
        (APPEND, None): append_kernel(h_kv, d, dtype, PAGE_SIZE),
    }
    out = {}
    for (position, field), kernel in wanted.items():
        gv = kernel_var(args, position, field)
        if gv is None:
            return NOT_HANDLED
        out[gv] = kernel
    return out


@tvm.transform.module_pass(opt_level=0, name="PagedKVKernels")
class PagedKVKernels:
    """Replace the CPU kernels of each paged KV cache the module creates (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return replace_kernels(mod, kernels_for)
