"""PagedPrefillFlashCuda: relaxtune's flash kernel named as a cuda paged KV cache's ragged prefill (an extern function
with TVM's kernel's arguments), where the head_dim and float type allow; off by default until a GPU has run it.
Its numerics on a GPU: tests/kernels/test_gpu_paged_prefill.py."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax

from relaxtune.kernels import flash_attention
from relaxtune.relax_passes.paged_kv_calls import RAGGED, create_calls
from relaxtune.relax_passes.paged_prefill_flash_cuda import PagedPrefillFlashCuda, refusal

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "host": {"kind": "llvm"}})


def _module(head_dim: int = 64, heads: int = 4, kv_heads: int = 2):
    from relaxtune.models.config import ModelConfig
    from relaxtune.models.llama import export

    config = ModelConfig("llama", 64, heads * head_dim, 64, 1, heads, kv_heads, head_dim, 1e4, 1e-5, 128, True)
    mod, _, _ = export(config, 16, target=CUDA, dtype="float16")
    return mod


def test_pass_names_the_flash_kernel_as_the_ragged_prefill():
    mod = _module()
    (before,) = create_calls(mod)
    (after,) = create_calls(PagedPrefillFlashCuda()(mod))
    backend, kernel = after[RAGGED].fields
    assert backend.value == "tirx" and isinstance(kernel, relax.ExternFunc)
    assert kernel.global_symbol == flash_attention.RAGGED_FUNCTION
    for i, (a, b) in enumerate(zip(before, after)):
        if i != RAGGED:
            tvm.ir.assert_structural_equal(a, b)


@pytest.mark.parametrize("head_dim", [16, 96])
def test_pass_keeps_tvms_kernel_for_head_dims_the_flash_kernel_lacks(head_dim):
    mod = _module(head_dim)
    (args,) = create_calls(mod)
    assert "head_dim" in refusal(args)
    assert all(f.same_as(mod[gv]) for gv, f in PagedPrefillFlashCuda()(mod).functions_items())


def test_pipeline_runs_it_on_cuda_by_default_and_not_when_turned_off():
    from relaxtune import targets
    from relaxtune.config import CompileConfig, FlashAttention
    from relaxtune.relax_passes.pipeline import fusion_passes

    def names(spec, options):
        return [type(p).__name__ for p in fusion_passes(targets.resolve(spec).target, {}, options)]

    off = CompileConfig(flash_attention=FlashAttention(paged_prefill=False))
    assert "PagedPrefillFlashCuda" in names("cuda:sm_90", CompileConfig())
    assert "PagedPrefillFlashCuda" in names("cuda:sm_80", CompileConfig())
    assert "PagedPrefillFlashCuda" not in names("cuda:sm_90", off)
    assert "PagedPrefillFlashCuda" not in names("cpu", CompileConfig())
