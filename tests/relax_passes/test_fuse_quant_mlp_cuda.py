"""FuseQuantMlpCuda: a one-row o_proj .. down chain of int8-activation 4-bit GEMV calls becomes one
relaxtune_q4mlp_i8 call; chains it cannot take (h read a third time, two rows, scale rows the kernel does not copy
whole, float16 activations) stay as they are; in the pipeline it fires in the n = 1 bucket of a q4f16 block only."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax, tirx

from relaxtune.kernels.gemv import Q4_I8_ADD_FUNCTION, Q4_I8_FUNCTION, Q4_MLP_FUNCTION
from relaxtune.relax_passes.fuse_quant_mlp_cuda import FuseQuantMlpCuda

G, EPS, F16 = 32, 1e-5, "float16"


def _module(h: int, f: int, fused: bool, rows: int = 1, split: bool = False, h_out: bool = False) -> tvm.IRModule:
    """decode(x, res, wo, so, g, wgu, sgu, wd, sd): the MLP half of a decoder layer over 4-bit weights, A = H;
    `fused`: as the pass rewrites it; `split`: gate / up as R.split's fields; `h_out`: h returned too."""
    bb = relax.BlockBuilder()

    def weight(name, n, k):
        return relax.Var(name, relax.TensorType((n, k // 8), "uint32")), relax.Var(
            f"s{name}", relax.TensorType((n, k // G), F16)
        )

    x, res = (relax.Var(v, relax.TensorType((1, rows, h), F16)) for v in ("x", "res"))
    g = relax.Var("g", relax.TensorType((h,), F16))
    (wo, so), (wgu, sgu), (wd, sd) = weight("wo", h, h), weight("wgu", 2 * f, h), weight("wd", h, f)
    row = relax.TensorType((1, rows, h), F16)
    with bb.function("decode", [x, res, wo, so, g, wgu, sgu, wd, sd]):
        with bb.dataflow():
            if fused:
                eps = relax.prim_value(tirx.FloatImm("float64", EPS))
                types = [row, relax.TensorType((1, rows, f), F16), row]
                mlp = bb.emit(relax.call_dps_packed(Q4_MLP_FUNCTION, [x, res, wo, so, g, wgu, sgu, wd, sd, eps], types))
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
    for arch, options in (
        ("sm_90", CompileConfig(use_cache=False)),
        ("sm_80", CompileConfig(use_cache=False)),  # no bulk copies
        ("sm_90", CompileConfig(use_cache=False, int8_activations=False)),
        ("sm_90", CompileConfig(use_cache=False, cublas=CudaLibraries(q4_mlp=False))),
    ):
        target = targets.resolve(f"cuda:{arch}").target
        with target:
            mod = tvm.transform.Sequential(fusion_passes(target, plan, options))(workload.mod)
        calls = {g.name_hint: f.script().count(f'"{Q4_MLP_FUNCTION}"') for g, f in mod.functions_items()}
        found[(arch, options.int8_activations, options.cublas.q4_mlp)] = {k: v for k, v in calls.items() if v}
    assert found[("sm_90", True, True)] == {"main_n1_b1": 1}  # n > 1 keeps its kernels
    assert not found[("sm_80", True, True)] and not found[("sm_90", False, True)] and not found[("sm_90", True, False)]
