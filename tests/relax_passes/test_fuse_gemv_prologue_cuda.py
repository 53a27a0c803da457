"""FuseGemvPrologueCuda (relax_passes/fuse_gemv_prologue_cuda.py), without a GPU.

The rewrite is checked structurally, where it must not fire, numerically on the CPU (the kernels' contract
in numpy, registered under their names, run by the VM before and after the pass) and in the fp16 llama-block's
cuda build (the n = 1 bucket's kernels). The kernels themselves: test_gemv_cuda.py (nvcc) and
tests/kernels/test_gpu_kernels.py (against torch on a GPU).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from relaxtune.config import CompileConfig, CudaLibraries
from relaxtune.kernels import gemv
from relaxtune.relax_passes.fuse_gemv_prologue_cuda import FuseGemvPrologueCuda


@I.ir_module
class Before:  # the llama block's decode bucket after RewriteGemvToCuda: norm -> gate/up -> SwiGLU -> down + residual
    @R.function(private=True)
    def main_n1(
        x: R.Tensor((1, 1, 64), "float16"),
        g: R.Tensor((64,), "float16"),
        wgu: R.Tensor((96, 64), "float16"),
        wd: R.Tensor((64, 48), "float16"),
    ) -> R.Tensor((1, 1, 64), "float16"):
        R.func_attr({"relaxtune.bucket": {"n": [1, 1, 1]}})
        with R.dataflow():
            h = R.nn.rms_norm(x, g, axes=[-1], epsilon=1e-5)
            gu = R.call_dps_packed("relaxtune_gemv_nk", (h, wgu), out_ty=R.Tensor((1, 1, 96), "float16"))
            gate = R.strided_slice(gu, (2,), (0,), (48,), assume_inbound=True)
            s = R.nn.silu(gate)
            up = R.strided_slice(gu, (2,), (48,), (96,), assume_inbound=True)
            m = R.multiply(s, up)
            y = R.call_dps_packed("relaxtune_gemv_nk_add", (m, wd, x), out_ty=R.Tensor((1, 1, 64), "float16"))
            R.output(y)
        return y


@I.ir_module
class Expected:
    @R.function(private=True)
    def main_n1(
        x: R.Tensor((1, 1, 64), "float16"),
        g: R.Tensor((64,), "float16"),
        wgu: R.Tensor((96, 64), "float16"),
        wd: R.Tensor((64, 48), "float16"),
    ) -> R.Tensor((1, 1, 64), "float16"):
        R.func_attr({"relaxtune.bucket": {"n": [1, 1, 1]}})
        with R.dataflow():  # the norm as gate/up's prologue, the SwiGLU as its epilogue: down reads m as it is
            m = R.call_dps_packed(
                "relaxtune_gemv_nk_rms_glu", (x, g, wgu, T.float64(1e-5)), out_ty=R.Tensor((1, 1, 48), "float16")
            )
            y = R.call_dps_packed("relaxtune_gemv_nk_add", (m, wd, x), out_ty=R.Tensor((1, 1, 64), "float16"))
            R.output(y)
        return y


def _with_gu(read_twice: bool = False, norm: bool = True) -> tvm.IRModule:
    """Before, with gu also returned (`read_twice`: the SwiGLU stays down's prologue) or no norm before gate/up."""
    text = Before.script()
    if read_twice:
        text = text.replace("R.output(y)", "R.output(y, gu)").replace("return y", "return (y, gu)")
        text = text.replace(
            '-> R.Tensor((1, 1, 64), dtype="float16"):',
            '-> R.Tuple(R.Tensor((1, 1, 64), dtype="float16"), R.Tensor((1, 1, 96), dtype="float16")):',
        )
    if not norm:
        text = text.replace('relaxtune_gemv_nk", (h, wgu)', 'relaxtune_gemv_nk", (x, wgu)')
    return tvm.script.from_source(text)


def test_without_the_epilogue_switch_the_swiglu_stays_down_s_prologue():
    text = FuseGemvPrologueCuda(glu=False)(Before).script()
    assert "relaxtune_gemv_nk_swiglu_add" in text and "_glu" not in text and "silu" not in text, text


def test_the_swiglu_is_the_gate_up_gemv_epilogue_only_where_that_gemv_alone_reads_it():
    shared = FuseGemvPrologueCuda()(_with_gu(read_twice=True)).script()  # gu is an output too: down's prologue
    assert "relaxtune_gemv_nk_swiglu_add" in shared and 'relaxtune_gemv_nk_rms"' in shared, shared
    assert "_glu" not in shared
    plain = FuseGemvPrologueCuda()(_with_gu(norm=False)).script()  # no norm before gate/up: the plain epilogue form
    assert 'R.call_dps_packed("relaxtune_gemv_nk_glu", (x, wgu)' in plain, plain
    assert "silu" not in plain and "strided_slice" not in plain and 'relaxtune_gemv_nk_add", (lv' in plain, plain


@I.ir_module
class Untouched:
    @R.function(private=True)
    def main_n1(
        x: R.Tensor((1, 1, 64), "float16"),
        g: R.Tensor((64,), "float16"),
        wgu: R.Tensor((96, 64), "float16"),
        wd: R.Tensor((64, 48), "float16"),
        wkn: R.Tensor((48, 64), "float16"),
    ) -> R.Tuple(R.Tensor((1, 1, 64), "float16"), R.Tensor((1, 1, 64), "float16"), R.Tensor((1, 1, 64), "float16")):
        R.func_attr({"relaxtune.bucket": {"n": [1, 1, 1]}})
        with R.dataflow():
            h = R.nn.rms_norm(x, g, axes=[-1], epsilon=1e-5)
            gu = R.call_dps_packed("relaxtune_gemv_nk", (h, wgu), out_ty=R.Tensor((1, 1, 96), "float16"))
            hn = R.add(h, x)  # the norm has a second reader: it stays
            gate = R.strided_slice(gu, (2,), (0,), (48,), assume_inbound=True)
            up = R.strided_slice(gu, (2,), (48,), (96,), assume_inbound=True)
            s = R.nn.silu(up)  # silu of the second half: not the kernel's gate | up
            m = R.multiply(s, gate)
            y = R.call_dps_packed("relaxtune_gemv_nk", (m, wd), out_ty=R.Tensor((1, 1, 64), "float16"))
            gate2 = R.strided_slice(gu, (2,), (0,), (48,), assume_inbound=True)
            up2 = R.strided_slice(gu, (2,), (48,), (96,), assume_inbound=True)
            m2 = R.multiply(R.nn.silu(gate2), up2)
            z = R.call_dps_packed("relaxtune_gemv", (m2, wkn), out_ty=R.Tensor((1, 1, 64), "float16"))  # (K, N)
            R.output(hn, y, z)
        return (hn, y, z)


def test_norm_and_swiglu_move_into_the_gemv_calls():
    tvm.ir.assert_structural_equal(FuseGemvPrologueCuda()(Before), Expected)


def test_does_not_fire_on_shared_norms_swapped_halves_the_kn_kernel_or_fp32():
    tvm.ir.assert_structural_equal(FuseGemvPrologueCuda()(Untouched), Untouched)
    fp32 = Before.script().replace('"float16"', '"float32"')
    mod = tvm.script.from_source(fp32)
    tvm.ir.assert_structural_equal(FuseGemvPrologueCuda()(mod), mod)


def test_either_operand_order_of_the_swiglu_product():
    text = Before.script()
    assert "R.multiply(s, up)" in text
    fused = FuseGemvPrologueCuda()(tvm.script.from_source(text.replace("R.multiply(s, up)", "R.multiply(up, s)")))
    tvm.ir.assert_structural_equal(fused, Expected)


@I.ir_module
class BeforeSplit:  # a language model's decode step: its merged gate/up halves by R.split (models/, gguf)
    @R.function(private=True)
    def decode(
        gu: R.Tensor((1, 1, 96), "float16"), wd: R.Tensor((64, 48), "float16"), x: R.Tensor((1, 1, 64), "float16")
    ) -> R.Tensor((1, 1, 64), "float16"):
        with R.dataflow():
            halves = R.split(gu, indices_or_sections=2, axis=-1)
            gate = halves[0]
            up = halves[1]
            m = R.multiply(R.nn.silu(gate), up)
            y = R.call_dps_packed("relaxtune_gemv_nk_add", (m, wd, x), out_ty=R.Tensor((1, 1, 64), "float16"))
            R.output(y)
        return y


@I.ir_module
class ExpectedSplit:
    @R.function(private=True)
    def decode(
        gu: R.Tensor((1, 1, 96), "float16"), wd: R.Tensor((64, 48), "float16"), x: R.Tensor((1, 1, 64), "float16")
    ) -> R.Tensor((1, 1, 64), "float16"):
        with R.dataflow():
            y = R.call_dps_packed("relaxtune_gemv_nk_swiglu_add", (gu, wd, x), out_ty=R.Tensor((1, 1, 64), "float16"))
            R.output(y)
        return y


def _split_module(sections, gate_field: int, k: int = 48) -> tvm.IRModule:
    """BeforeSplit with `R.split(gu, sections)`, silu on field `gate_field`, the other field as up, w (64, k)."""
    bb = relax.BlockBuilder()
    gu, x = (
        relax.Var("gu", relax.TensorType((1, 1, 96), "float16")),
        relax.Var("x", relax.TensorType((1, 1, 64), "float16")),
    )
    wd = relax.Var("wd", relax.TensorType((64, k), "float16"))
    with bb.function("decode", [gu, wd, x], private=True):
        with bb.dataflow():
            halves = bb.emit(relax.op.split(gu, sections, axis=-1))
            gate = bb.emit(relax.TupleGetItem(halves, gate_field))
            up = bb.emit(relax.TupleGetItem(halves, 1 - gate_field))
            m = bb.emit(relax.op.multiply(bb.emit(relax.op.nn.silu(gate)), up))
            out = relax.TensorType((1, 1, 64), "float16")
            y = bb.emit_output(relax.call_dps_packed("relaxtune_gemv_nk_add", [m, wd, x], out))
        bb.emit_func_output(y)
    return bb.get()


def test_the_split_form_of_the_gate_up_halves():
    tvm.ir.assert_structural_equal(FuseGemvPrologueCuda()(BeforeSplit), ExpectedSplit)
    assert "relaxtune_gemv_nk_swiglu_add" in FuseGemvPrologueCuda()(_split_module([48], 0)).script()  # by index
    for other in (_split_module(3, 0, k=32), _split_module(2, 1)):  # thirds; silu of the up half: left alone
        tvm.ir.assert_structural_equal(FuseGemvPrologueCuda()(other), other)


# ---- numerically: the kernels' contract (kernels/gemv.py) in numpy, before and after the pass on the CPU VM
def _f32(t):
    return t.numpy().astype(np.float32)


def _store(y, value):
    y.copyfrom(value.astype(y.numpy().dtype))


def _rms(x, g, eps):  # TVM's rms_norm: fp32, one rounding
    x = x.astype(np.float32)
    out = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * g
    return out.astype(np.float16).astype(np.float32)


def _swiglu(gu):  # each step rounded to fp16, as the separate kernel
    k = gu.shape[-1] // 2
    gate, up = gu[..., :k].astype(np.float16), gu[..., k:].astype(np.float16)
    return (gate * (np.float16(1) / (np.float16(1) + np.exp(-gate))) * up).astype(np.float32)


CONTRACT = {
    gemv.NK_FUNCTION: lambda x, w, y: _store(y, _f32(x) @ _f32(w).T),
    gemv.NK_ADD_FUNCTION: lambda x, w, r, y: _store(y, _f32(x) @ _f32(w).T + _f32(r)),
    gemv.NK_RMS_FUNCTION: lambda x, g, w, eps, y: _store(y, _rms(_f32(x), _f32(g), eps) @ _f32(w).T),
    gemv.NK_SWIGLU_FUNCTION: lambda gu, w, y: _store(y, _swiglu(_f32(gu)) @ _f32(w).T),
    gemv.NK_SWIGLU_ADD_FUNCTION: lambda gu, w, r, y: _store(y, _swiglu(_f32(gu)) @ _f32(w).T + _f32(r)),
    gemv.NK_GLU_FUNCTION: lambda x, w, y: _store(y, _swiglu((_f32(x) @ _f32(w).T).astype(np.float16))),
    gemv.NK_RMS_GLU_FUNCTION: lambda x, g, w, eps, y: _store(
        y, _swiglu((_rms(_f32(x), _f32(g), eps) @ _f32(w).T).astype(np.float16))
    ),
}


def test_the_fused_calls_compute_what_the_chain_did(numpy_externs, run_on_cpu):
    numpy_externs(CONTRACT)
    rng = np.random.default_rng(0)
    args = [
        rng.standard_normal((1, 1, 64)).astype(np.float16),
        (1 + 0.1 * rng.standard_normal(64)).astype(np.float16),
        (rng.standard_normal((96, 64)) / 8).astype(np.float16),
        (rng.standard_normal((64, 48)) / 7).astype(np.float16),
    ]
    for mod in (Before, _with_gu(norm=False)):
        before, after = (run_on_cpu(m, args, "main_n1") for m in (mod, FuseGemvPrologueCuda()(mod)))
        assert np.isfinite(after).all() and np.abs(after).max() > 0.1
        np.testing.assert_allclose(after, before, rtol=0, atol=1e-2)
    split_args = [rng.standard_normal((1, 1, 96)).astype(np.float16), args[3], args[0]]
    before, after = (run_on_cpu(m, split_args, "decode") for m in (BeforeSplit, FuseGemvPrologueCuda()(BeforeSplit)))
    assert np.abs(after).max() > 0.1
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-2)


