"""FuseAttentionGemvCuda (relax_passes/fuse_attention_gemv_cuda.py), without a GPU.

The rewrite is checked structurally, where it must not fire, numerically on the CPU (the kernels' contract in numpy,
registered under their names, run by the VM before and after the pass) and in the fp16 llama-block's cuda build (the
n = 1 bucket's kernels). The kernel itself: test_gemv_cuda.py (nvcc) and tests/kernels/test_gpu_kernels.py (against
torch on a GPU).
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from relaxtune.config import CompileConfig, CudaLibraries
from relaxtune.kernels import flash_attention, gemv
from relaxtune.relax_passes.fuse_attention_gemv_cuda import FuseAttentionGemvCuda


def _block(rows: int = 1, flash: str = "relaxtune_flash_attention_rope_qk"):
    """A decode bucket after RewriteAttentionToFlash and RewriteGemvToCuda: 2 query heads and 1 kv head of 64 read in
    place from the merged (1, rows, 4, 64) projection, then o_proj + residual."""

    @I.ir_module
    class Module:
        @R.function(private=True)
        def main_n1(
            qkv: R.Tensor((1, rows, 4, 64), "float16"),
            cos: R.Tensor((rows, 64), "float16"),
            sin: R.Tensor((rows, 64), "float16"),
            w: R.Tensor((32, 128), "float16"),
            res: R.Tensor((1, rows, 32), "float16"),
        ) -> R.Tensor((1, rows, 32), "float16"):
            with R.dataflow():
                o = R.call_dps_packed(
                    flash,
                    (qkv, qkv, qkv, cos, sin, R.shape([0, 2, 3, 1]), 1, T.float64(0.125), 0),
                    out_ty=R.Tensor((1, rows, 2, 64), "float16"),
                )
                r = R.reshape(o, R.shape([1, rows, 128]))
                y = R.call_dps_packed("relaxtune_gemv_nk_add", (r, w, res), out_ty=R.Tensor((1, rows, 32), "float16"))
                R.output(y)
            return y

    return Module


@I.ir_module
class ReadTwice:  # the attention's output feeds two products: it stays a kernel
    @R.function(private=True)
    def main_n1(
        qkv: R.Tensor((1, 1, 4, 64), "float16"),
        cos: R.Tensor((1, 64), "float16"),
        sin: R.Tensor((1, 64), "float16"),
        w: R.Tensor((32, 128), "float16"),
        res: R.Tensor((1, 1, 32), "float16"),
    ) -> R.Tensor((1, 1, 32), "float16"):
        with R.dataflow():
            o = R.call_dps_packed(
                "relaxtune_flash_attention_rope_qk",
                (qkv, qkv, qkv, cos, sin, R.shape([0, 2, 3, 1]), 1, T.float64(0.125), 0),
                out_ty=R.Tensor((1, 1, 2, 64), "float16"),
            )
            r = R.reshape(o, R.shape([1, 1, 128]))
            y = R.call_dps_packed("relaxtune_gemv_nk_add", (r, w, res), out_ty=R.Tensor((1, 1, 32), "float16"))
            r2 = R.reshape(o, R.shape([1, 1, 128]))
            y2 = R.call_dps_packed("relaxtune_gemv_nk_add", (r2, w, y), out_ty=R.Tensor((1, 1, 32), "float16"))
            R.output(y2)
        return y2


@I.ir_module
class Expected:
    @R.function(private=True)
    def main_n1(
        qkv: R.Tensor((1, 1, 4, 64), "float16"),
        cos: R.Tensor((1, 64), "float16"),
        sin: R.Tensor((1, 64), "float16"),
        w: R.Tensor((32, 128), "float16"),
        res: R.Tensor((1, 1, 32), "float16"),
    ) -> R.Tensor((1, 1, 32), "float16"):
        with R.dataflow():
            y = R.call_dps_packed(
                "relaxtune_gemv_nk_attn_add",
                (qkv, qkv, qkv, cos, sin, R.shape([0, 2, 3, 1]), 1, T.float64(0.125), 2, w, res),
                out_ty=R.Tensor((1, 1, 32), "float16"),
            )
            R.output(y)
        return y


def test_the_attention_moves_into_o_proj():
    tvm.ir.assert_structural_equal(FuseAttentionGemvCuda()(_block()), Expected)
    rope_q = FuseAttentionGemvCuda()(_block(flash=flash_attention.ROPE_FUNCTION))["main_n1"].script()
    assert "relaxtune_gemv_nk_attn_add" in rope_q and "T.float64(0.125), 1, w, res" in rope_q, rope_q  # k pre-rotated


def test_does_not_fire_on_three_rows_a_shared_output_or_the_plain_flash_call():
    for module in (_block(rows=3), ReadTwice, _block(flash=flash_attention.IN_PLACE_FUNCTION)):
        tvm.ir.assert_structural_equal(FuseAttentionGemvCuda()(module), module)


# ---- the kernels' contract in numpy, run by the VM before and after the pass
def _f32(t):
    return t.numpy().astype(np.float32)


def _rotate(t, cos, sin):  # rotate-half of (1, rows, heads, D), fp32, one rounding
    half = t.shape[-1] // 2
    rotated = np.concatenate([-t[..., half:], t[..., :half]], axis=-1)
    return (t * cos[None, :, None] + rotated * sin[None, :, None]).astype(np.float16).astype(np.float32)


def _attention(qkv, cos, sin, heads, causal, scale, rope):
    q0, k0, v0, kv = (int(h) for h in heads)
    d, rows = qkv.shape[-1], qkv.shape[1]
    q = _rotate(qkv[:, :, q0 : q0 + 2 * kv], cos, sin)  # 2 query heads per kv head in these modules
    k = _rotate(qkv[:, :, k0 : k0 + kv], cos, sin) if rope == 2 else qkv[:, :, k0 : k0 + kv]
    v = qkv[:, :, v0 : v0 + kv]
    k, v = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    if causal:
        s = np.where(np.tril(np.ones((rows, rows), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("bhij,bjhd->bihd", p / p.sum(-1, keepdims=True), v)
    return o.astype(np.float16).astype(np.float32).reshape(1, rows, -1)[..., : q.shape[2] * d]


def _store(y, value):
    y.copyfrom(value.astype(y.numpy().dtype))


CONTRACT = {
    flash_attention.ROPE_QK_FUNCTION: lambda q, k, v, c, s, h, causal, scale, _bm, o: _store(
        o, _attention(_f32(q), _f32(c), _f32(s), h, causal, scale, 2).reshape(o.shape)
    ),
    gemv.NK_ADD_FUNCTION: lambda x, w, r, y: _store(y, _f32(x) @ _f32(w).T + _f32(r)),
    gemv.NK_ATTN_ADD_FUNCTION: lambda q, k, v, c, s, h, causal, scale, rope, w, r, y: _store(
        y, _attention(_f32(q), _f32(c), _f32(s), h, causal, scale, rope) @ _f32(w).T + _f32(r)
    ),
}


@pytest.mark.parametrize("rows", [1, 2])
def test_the_fused_call_computes_what_the_two_did(numpy_externs, run_on_cpu, rows):
    numpy_externs(CONTRACT)
    rng = np.random.default_rng(rows)
    angles = np.arange(rows)[:, None] * rng.random((1, 32))
    args = [
        rng.standard_normal((1, rows, 4, 64)).astype(np.float16),
        np.cos(np.concatenate([angles, angles], -1)).astype(np.float16),
        np.sin(np.concatenate([angles, angles], -1)).astype(np.float16),
        (rng.standard_normal((32, 128)) / 11).astype(np.float16),
        rng.standard_normal((1, rows, 32)).astype(np.float16),
    ]
    module = _block(rows)
    before, after = (run_on_cpu(m, args, "main_n1") for m in (module, FuseAttentionGemvCuda()(module)))
    assert np.isfinite(after).all() and np.abs(after - args[4]).max() > 0.1
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-2)


# ---- in the pipeline: the fp16 llama-block's n = 1 bucket on cuda
def test_llama_block_decode_bucket_has_no_flash_kernel(decode_bucket_calls):
    config = "hidden=256,heads=4,kv_heads=2,ffn=128,max_seq=64,max_batch=1"
    fused, plain = (decode_bucket_calls(config, CudaLibraries(gemv_attention=on)) for on in (True, False))
    assert fused.count(gemv.NK_ATTN_ADD_FUNCTION) == 1 and flash_attention.ROPE_QK_FUNCTION not in fused, fused
    assert plain.count(flash_attention.ROPE_QK_FUNCTION) == 1 and gemv.NK_ATTN_ADD_FUNCTION not in plain, plain
    assert len(fused) == len(plain) - 2, (fused, plain)  # the flash call and the reshape between


def test_the_pass_follows_its_switch_and_the_flash_one(chosen_passes):
    from relaxtune.config import FlashAttention

    def passes(libraries, flash=FlashAttention()):
        target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
        return chosen_passes(target, CompileConfig(cublas=libraries, flash_attention=flash), "FuseAttentionGemvCuda")

    assert [type(p) for p in passes(CudaLibraries())] == [FuseAttentionGemvCuda]
    assert passes(CudaLibraries(gemv_attention=False)) == [] and passes(CudaLibraries(gemv=False)) == []
    assert passes(CudaLibraries(), FlashAttention(enabled=False)) == []
