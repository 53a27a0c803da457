"""RewriteResidualAddToCublas (relax_passes/cublas_gemm_add.py) and its cuBLASLt kernel, without a GPU.

The rewrite is checked structurally (and where it must not fire); the kernel's layouts, alpha /
beta and separate C / D on the host against stand-ins for libcublasLt and libcuda
(tests/relax_passes/fake_cublaslt.c); the GPU numbers come from benchmarks/gpu_job.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from relaxtune.config import CompileConfig, CudaLibraries
from relaxtune.relax_passes.cublas_gemm import RewriteGemmToCublas
from relaxtune.relax_passes.cublas_gemm_add import RewriteResidualAddToCublas


@I.ir_module
class Before:  # the llama block's two residual adds, after RewriteGemmToCublas
    @R.function(private=True)
    def main_n17_128(
        x: R.Tensor((1, "n", 64), "float16"),
        a: R.Tensor((1, "n", 64), "float16"),
        wo: R.Tensor((64, 64), "float16"),
        m: R.Tensor((1, "n", 32), "float16"),
        wd: R.Tensor((32, 64), "float16"),
    ) -> R.Tensor((1, "n", 64), "float16"):
        R.func_attr({"relaxtune.bucket": {"n": [17, 128, 128]}})
        n = T.int64()
        with R.dataflow():
            o = R.call_dps_packed("relaxtune_cublas_gemm", (a, wo), out_ty=R.Tensor((1, n, 64), "float16"))
            h = R.add(x, o)
            d = R.call_dps_packed("relaxtune_cublas_gemm", (m, wd), out_ty=R.Tensor((1, n, 64), "float16"))
            y = R.add(d, h)  # the product first
            R.output(y)
        return y


@I.ir_module
class Expected:
    @R.function(private=True)
    def main_n17_128(
        x: R.Tensor((1, "n", 64), "float16"),
        a: R.Tensor((1, "n", 64), "float16"),
        wo: R.Tensor((64, 64), "float16"),
        m: R.Tensor((1, "n", 32), "float16"),
        wd: R.Tensor((32, 64), "float16"),
    ) -> R.Tensor((1, "n", 64), "float16"):
        R.func_attr({"relaxtune.bucket": {"n": [17, 128, 128]}})
        n = T.int64()
        with R.dataflow():
            h = R.call_dps_packed("relaxtune_cublas_gemm_add", (a, wo, x), out_ty=R.Tensor((1, n, 64), "float16"))
            y = R.call_dps_packed("relaxtune_cublas_gemm_add", (m, wd, h), out_ty=R.Tensor((1, n, 64), "float16"))
            R.output(y)
        return y


@I.ir_module
class Untouched:
    @R.function(private=True)
    def main_n17_128(
        x: R.Tensor((1, "n", 64), "float16"),
        a: R.Tensor((1, "n", 64), "float16"),
        wo: R.Tensor((64, 64), "float16"),
        bias: R.Tensor((64,), "float16"),
    ) -> R.Tuple(R.Tensor((1, "n", 64), "float16"), R.Tensor((1, "n", 64), "float16")):
        R.func_attr({"relaxtune.bucket": {"n": [17, 128, 128]}})
        n = T.int64()
        with R.dataflow():
            o = R.call_dps_packed("relaxtune_cublas_gemm", (a, wo), out_ty=R.Tensor((1, n, 64), "float16"))
            h = R.add(x, o)  # o is also returned: the un-added product is needed
            p = R.call_dps_packed("relaxtune_cublas_gemm", (a, wo), out_ty=R.Tensor((1, n, 64), "float16"))
            q = R.add(p, bias)  # a broadcast, not a residual
            s = R.add(x, a)  # no GEMM
            z = R.add(h, R.add(q, s))
            R.output(z, o)
        return (z, o)

    @R.function(private=True)
    def main_n2_16(
        x: R.Tensor((1, "n", 64), "float16"), a: R.Tensor((1, "n", 64), "float16"), wo: R.Tensor((64, 64), "float16")
    ) -> R.Tensor((1, "n", 64), "float16"):
        R.func_attr({"relaxtune.bucket": {"n": [2, 16, 16]}})  # below min_rows
        n = T.int64()
        with R.dataflow():
            o = R.call_dps_packed("relaxtune_cublas_gemm", (a, wo), out_ty=R.Tensor((1, n, 64), "float16"))
            h = R.add(x, o)
            R.output(h)
        return h


def test_residual_adds_become_gemm_epilogues():
    tvm.ir.assert_structural_equal(RewriteResidualAddToCublas()(Before), Expected)


def test_does_not_fire_where_the_product_has_another_use_on_broadcasts_or_small_buckets():
    tvm.ir.assert_structural_equal(RewriteResidualAddToCublas()(Untouched), Untouched)
    # the threshold is the bucket's lower bound
    assert "relaxtune_cublas_gemm_add" in RewriteResidualAddToCublas(min_rows=2)(Untouched)["main_n2_16"].script()


def test_the_pipeline_runs_the_residual_rewrite_after_the_gemm_rewrite(chosen_passes):
    cuda, names = (
        tvm.target.Target({"kind": "cuda", "arch": "sm_90"}),
        ("RewriteGemmToCublas", "RewriteResidualAddToCublas"),
    )
    passes = chosen_passes(cuda, CompileConfig(), *names)
    assert (
        isinstance(passes[0], RewriteGemmToCublas)
        and isinstance(passes[1], RewriteResidualAddToCublas)
        and passes[1].min_rows == 17
    )
    assert len(chosen_passes(cuda, CompileConfig(cublas=CudaLibraries(residual=False)), *names)) == 1
    assert chosen_passes(cuda, CompileConfig(cublas=CudaLibraries(residual_min_rows=2)), *names)[1].min_rows == 2


HOST_CHECK = r"""
import sys, ml_dtypes, numpy as np, tvm, tvm_ffi
rng = np.random.default_rng(0)
library = tvm_ffi.load_module(sys.argv[1])
cases = [(np.float16, (1, 37, 24, 40)), (np.float16, (2, 5, 16, 8)), (ml_dtypes.bfloat16, (1, 9, 32, 16))]
for (dtype, (b, n, k, cols)), nk in [(case, nk) for case in cases for nk in (False, True)]:
    # the weight (N, K) or (K, N)
    gemm_add = library["relaxtune_cublas_gemm_add_nk" if nk else "relaxtune_cublas_gemm_add"]
    x, w, r = (rng.standard_normal(s).astype(dtype) for s in ((b, n, k), (k, cols), (b, n, cols)))
    want = x.astype("float32") @ w.astype("float32") + r.astype("float32")
    y = tvm.runtime.tensor(np.full((b, n, cols), np.nan, dtype))
    weight = tvm.runtime.tensor(np.ascontiguousarray(w.T) if nk else w)
    gemm_add(tvm.runtime.tensor(x), weight, tvm.runtime.tensor(r), y)
    err = np.abs(y.numpy().astype("float32") - want).max() / np.abs(want).max()
    assert err < (3e-3 if dtype == np.float16 else 2e-2), (dtype, b, n, k, cols, nk, err)
    assert np.array_equal(r.astype("float32"), r.astype("float32"))  # r is read, never written
print("ok")
"""


@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("g++") is None, reason="no host C/C++ compiler")
def test_kernel_against_host_cublaslt_stand_in(tmp_path):
    import tvm_ffi.libinfo

    from relaxtune.kernels.cublas import object_file

    source = Path(__file__).with_name("fake_cublaslt.c")
    for soname in ("libcublasLt.so.13", "libcuda.so.1"):  # the stand-ins, under the sonames the kernel dlopens
        subprocess.run(
            ["gcc", "-O2", "-shared", "-fPIC", f"-Wl,-soname,{soname}", str(source), "-o", str(tmp_path / soname)],
            check=True,
        )
    ffi_lib = Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent
    kernel = tmp_path / "kernel.so"
    subprocess.run(
        [
            "g++",
            "-shared",
            str(object_file(tmp_path)),
            "-o",
            str(kernel),
            f"-L{ffi_lib}",
            "-ltvm_ffi",
            f"-Wl,-rpath,{ffi_lib}",
            "-ldl",
        ],
        check=True,
    )
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", HOST_CHECK, str(kernel)], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
