"""FuseQuantBlockCuda: the q/k/v projection (relaxtune_q4gemv_i8_rms) feeding a relaxtune_q4mlp_attn_i8 call through
one reshape joins it as one relaxtune_q4block_i8 call; q/k/v read by anything else, or separate q, k and v, stay; in
the pipeline the n = 1 bucket of a q4f16 block is that one call, and not with CudaLibraries(q4_block=False). The
kernel's numerics: tests/kernels/test_gpu_q4mlp.py (GPU)."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax, tirx

from relaxtune.kernels.gemv import Q4_BLOCK_FUNCTION, Q4_I8_RMS_FUNCTION, Q4_MLP_ATTN_FUNCTION
from relaxtune.relax_passes.fuse_quant_block_cuda import FuseQuantBlockCuda

G, F16 = 32, "float16"
H, F, HEADS, KV, D = 256, 512, 4, 2, 64


def _module(fused: bool, qkv_out: bool = False, separate_v: bool = False) -> tvm.IRModule:
    """decode(x, gin, wqkv, sqkv, cos, sin, wo, so, g, wgu, sgu, wd, sd): a decoder layer over 4-bit weights as
    FuseQuantMlpCuda and FuseQuantGemvPrologueCuda leave it; `fused`: as FuseQuantBlockCuda rewrites it; `qkv_out`:
    q | k | v returned too; `separate_v`: v another input, not the projection's."""
    bb = relax.BlockBuilder()

    def weight(name, n, k):
        return relax.Var(name, relax.TensorType((n, k // 8), "uint32")), relax.Var(
            f"s{name}", relax.TensorType((n, k // G), F16)
        )

    heads = HEADS + 2 * KV
    x, gin, g = (
        relax.Var("x", relax.TensorType((1, 1, H), F16)),
        *(relax.Var(v, relax.TensorType((H,), F16)) for v in ("gin", "g")),
    )
    (wqkv, sqkv), (wo, so) = weight("wqkv", heads * D, H), weight("wo", H, H)
    (wgu, sgu), (wd, sd) = weight("wgu", 2 * F, H), weight("wd", H, F)
    cos, sin = (relax.Var(v, relax.TensorType((1, D), F16)) for v in ("cos", "sin"))
    other_v = relax.Var("v", relax.TensorType((1, 1, heads, D), F16))
    eps = relax.prim_value(tirx.FloatImm("float64", 1e-5))
    attention = [cos, sin, relax.ShapeExpr([0, HEADS, HEADS + KV, KV]), relax.prim_value(1)]
    attention += [relax.prim_value(tirx.FloatImm("float64", 0.125)), relax.prim_value(tirx.IntImm("int64", 2))]
    mlp_weights = [x, wo, so, g, wgu, sgu, wd, sd, eps]
    qkv4_ty = relax.TensorType((1, 1, heads, D), F16)
    types = [relax.TensorType((1, 1, H), F16), relax.TensorType((1, 1, F), F16), relax.TensorType((1, 1, H), F16)]
    inputs = [x, gin, wqkv, sqkv, cos, sin, wo, so, g, wgu, sgu, wd, sd] + ([other_v] if separate_v else [])
    with bb.function("decode", inputs):
        with bb.dataflow():
            if fused:
                block = bb.emit(
                    relax.call_dps_packed(
                        Q4_BLOCK_FUNCTION, [x, gin, wqkv, sqkv, eps, *attention, *mlp_weights], [qkv4_ty, *types]
                    )
                )
                y = bb.emit_output(relax.TupleGetItem(block, 3))
            else:
                qkv = bb.emit(
                    relax.call_dps_packed(
                        Q4_I8_RMS_FUNCTION, [x, gin, wqkv, sqkv, eps], relax.TensorType((1, 1, heads * D), F16)
                    )
                )
                qkv4 = bb.emit(relax.op.reshape(qkv, (1, 1, heads, D)))
                v = other_v if separate_v else qkv4
                mlp = bb.emit(
                    relax.call_dps_packed(Q4_MLP_ATTN_FUNCTION, [qkv4, qkv4, v, *attention, *mlp_weights], types)
                )
                y = bb.emit_output(relax.TupleGetItem(mlp, 2))
                if qkv_out:
                    y = bb.emit_output(relax.Tuple([y, qkv]))
        bb.emit_func_output(y)
    return relax.transform.Normalize()(bb.get())


def test_the_projection_and_the_fused_mlp_become_one_block_call():
    after = FuseQuantBlockCuda()(_module(fused=False))
    tvm.ir.assert_structural_equal(after, _module(fused=True))
    text = after.script()
    assert Q4_I8_RMS_FUNCTION not in text and Q4_MLP_ATTN_FUNCTION not in text and "reshape" not in text


@pytest.mark.parametrize("kwargs", [{"qkv_out": True}, {"separate_v": True}])
def test_chains_the_kernel_cannot_take_stay(kwargs):
    before = _module(fused=False, **kwargs)
    tvm.ir.assert_structural_equal(FuseQuantBlockCuda()(before), before)


def test_pipeline_puts_the_decode_bucket_s_layer_in_one_kernel(decode_bucket_calls):
    from relaxtune.config import CudaLibraries, QuantizeConfig

    config, q4 = "hidden=256,heads=4,kv_heads=2,ffn=512,max_seq=128,max_batch=1", QuantizeConfig("q4f16", 32)
    fused = decode_bucket_calls(config, CudaLibraries(), q4)
    apart = decode_bucket_calls(config, CudaLibraries(q4_block=False), q4)
    assert [c for c in fused if c != "tir"] == [Q4_BLOCK_FUNCTION], fused  # the tables: folded constants
    assert [c for c in apart if c != "tir"] == [Q4_I8_RMS_FUNCTION, Q4_MLP_ATTN_FUNCTION], apart