# ---- in the pipeline: the fp16 llama-block's n = 1 bucket on cuda
def test_llama_block_decode_bucket_ends_with_the_fused_calls_and_three_kernels_fewer(decode_bucket_calls):
    config = "hidden=64,heads=2,kv_heads=2,ffn=128,max_seq=64,max_batch=1"
    fused, plain = (decode_bucket_calls(config, CudaLibraries(gemv_prologue=on)) for on in (True, False))
    assert fused.count(gemv.NK_RMS_FUNCTION) == 1 and fused.count(gemv.NK_RMS_GLU_FUNCTION) == 1, fused
    assert fused.count(gemv.NK_ADD_FUNCTION) == 2 and gemv.NK_SWIGLU_ADD_FUNCTION not in fused, fused
    assert gemv.NK_FUNCTION not in fused and plain.count(gemv.NK_FUNCTION) == 2, plain
    assert len(fused) == len(plain) - 3, (fused, plain)


def test_the_pass_follows_its_switch_and_the_gemv_one(chosen_passes):
    def passes(libraries):
        target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
        return chosen_passes(target, CompileConfig(cublas=libraries), "FuseGemvPrologueCuda")

    assert [type(p) for p in passes(CudaLibraries())] == [FuseGemvPrologueCuda]
    assert passes(CudaLibraries())[0].glu and not passes(CudaLibraries(gemv_glu=False))[0].glu
    assert passes(CudaLibraries(gemv_prologue=False)) == [] and passes(CudaLibraries(gemv=False)) == []
