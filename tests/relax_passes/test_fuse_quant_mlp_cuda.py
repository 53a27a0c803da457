"""FuseQuantMlpCuda: a one-row o_proj .. down chain of int8-activation 4-bit GEMV calls becomes one
relaxtune_q4mlp_i8 call; chains it cannot take (h read a third time, two rows, scale rows the kernel does not copy
whole, float16 activations) stay as they are; in the pipeline it fires in the n = 1 bucket of a q4f16 block only."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax, tirx

from relaxtune.kernels.flash_attention import ROPE_QK_FUNCTION
from relaxtune.kernels.gemv import Q4_I8_ADD_FUNCTION, Q4_I8_FUNCTION, Q4_MLP_ATTN_FUNCTION, Q4_MLP_FUNCTION
from relaxtune.relax_passes.fuse_quant_mlp_cuda import FuseQuantMlpCuda

G, EPS, F16 = 32, 1e-5, "float16"


def _module(
    h: int, f: int, fused: bool, rows: int = 1, split: bool = False, h_out: bool = False, attention: bool = False
) -> tvm.IRModule:
    """decode(x, res, wo, so, g, wgu, sgu, wd, sd): the MLP half of a decoder layer over 4-bit weights, A = H;
    `fused`: as the pass rewrites it; `split`: gate / up as R.split's fields; `h_out`: h returned too; `attention`:
    x is the reshaped output of a flash call on qkv (1, rows, H / 32, 64) (heads of 64, GQA 2), decode(qkv, cos,
    sin, res, ...)."""
    bb = relax.BlockBuilder()

    def weight(name, n, k):
        return relax.Var(name, relax.TensorType((n, k // 8), "uint32")), relax.Var(
            f"s{name}", relax.TensorType((n, k // G), F16)
        )

    x, res = (relax.Var(v, relax.TensorType((1, rows, h), F16)) for v in ("x", "res"))
    g = relax.Var("g", relax.TensorType((h,), F16))
    (wo, so), (wgu, sgu), (wd, sd) = weight("wo", h, h), weight("wgu", 2 * f, h), weight("wd", h, f)
    row = relax.TensorType((1, rows, h), F16)
    heads = h // 64
    qkv = relax.Var("qkv", relax.TensorType((1, rows, heads * 2, 64), F16))
    cos, sin = (relax.Var(v, relax.TensorType((rows, 64), F16)) for v in ("cos", "sin"))
    flash_operands = [qkv, qkv, qkv, cos, sin, relax.ShapeExpr([0, heads, heads * 3 // 2, heads // 2])]
    flash_operands += [relax.prim_value(1), relax.prim_value(tirx.FloatImm("float64", 0.125))]
    inputs = [qkv, cos, sin] if attention else [x]
    with bb.function("decode", [*inputs, res, wo, so, g, wgu, sgu, wd, sd]):
        with bb.dataflow():
            if attention and not fused:
                o = bb.emit(
                    relax.call_dps_packed(
                        ROPE_QK_FUNCTION,
                        [*flash_operands, relax.prim_value(0)],
                        relax.TensorType((1, rows, heads, 64), F16),
                    )
                )
                x = bb.emit(relax.op.reshape(o, (1, rows, h)))
            if fused:
                eps = relax.prim_value(tirx.FloatImm("float64", EPS))
                types = [row, relax.TensorType((1, rows, f), F16), row]
                weights = [res, wo, so, g, wgu, sgu, wd, sd, eps]
                rope = relax.prim_value(tirx.IntImm("int64", 2))
                call = (
                    relax.call_dps_packed(Q4_MLP_ATTN_FUNCTION, [*flash_operands, rope, *weights], types)
                    if attention
                    else relax.call_dps_packed(Q4_MLP_FUNCTION, [x, *weights], types)
                )
                mlp = bb.emit(call)
                y = bb.emit_output(relax.TupleGetItem(mlp, 2))
            else:
                hv = bb.emit(relax.call_dps_packed(Q4_I8_ADD_FUNCTION, [x, wo, so, res], row))
                n = bb.emit(relax.op.nn.rms_norm(hv, g, axes=[-1], epsilon=EPS))
                gu = bb.emit(
                    relax.call_dps_packed(Q4_I8_FUNCTION, [n, wgu, sgu], relax.TensorType((1, rows, 2 * f), F16))
                )
                if split:
                    halves = bb.emit(relax.op.split(gu, 2, axis=-1))
                    gate, up = bb.emit(relax.TupleGetItem(halves, 0)), bb.emit(relax.TupleGetItem(halves, 1))
                else:
                    gate = bb.emit(relax.op.strided_slice(gu, axes=[2], begin=[0], end=[f]))
                    up = bb.emit(relax.op.strided_slice(gu, axes=[2], begin=[f], end=[2 * f]))
                m = bb.emit(relax.op.multiply(relax.op.nn.silu(gate), up))
                y = bb.emit_output(relax.call_dps_packed(Q4_I8_ADD_FUNCTION, [m, wd, sd, hv], row))
                if h_out:
                    y = bb.emit_output(relax.Tuple([y, hv]))
        bb.emit_func_output(y)
    return relax.transform.Normalize()(bb.get())


@pytest.mark.parametrize("split", [False, True])
def test_mlp_chain_becomes_one_kernel_call(split):
    after = FuseQuantMlpCuda()(_module(256, 512, fused=False, split=split))
    tvm.ir.assert_structural_equal(after, _module(256, 512, fused=True))
    text = after.script()
    for gone in ("rms_norm", "silu", "strided_slice", "split", Q4_I8_FUNCTION):
        assert gone not in text


def test_the_attention_before_o_proj_joins_the_kernel_unless_switched_off():
    before = _module(256, 512, fused=False, attention=True)
    tvm.ir.assert_structural_equal(FuseQuantMlpCuda()(before), _module(256, 512, fused=True, attention=True))
    text = FuseQuantMlpCuda(attention=False)(before).script()
    assert f'"{Q4_MLP_FUNCTION}"' in text and ROPE_QK_FUNCTION in text and Q4_MLP_ATTN_FUNCTION not in text


@pytest.mark.parametrize(
    "h,f,kwargs",
    [
        (256, 512, {"rows": 2}),  # two rows: the kernel takes one
        (256, 512, {"h_out": True}),  # h read by a third binding
        (128, 512, {}),  # H / group = 4 scales a row: not 16 bytes
        (256, 32768, {}),  # F over the kernel's 16384
    ],
)
def test_chains_the_kernel_cannot_take_stay(h, f, kwargs):
    before = _module(h, f, fused=False, **kwargs)
    tvm.ir.assert_structural_equal(FuseQuantMlpCuda()(before), before)


def test_pipeline_fuses_the_decode_bucket_of_a_q4_block_only():
    from relaxtune import api, targets
    from relaxtune.config import BucketConfig, CompileConfig, CudaLibraries, JobConfig, QuantizeConfig
    from relaxtune.relax_passes.pipeline import fusion_passes
    from relaxtune.workloads import load, parse_config

    config = parse_config("hidden=256,heads=4,kv_heads=2,ffn=512,max_seq=128,max_batch=1")
    workload = load("llama-block", config, quantize=QuantizeConfig("q4f16", 32))
    job = JobConfig(compile=CompileConfig(use_cache=False), buckets=BucketConfig(edges={"n": (1, 16, 128)}))
    plan = api.bucket_plan(workload, job)
    found = {}
    mlp_only = CudaLibraries(q4_block=False)  # the q/k/v projection not in it (FuseQuantBlockCuda)
    for arch, options in (
        ("sm_90", CompileConfig(use_cache=False, cublas=mlp_only)),
        ("sm_80", CompileConfig(use_cache=False, cublas=mlp_only)),  # no bulk copies
        ("sm_90", CompileConfig(use_cache=False, cublas=mlp_only, int8_activations=False)),
        ("sm_90", CompileConfig(use_cache=False, cublas=CudaLibraries(q4_mlp=False))),
    ):
        target = targets.resolve(f"cuda:{arch}").target
        with target:
            mod = tvm.transform.Sequential(fusion_passes(target, plan, options))(workload.mod)
        calls = {
            g.name_hint: sum(f.script().count(f'"{name}"') for name in (Q4_MLP_FUNCTION, Q4_MLP_ATTN_FUNCTION))
            for g, f in mod.functions_items()
        }
        found[(arch, options.int8_activations, options.cublas.q4_mlp)] = {k: v for k, v in calls.items() if v}
    assert found[("sm_90", True, True)] == {"main_n1_b1": 1}  # n > 1 keeps its kernels
    assert not found[("sm_80", True, True)] and not found[("sm_90", False, True)] and not found[("sm_90", True, False)]


def test_pipeline_gives_the_fused_kernel_the_decode_bucket_s_attention():
    from relaxtune import api, targets
    from relaxtune.config import CompileConfig, CudaLibraries, JobConfig, QuantizeConfig
    from relaxtune.relax_passes.pipeline import fusion_passes
    from relaxtune.workloads import load, parse_config

    config = parse_config("hidden=256,heads=4,kv_heads=2,ffn=512,max_seq=16,max_batch=1")
    workload = load("llama-block", config, quantize=QuantizeConfig("q4f16", 32))
    target = targets.resolve("cuda:sm_90").target
    texts = []
    for libraries in (CudaLibraries(q4_block=False), CudaLibraries(gemv_attention=False)):
        options = CompileConfig(use_cache=False, cublas=libraries)
        plan = api.bucket_plan(workload, JobConfig(compile=options))
        with target:
            mod = tvm.transform.Sequential(fusion_passes(target, plan, options))(workload.mod)
        (texts_n1,) = [f.script() for g, f in mod.functions_items() if g.name_hint.startswith("main_n1_")]
        texts.append(texts_n1)
    assert f'"{Q4_MLP_ATTN_FUNCTION}"' in texts[0] and ROPE_QK_FUNCTION not in texts[0], texts[0]
    assert f'"{Q4_MLP_FUNCTION}"' in texts[1] and ROPE_QK_FUNCTION in texts[1], texts[1]
