"""PagedDecodeCuda: relaxtune's decode attention in place of TVM's in each paged KV cache a cuda module creates.

TVM's CUDA decode kernel (``batch_decode_paged_kv``, passed to ``vm.builtin.paged_attention_kv_cache_create``)
runs one block per (sequence, key/value head) over all of a sequence's keys; relaxtune's
(`kernels/paged_decode_cuda_tir.py`) splits the keys across blocks, then merges the splits. This pass finds each
create call (`paged_kv_calls.py`: by the builtin's name and argument layout, never by a kernel's name) whose keys
are rotated before they are stored (RopeMode NONE or NORMAL) and whose sizes the kernel takes (`refusal`: head_dim
a power of two from 8 to 256, at most 8 query heads a key/value head), and replaces the plain decode kernel under
its global name; the prefill, sliding-window, tree, merge and copy kernels stay TVM's.

Runs first in the cuda pipeline (`pipeline.fusion_passes`), before legalization: the kernel comes scheduled
(thread bindings written in), so the default GPU schedule and the rules leave it as it is.
"""

from __future__ import annotations

import tvm

from ..kernels.paged_decode_cuda_tir import decode_kernel, refusal
from .paged_kv_calls import DECODE, NOT_HANDLED, cache_sizes, kernel_var, replace_kernels


def kernels_for(args: list) -> dict | str:
    """{the decode attention's GlobalVar: relaxtune's kernel} for one create call's arguments, or why that cache
    keeps TVM's."""
    sizes, gv = cache_sizes(args), kernel_var(args, DECODE, 1)
    if sizes is None or gv is None:
        return NOT_HANDLED
    why = refusal(sizes.h_q, sizes.h_kv, sizes.d)
    return why if why is not None else {gv: decode_kernel(sizes.h_kv, sizes.h_q, sizes.d, sizes.dtype)}


@tvm.transform.module_pass(opt_level=0, name="PagedDecodeCuda")
class PagedDecodeCuda:
    """Replace the decode attention of each paged KV cache the module creates (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return replace_kernels(mod, kernels_for)
