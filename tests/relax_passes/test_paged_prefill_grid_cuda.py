"""PagedPrefillGridCuda: TVM's prefill kernels of a cuda module's paged KV cache made again over ~1024 blocks; the
builder gives TVM's own kernels at TVM's 16 blocks, so only the grid differs. Their outputs against TVM's kernels,
bit for bit, and against torch run on a GPU: tests/kernels/test_gpu_paged_prefill.py."""

from __future__ import annotations

import re

import pytest
import tvm

from relaxtune.relax_passes.paged_kv_calls import PREFILL, RAGGED, create_calls, kernel_var
from relaxtune.relax_passes.paged_prefill_grid_cuda import (
    TVM_BLOCKS,
    PagedPrefillGridCuda,
    blocks_per_head,
    prefill_kernels,
)

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "host": {"kind": "llvm"}})


def _grid(func) -> tuple[list[str], list[str]]:
    """The kernel's blockIdx.x extents and the strides of its tile walk."""
    text = func.script()
    return re.findall(r'thread_binding\((\d+), thread="blockIdx.x"\)', text), re.findall(
        r"tile_id\[0\] = tile_id\[0\] \+ (\d+)", text
    )


def test_the_builder_at_16_blocks_is_tvms_kernels(cuda_llama):
    mod = cuda_llama()
    args = create_calls(mod)[0]
    ragged, paged = prefill_kernels(2, 4, 16, "float16", CUDA, TVM_BLOCKS)
    tvm.ir.assert_structural_equal(mod[kernel_var(args, RAGGED, 1)], ragged)
    tvm.ir.assert_structural_equal(mod[kernel_var(args, PREFILL, 1)], paged)
    assert _grid(ragged) == (["16"], ["16"]) and _grid(paged) == (["16"], ["16"])


def test_pass_regrids_only_the_two_prefill_kernels(cuda_llama):
    mod = cuda_llama()
    out = PagedPrefillGridCuda(CUDA)(mod)
    changed = sorted(gv.name_hint for gv, f in out.functions_items() if not f.same_as(mod[gv]))
    assert changed == ["batch_prefill_paged_kv", "batch_prefill_ragged_kv"]
    assert set(mod.get_global_vars()) == set(out.get_global_vars())
    for name in changed:
        assert _grid(out[out.get_global_var(name)]) == (["512"], ["512"])  # 1024 blocks over 2 key/value heads
    assert PagedPrefillGridCuda(CUDA)(tvm.IRModule()).functions_items() == []


@pytest.mark.parametrize("h_kv,blocks", [(1, 1024), (2, 512), (3, 342), (8, 128), (32, 32), (64, 16), (128, 16)])
def test_blocks_per_head_fill_1024_blocks_and_never_fewer_than_tvms(h_kv, blocks):
    assert blocks_per_head(h_kv) == blocks


def test_regridded_kernels_build_for_sm_90():
    for func in prefill_kernels(3, 9, 64, "float16", CUDA, blocks_per_head(3)):
        ex = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=CUDA)
        assert 'extern "C" __global__' in ex.imports[0].inspect_source()


def test_pipeline_runs_it_on_cuda_only_and_as_asked(chosen_passes):
    from relaxtune import targets
    from relaxtune.config import CompileConfig, FlashAttention

    cuda, cpu = targets.resolve("cuda:sm_90").target, targets.resolve("cpu").target
    off = CompileConfig(flash_attention=FlashAttention(paged_prefill_grid=False))
    assert len(chosen_passes(cuda, CompileConfig(), "PagedPrefillGridCuda")) == 1
    assert chosen_passes(cuda, off, "PagedPrefillGridCuda") == []
    assert chosen_passes(cpu, CompileConfig(), "PagedPrefillGridCuda") == []
