"""PagedDecodeCuda: relaxtune's split decode attention (kernels/paged_decode_cuda_tir.py) in place of TVM's in a
cuda module's paged KV cache; the kernel's launches and split counts. Its numerics against torch and TVM's kernel
run on a GPU: tests/kernels/test_gpu_paged_decode.py."""

from __future__ import annotations

import pytest
import tvm

from relaxtune.kernels import paged_decode_cuda_tir as K
from relaxtune.relax_passes.paged_decode_cuda import PagedDecodeCuda

CUDA = {"kind": "cuda", "arch": "sm_90", "host": {"kind": "llvm"}}


def test_pass_replaces_only_the_decode_attention(cuda_llama):
    mod = cuda_llama()
    out = PagedDecodeCuda()(mod)
    changed = [gv.name_hint for gv, f in out.functions_items() if not f.same_as(mod[gv])]
    assert changed == ["batch_decode_paged_kv"]
    gv = out.get_global_var("batch_decode_paged_kv")
    tvm.ir.assert_structural_equal(out[gv], K.decode_kernel(2, 4, 16, "float16"))
    assert set(mod.get_global_vars()) == set(out.get_global_vars())
    assert PagedDecodeCuda()(tvm.IRModule()).functions_items() == []


@pytest.mark.parametrize(
    "head_dim,heads,kv_heads",
    [(24, 4, 2), (16, 32, 2)],  # head_dim not a power of two; 16 query heads a key/value head
    ids=["head_dim", "group"],
)
def test_pass_keeps_tvms_kernel_where_it_does_not_apply(cuda_llama, head_dim, heads, kv_heads):
    mod = cuda_llama(head_dim, heads, kv_heads)
    assert all(f.same_as(mod[gv]) for gv, f in PagedDecodeCuda()(mod).functions_items())
    assert K.refusal(heads, kv_heads, head_dim) is not None
    assert K.refusal(4, 2, 16) is None


def test_pipeline_runs_it_on_cuda_only_and_as_asked():
    from relaxtune import targets
    from relaxtune.config import CompileConfig, FlashAttention
    from relaxtune.relax_passes.pipeline import fusion_passes

    def names(spec, options):
        return [type(p).__name__ for p in fusion_passes(targets.resolve(spec).target, {}, options)]

    assert names("cuda:sm_90", CompileConfig())[0] == "PagedDecodeCuda"
    assert "PagedDecodeCuda" not in names(
        "cuda:sm_90", CompileConfig(flash_attention=FlashAttention(paged_decode=False))
    )
    assert "PagedDecodeCuda" not in names("cpu", CompileConfig())


@pytest.mark.parametrize(
    "batch,h_kv,pages,want",
    [
        (1, 3, 64, 64),  # 1024 keys: a page a split
        (1, 3, 15, 1),  # under 16 pages a sequence: one launch
        (1, 3, 4096, K.MAX_SPLITS),
        (8, 8, 512, 16),  # 1024 blocks aimed at
        (64, 32, 4096, 1),
        (4, 2, 0, 1),
        (0, 2, 0, 1),  # no sequence: no division by zero
    ],
)
def test_split_count(batch, h_kv, pages, want):
    from tvm.sym import Analyzer

    got = Analyzer().simplify(K.splits(tvm.tirx.IntImm("int32", batch), h_kv, tvm.tirx.IntImm("int32", pages)))
    assert int(got) == want


@pytest.mark.parametrize("h_q,h_kv,d,rows", [(9, 3, 64, 16), (32, 8, 128, 8), (32, 32, 128, 8), (16, 2, 128, 4)])
def test_kernel_builds_for_cuda_as_two_launches(h_q, h_kv, d, rows):
    func = K.decode_kernel(h_kv, h_q, d, "float16").with_attr("global_symbol", "main")
    source = tvm.tirx.build(tvm.IRModule({"main": func}), target=tvm.target.Target(CUDA)).imports[0].inspect_source()
    bdx, _ = K.lanes(d)
    assert K.rows(h_q // h_kv, d) == rows
    assert f"__launch_bounds__({bdx * rows}) main_kernel(" in source
    assert f"__launch_bounds__({bdx * K.MERGE_ROWS}) main_kernel_1(" in source
    assert "__shfl_down_sync" in source  # each score a reduction over the row's lanes
