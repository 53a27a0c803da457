"""MergeProjections on a CUDA build (relax_passes/pipeline.py fusion_passes on a cuda target): q/k/v and
gate/up become one cuBLAS GEMM each; the q/k and gate/up slices fuse into their element-wise
readers (rotary embedding, silu * up), v's slice is a copy kernel of its own (read by attention)
or fuses into the repeat of grouped-query attention."""

from __future__ import annotations

import re

import pytest
import tvm
from tvm import relax

from relaxtune import api, targets
from relaxtune.config import CompileConfig, CudaLibraries, JobConfig
from relaxtune.relax_passes.pipeline import fusion_passes
from relaxtune.workloads import load, parse_config


def _fused(fusion: str, kv_heads: int) -> tuple[str, tvm.IRModule]:
    config = parse_config(f"hidden=64,heads=4,kv_heads={kv_heads},ffn=128,max_seq=128,max_batch=1")
    workload = load("llama-block", config, "float16")
    target = targets.resolve("cuda")
    plan = api.bucket_plan(workload, JobConfig(compile=CompileConfig(use_cache=False)))
    with target.target:
        options = CompileConfig(
            fusion=fusion, cublas=CudaLibraries(gemv=False, weights_nk=False), flash_attention=False
        )
        mod = tvm.transform.Sequential(fusion_passes(target.target, plan, options))(workload.mod)
    (gv,) = [gv for gv in mod.get_global_vars() if gv.name_hint.startswith("main_n65_128")]
    return mod[gv].script(), mod


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_gpu_build_merges_qkv_and_gate_up_into_one_cublas_gemm_each(kv_heads):
    body, mod = _fused("relaxtune", kv_heads)
    gemms = re.findall(r'"relaxtune_cublas_gemm(?:_add)?", \((\w+), (\w+)[,)]', body)
    assert len(gemms) == 4, gemms  # qkv, o, gate/up, down (o and down with the residual add: relaxtune_cublas_gemm_add)
    assert body.count('"relaxtune_cublas_gemm_add"') == 2
    widths = sorted(
        int(w)
        for w in re.findall(
            r'"relaxtune_cublas_gemm", \(\w+, merged_weight\d*\), out_ty=R.Tensor\(\(1, n, (\d+)\)', body
        )
    )
    assert widths == [64 + 2 * 16 * kv_heads, 256], widths  # q + k + v heads x 16; gate + up
    kernels = re.findall(r"R.call_tir\((?:cls\.)?(\w+),", body)
    assert [k for k in kernels if "silu" in k] and all("strided_slice" in k for k in kernels if "silu" in k), (
        "the halves fuse into silu * up"
    )
    rope = [k for k in kernels if "concatenate" in k and "multiply" in k]
    assert len(rope) == 2 and all(k.startswith("fused_strided_slice") for k in rope), (
        "q and k slices fuse into the rotary kernels"
    )
    v_slice = [k for k in kernels if "strided_slice" in k and k not in rope and "silu" not in k]
    # v's slice: a copy kernel of its own (mha), or inside the repeat to every query head (gqa)
    assert v_slice in (["strided_slice2"], ["fused_strided_slice2_repeat"]), kernels
    assert "FuseSwiGLU" not in str(mod.get_attr("relaxtune") or "") and not any(
        "swiglu" in gv.name_hint for gv in mod.get_global_vars()
    )


def test_stock_fusion_on_gpu_keeps_seven_gemms():
    body, _mod = _fused("stock", 4)
    assert len(re.findall(r'"relaxtune_cublas_gemm(?:_add)?"', body)) == 7
    assert "merged_weight" not in body


def test_merged_weights_are_concatenated_at_load_time():
    _body, mod = _fused("relaxtune", 4)
    transform = mod["main_transform_params"]
    assert isinstance(transform, relax.Function) and "concat" in transform.script()  # legalized by then
