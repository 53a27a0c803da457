"""RewriteGemvToCuda (relax_passes/gemv_cuda.py) and its kernel (relaxtune/cuda_gemv.py), without a GPU.

The rewrite is checked structurally and where it must not fire; the kernel is assembled by nvcc
for sm_90 and sm_80 without spills, and its host object exports the three entry points. The
numbers (against torch and cuBLAS; the (N, K) kernels' too) come from benchmarks/gemv_check.py and
benchmarks/gpu_job.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from relaxtune.config import CompileConfig, CudaLibraries
from relaxtune.kernels.gemv import Q4_MLP_KERNELS, Q4_STREAM_KERNELS
from relaxtune.relax_passes.gemv_cuda import RewriteGemvToCuda

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")


@I.ir_module
class Before:  # a decode bucket of the llama block: projection, o_proj + residual, down + residual
    @R.function(private=True)
    def main_n1(
        x: R.Tensor((1, 1, 64), "float16"),
        a: R.Tensor((1, 1, 64), "float16"),
        wqkv: R.Tensor((64, 192), "float16"),
        wo: R.Tensor((64, 64), "float16"),
        wd: R.Tensor((32, 64), "float16"),
        m: R.Tensor((1, 1, 32), "float16"),
    ) -> R.Tensor((1, 1, 64), "float16"):
        R.func_attr({"relaxtune.bucket": {"n": [1, 1, 1]}})
        with R.dataflow():
            qkv = R.matmul(x, wqkv)
            o = R.matmul(a, wo)
            h = R.add(x, o)
            d = R.matmul(m, wd)
            y = R.add(d, h)
            z = R.add(y, R.sum(qkv, axis=[2], keepdims=True))
            R.output(z)
        return z


@I.ir_module
class Expected:
    @R.function(private=True)
    def main_n1(
        x: R.Tensor((1, 1, 64), "float16"),
        a: R.Tensor((1, 1, 64), "float16"),
        wqkv: R.Tensor((64, 192), "float16"),
        wo: R.Tensor((64, 64), "float16"),
        wd: R.Tensor((32, 64), "float16"),
        m: R.Tensor((1, 1, 32), "float16"),
    ) -> R.Tensor((1, 1, 64), "float16"):
        R.func_attr({"relaxtune.bucket": {"n": [1, 1, 1]}})
        with R.dataflow():
            qkv = R.call_dps_packed("relaxtune_gemv", (x, wqkv), out_ty=R.Tensor((1, 1, 192), "float16"))
            h = R.call_dps_packed("relaxtune_gemv_add", (a, wo, x), out_ty=R.Tensor((1, 1, 64), "float16"))
            y = R.call_dps_packed("relaxtune_gemv_add", (m, wd, h), out_ty=R.Tensor((1, 1, 64), "float16"))
            z = R.add(y, R.sum(qkv, axis=[2], keepdims=True))
            R.output(z)
        return z


@I.ir_module
class Untouched:
    @R.function(private=True)
    def main_n9_16(x: R.Tensor((1, "n", 64), "float16"), w: R.Tensor((64, 64), "float16")) -> R.Tensor(
        (1, "n", 64), "float16"
    ):
        R.func_attr({"relaxtune.bucket": {"n": [9, 16, 16]}})  # above max_rows
        with R.dataflow():
            y = R.matmul(x, w)
            R.output(y)
        return y

    @R.function(private=True)
    def main_n1(
        x: R.Tensor((1, 1, 64), "float32"),
        w: R.Tensor((64, 64), "float32"),
        h: R.Tensor((1, 1, 64), "float16"),
        v: R.Tensor((64, 64), "float16"),
        u: R.Tensor((64, 60), "float16"),
    ) -> R.Tuple(R.Tensor((1, 1, 64), "float32"), R.Tensor((1, 1, 64), "float16"), R.Tensor((1, 1, 60), "float16")):
        R.func_attr({"relaxtune.bucket": {"n": [1, 1, 1]}})
        with R.dataflow():
            y = R.matmul(x, w)  # fp32
            t = R.add(v, v)  # a weight computed in the function, not a parameter (nor the transpose of one)
            p = R.matmul(h, t)
            q = R.matmul(h, u)  # N = 60: not a multiple of the kernel's 8-column vectors
            R.output(y, p, q)
        return (y, p, q)


def test_decode_gemvs_become_kernel_calls_with_the_residual_as_epilogue():
    tvm.ir.assert_structural_equal(RewriteGemvToCuda()(Before), Expected)


@I.ir_module
class BeforeNK:  # the same bucket with its weights kept (N, K) by KeepWeightsNK (keep_weights_nk.py)
    @R.function(private=True)
    def main_n1(
        x: R.Tensor((1, 1, 64), "float16"),
        a: R.Tensor((1, 1, 64), "float16"),
        wqkv: R.Tensor((192, 64), "float16"),
        wo: R.Tensor((64, 64), "float16"),
        wd: R.Tensor((64, 32), "float16"),
        m: R.Tensor((1, 1, 32), "float16"),
    ) -> R.Tensor((1, 1, 64), "float16"):
        R.func_attr({"relaxtune.bucket": {"n": [1, 1, 1]}})
        with R.dataflow():
            qkv = R.matmul(x, R.permute_dims(wqkv))
            o = R.matmul(a, R.permute_dims(wo))
            h = R.add(x, o)
            d = R.matmul(m, R.permute_dims(wd, [1, 0]))
            y = R.add(d, h)
            z = R.add(y, R.sum(qkv, axis=[2], keepdims=True))
            R.output(z)
        return z


@I.ir_module
class ExpectedNK:  # the (N, K) kernel on the weights themselves, the transposes gone
    @R.function(private=True)
    def main_n1(
        x: R.Tensor((1, 1, 64), "float16"),
        a: R.Tensor((1, 1, 64), "float16"),
        wqkv: R.Tensor((192, 64), "float16"),
        wo: R.Tensor((64, 64), "float16"),
        wd: R.Tensor((64, 32), "float16"),
        m: R.Tensor((1, 1, 32), "float16"),
    ) -> R.Tensor((1, 1, 64), "float16"):
        R.func_attr({"relaxtune.bucket": {"n": [1, 1, 1]}})
        with R.dataflow():
            qkv = R.call_dps_packed("relaxtune_gemv_nk", (x, wqkv), out_ty=R.Tensor((1, 1, 192), "float16"))
            h = R.call_dps_packed("relaxtune_gemv_nk_add", (a, wo, x), out_ty=R.Tensor((1, 1, 64), "float16"))
            y = R.call_dps_packed("relaxtune_gemv_nk_add", (m, wd, h), out_ty=R.Tensor((1, 1, 64), "float16"))
            z = R.add(y, R.sum(qkv, axis=[2], keepdims=True))
            R.output(z)
        return z


def test_gemvs_on_weights_kept_nk_take_the_nk_kernel():
    tvm.ir.assert_structural_equal(RewriteGemvToCuda()(BeforeNK), ExpectedNK)
    # the (K, N) kernel's width limit is not the (N, K) one's (None: every width)
    assert 'relaxtune_gemv_nk"' in RewriteGemvToCuda(max_cols=64)(BeforeNK).script()
    assert "R.permute_dims(wqkv" in RewriteGemvToCuda(max_cols_nk=64)(BeforeNK).script()


def test_does_not_fire_on_large_buckets_fp32_computed_weights_or_odd_widths():
    tvm.ir.assert_structural_equal(RewriteGemvToCuda()(Untouched), Untouched)
    assert (
        "relaxtune_gemv" in RewriteGemvToCuda(max_rows=16)(Untouched)["main_n9_16"].script()
    )  # the bucket's upper bound decides
    narrow = RewriteGemvToCuda(max_cols=64)(Before).script()  # the qkv projection (192 outputs) stays a matmul
    assert "R.matmul(x, wqkv" in narrow and narrow.count("relaxtune_gemv_add") == 2


def test_defaults_keep_wide_gemvs_and_buckets_beyond_two_rows_on_cublas():
    @I.ir_module
    class Wide:
        @R.function(private=True)
        def main_n1(x: R.Tensor((1, 1, 64), "float16"), w: R.Tensor((64, 16392), "float16")) -> R.Tensor(
            (1, 1, 16392), "float16"
        ):
            R.func_attr({"relaxtune.bucket": {"n": [1, 1, 1]}})
            with R.dataflow():
                y = R.matmul(x, w)
                R.output(y)
            return y

        @R.function(private=True)
        def main_n3_4(x: R.Tensor((1, "n", 64), "float16"), w: R.Tensor((64, 64), "float16")) -> R.Tensor(
            (1, "n", 64), "float16"
        ):
            R.func_attr({"relaxtune.bucket": {"n": [3, 4, 4]}})
            with R.dataflow():
                y = R.matmul(x, w)
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(RewriteGemvToCuda()(Wide), Wide)
    both = RewriteGemvToCuda(max_rows=4, max_cols=None)(Wide)
    assert all("relaxtune_gemv" in both[name].script() for name in ("main_n1", "main_n3_4"))


def test_a_product_with_a_second_use_keeps_its_add():
    @I.ir_module
    class TwoUses:
        @R.function(private=True)
        def main_n1(x: R.Tensor((1, 1, 64), "float16"), w: R.Tensor((64, 64), "float16")) -> R.Tuple(
            R.Tensor((1, 1, 64), "float16"), R.Tensor((1, 1, 64), "float16")
        ):
            R.func_attr({"relaxtune.bucket": {"n": [1, 1, 1]}})
            with R.dataflow():
                o = R.matmul(x, w)
                h = R.add(x, o)
                R.output(h, o)
            return (h, o)

    text = RewriteGemvToCuda()(TwoUses).script()
    assert "relaxtune_gemv" in text and "relaxtune_gemv_add" not in text and "R.add(x, o)" in text
    assert "relaxtune_gemv_add" not in RewriteGemvToCuda(residual=False)(Before).script()


def test_gemv_passes_follow_the_cublas_option_and_the_arch(chosen_passes):
    def target(arch):
        return tvm.target.Target({"kind": "cuda", "arch": arch})

    def gemv_passes(target, libraries=CudaLibraries()):
        return chosen_passes(target, CompileConfig(cublas=libraries), "RewriteGemvToCuda")

    assert [type(p) for p in gemv_passes(target("sm_90"))] == [RewriteGemvToCuda]
    assert gemv_passes(target("sm_90"), CudaLibraries(gemv_max_rows=4))[0].max_rows == 4
    assert gemv_passes(target("sm_90"), CudaLibraries(gemv=False)) == [] and gemv_passes(target("sm_90"), False) == []
    assert gemv_passes(target("sm_75")) == [] and gemv_passes(tvm.target.Target("llvm")) == []


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_kernel_assembles_without_spills(tmp_path, arch):
    from relaxtune.kernels.gemv import KERNEL_SOURCE, nvcc_command

    src = tmp_path / "gemv.cu"
    src.write_text(KERNEL_SOURCE)
    done = subprocess.run(
        nvcc_command(arch, src, tmp_path / "gemv.fatbin", extra=("-Xptxas", "-v")), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = re.findall(r"Compiling entry function '(\w+)'", done.stderr)
    # fp16 and bf16: 1 / 2 / 4 / 8 rows (256 threads), and 1 / 2 rows with 512 threads (one block per SM);
    # the (N, K) kernel for 1 / 2 / 4 rows
    expected = {f"relaxtune_gemv_{t}_m{m}" for t in ("f16", "bf16") for m in (1, 2, 4, 8)} | {
        f"relaxtune_gemv_{t}_m{m}_wide" for t in ("f16", "bf16") for m in (1, 2)
    }
    expected |= {
        f"relaxtune_gemv_nk_{t}_m{m}{w}" for t in ("f16", "bf16") for m in (1, 2, 4) for w in ("", "_narrow")
    }  # the (N, K) kernel: 512 / 256 threads
    expected |= {
        f"relaxtune_gemv_nk_{x}_{t}_m{m}{w}"
        for x in ("rms", "swiglu", "glu", "rms_glu", "attn")
        for t in ("f16", "bf16")
        for m in (1, 2)
        for w in ("", "_narrow")
    }  # with an x prologue (fuse_gemv_prologue_cuda.py, fuse_attention_gemv_cuda.py) and / or the SwiGLU epilogue
    expected |= {"relaxtune_q4gemv_f16_m1", "relaxtune_q4gemv_f16_m2"}  # 4-bit weights (qgemv.cu, its own tests)
    expected |= set(Q4_STREAM_KERNELS)  # 4-bit weights streamed (qgemv_stream.cu, test_quant_gemv_cuda.py)
    expected |= set(Q4_MLP_KERNELS)  # the 4-bit decode MLP (qmlp_stream.cu, test_quant_gemv_cuda.py)
    assert sorted(kernels) == sorted(expected), kernels
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    assert len(spills) == len(expected) and all(s == ("0", "0") for s in spills), done.stderr[-3000:]
    # the launch bounds hold: <= 128 registers (2 blocks of 256 threads, or 1 of 512, per SM); the streamed 4-bit
    # kernels (one block of 288..800 threads per SM) are checked against theirs in test_quant_gemv_cuda.py
    registers = dict(re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", done.stderr, re.S))
    assert len(registers) == len(expected), registers
    assert max(int(r) for name, r in registers.items() if name not in Q4_STREAM_KERNELS) <= 128, registers
    assert "0 bytes stack frame" in done.stderr and not re.search(r"[1-9]\d* bytes stack frame", done.stderr)


@needs_nvcc
def test_kernels_wait_for_the_previous_kernel_and_reduce_the_split_with_one_cluster_barrier(tmp_path):
    from relaxtune.kernels.gemv import KERNEL_SOURCE, nvcc_command

    src = tmp_path / "gemv.cu"
    src.write_text(KERNEL_SOURCE)
    done = subprocess.run(
        nvcc_command("sm_90", src, tmp_path / "gemv.ptx", kind="--ptx"), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = (tmp_path / "gemv.ptx").read_text()
    bodies = dict(re.findall(r"\.entry (\w+)\((.*?)\n}", ptx, re.S))
    whole = dict(
        re.findall(r"\.entry (\w+)\((.*?)(?=\.entry|\Z)", ptx, re.S)
    )  # to the next kernel (inline asm has braces)
    # 26 plain GEMVs, 40 with an x prologue and / or the SwiGLU epilogue (rms, swiglu, glu, rms_glu, attn), the
    # streamed 4-bit ones, the 4-bit MLP ones
    assert len(bodies) == 66 + len(Q4_STREAM_KERNELS) + len(Q4_MLP_KERNELS), sorted(bodies)
    assert len(whole) == len(bodies), sorted(whole)
    for name, body in bodies.items():
        if "_q4gemv_" in name or "_q4mlp_" in name:  # the 4-bit kernels: test_quant_gemv_cuda.py
            continue
        assert (
            f".maxntid {512 if name.endswith('_wide') or ('_nk_' in name and not name.endswith('_narrow')) else 256}, "
            "1, 1" in body
        ), name
        assert body.count("griddepcontrol.wait") == 1, (
            name
        )  # programmatic dependent launch: once, after the first weight loads
        assert body.index("griddepcontrol.wait") > body.index("ld.global.nc.L1::no_allocate.v4.u32"), name
        if "_nk_" in name:  # no split of K, no shared memory: a warp's shuffles reduce each feature
            body = whole[name]
            assert "barrier.cluster" not in body and "shfl.sync.bfly" in body, name
            # 2 features x 4 vectors loaded before the wait; 8 more per chunk in the loop
            assert body[: body.index("griddepcontrol.wait")].count("ld.global.nc.L1::no_allocate.v4.u32") == 8, name
            if "_f16_" in name:  # the 8 products of a vector summed in fp16 (HFMA2), then added in fp32
                assert "fma.rn.f16x2" in body, name
            after = body[body.index("griddepcontrol.wait") :]
            if "_rms_" in name or "_swiglu_" in name or "_attn_" in name:  # x into shared memory after the wait
                assert "ld.global.nc.v4" in after and "st.shared.v4" in after and "ld.shared.v4" in after, name
                assert "bar.sync" in after and "ld.global.nc.v4" not in body[: body.index("griddepcontrol.wait")]
            else:  # x through L1 (the plain and the SwiGLU-epilogue kernels), no shared memory, no barrier
                assert "bar.sync" not in body, name
                assert "ld.global.nc.v4" in after and ".shared" not in body, name
            continue
        # the "every block has started" phase arrived at early, then one full barrier (was two cluster.sync)
        assert (
            body.count("barrier.cluster.arrive.relaxed.aligned") == 1
            and body.count("barrier.cluster.wait.aligned") == 1
        ), name
        assert (
            len(re.findall(r"barrier\.cluster\.arrive;", body)) == 1
            and len(re.findall(r"barrier\.cluster\.wait;", body)) == 1
        ), name
    for name in (
        "relaxtune_gemv_f16_m1_wide",
        "relaxtune_gemv_bf16_m1",
    ):  # 8 rows of 16-byte weight vectors before the loop, 8 in it
        assert bodies[name].count("ld.global.nc.L1::no_allocate.v4.u32") == 16, name


@needs_nvcc
def test_host_object_exports_the_entry_points(tmp_path):
    from relaxtune.kernels.gemv import (
        ADD_FUNCTION,
        CONFIG_FUNCTION,
        FUNCTION,
        NK_ADD_FUNCTION,
        NK_FUNCTION,
        NK_RMS_FUNCTION,
        NK_SWIGLU_ADD_FUNCTION,
        NK_SWIGLU_FUNCTION,
        object_file,
    )

    symbols = subprocess.run(
        ["nm", "-g", "--defined-only", str(object_file("sm_90", tmp_path))], capture_output=True, text=True
    ).stdout
    for name in (
        FUNCTION,
        ADD_FUNCTION,
        CONFIG_FUNCTION,
        NK_FUNCTION,
        NK_ADD_FUNCTION,
        NK_RMS_FUNCTION,
        NK_SWIGLU_FUNCTION,
        NK_SWIGLU_ADD_FUNCTION,
    ):
        assert f"__tvm_ffi_{name}" in symbols, name
    with pytest.raises(ValueError, match="sm_80 or newer, not sm_75"):
        object_file("sm_75", tmp_path)
