"""PagedPrefillGridCuda: TVM's prefill attention kernels of each paged KV cache a cuda module creates, launched over
enough blocks to fill the GPU.

TVM's CUDA prefill kernels (``batch_prefill_ragged_kv``, the prompt's queries over its own keys, and
``batch_prefill_paged_kv``, over the cached pages) walk their (sequence, query tile) pairs with a fixed grid of 16
blocks per key/value head (``_kernel_common._get_prefill_kernel_config``'s ``NUM_BLKS``), whatever the GPU: a model
with 3 key/value heads (SmolLM2) runs its prefill attention on 48 blocks, each over several tiles in turn, and at
512 tokens that kernel is 87% of the prefill on an H200 (docs/results.md). This pass finds each create call
(`paged_kv_calls.py`: by the builtin's name and argument layout) whose keys are rotated before they are stored
(RopeMode NONE or NORMAL: the kernels' RoPE branch is not taken) and replaces both kernels, under their global
names, by TVM's same kernels made with ``NUM_BLKS = max(16, ceil(TARGET_BLOCKS / h_kv))``: their tile walk is a
grid-stride loop, so the arithmetic is unchanged; blocks past the last tile exit at once.

Runs in the cuda pipeline beside PagedDecodeCuda (`pipeline.fusion_passes`), before legalization: the kernels come
scheduled by TVM.
"""

from __future__ import annotations

import contextlib
import math

import tvm
from tvm.relax.frontend.nn.llm import _prefill_kernels

from .paged_kv_calls import NOT_HANDLED, PREFILL, RAGGED, cache_sizes, kernel_var, replace_kernels

TVM_BLOCKS = 16  # TVM's NUM_BLKS for cuda
TARGET_BLOCKS = 1024  # blocks aimed at over all key/value heads (one wave on an H200 at this kernel's occupancy)


def blocks_per_head(h_kv: int) -> int:
    """The prefill kernels' NUM_BLKS for `h_kv` key/value heads."""
    return max(TVM_BLOCKS, math.ceil(TARGET_BLOCKS / h_kv))


@contextlib.contextmanager
def _num_blocks(blocks: int):
    """TVM's prefill kernel builders with NUM_BLKS = `blocks` (the rest of their configuration as TVM chooses)."""
    config = _prefill_kernels._get_prefill_kernel_config

    def with_blocks(*args, **kwargs):
        return (blocks, *config(*args, **kwargs)[1:])

    _prefill_kernels._get_prefill_kernel_config = with_blocks
    try:
        yield
    finally:
        _prefill_kernels._get_prefill_kernel_config = config


def prefill_kernels(h_kv: int, h_q: int, d: int, dtype: str, target: tvm.target.Target, blocks: int) -> tuple:
    """(the ragged prefill kernel, the paged one) as ``TIRPagedKVCache`` makes them for cuda, over `blocks` blocks per
    key/value head."""
    with _num_blocks(blocks):
        ragged = _prefill_kernels._attention_prefill_ragged(h_kv, h_q, d, d, dtype, {}, target)
        paged = _prefill_kernels._attention_prefill(h_kv, h_q, d, dtype, False, {}, target)
    return ragged, paged


@tvm.transform.module_pass(opt_level=0, name="PagedPrefillGridCuda")
class PagedPrefillGridCuda:
    """Each paged KV cache's two prefill attention kernels over TARGET_BLOCKS blocks (see the module docstring)."""

    def __init__(self, target: tvm.target.Target):
        self.target = target

    def kernels_for(self, args: list) -> dict | str:
        sizes, ragged, paged = cache_sizes(args), kernel_var(args, RAGGED, 1), kernel_var(args, PREFILL, 1)
        if sizes is None or ragged is None or paged is None:
            return NOT_HANDLED
        blocks = blocks_per_head(sizes.h_kv)
        if blocks == TVM_BLOCKS:
            return f"{sizes.h_kv} key/value heads already fill {TARGET_BLOCKS} blocks"
        kernels = prefill_kernels(sizes.h_kv, sizes.h_q, sizes.d, sizes.dtype, self.target, blocks)
        return dict(zip((ragged, paged), kernels))

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return replace_kernels(mod, self.kernels_for)
