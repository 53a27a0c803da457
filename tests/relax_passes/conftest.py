"""Fixtures of the pass tests: a language model exported for cuda, its paged KV cache made with TVM's kernels."""

from __future__ import annotations

import pytest

CUDA = {"kind": "cuda", "arch": "sm_90", "host": {"kind": "llvm"}}


@pytest.fixture(scope="session")
def cuda_llama():
    """`cuda_llama(head_dim=16, heads=4, kv_heads=2, dtype="float16")`: a one-layer llama exported for cuda (sm_90),
    its paged KV cache created with TVM's CUDA kernels."""
    import tvm

    from relaxtune.models.config import ModelConfig
    from relaxtune.models.llama import export

    def make(head_dim: int = 16, heads: int = 4, kv_heads: int = 2, dtype: str = "float16"):
        config = ModelConfig("llama", 64, heads * head_dim, 64, 1, heads, kv_heads, head_dim, 1e4, 1e-5, 128, True)
        mod, _, _ = export(config, 16, target=tvm.target.Target(CUDA), dtype=dtype)
        return mod

    return make
