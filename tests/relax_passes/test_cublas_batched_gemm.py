"""RewriteBatchedGemmToCublas (relax_passes/cublas_batched_gemm.py) and its kernel, without a GPU.

The kernel's stride and transpose logic is checked on the host against a stand-in libcublas
(tests/relax_passes/fake_cublas.c: cuBLAS's column-major semantics and leading-dimension checks
on host memory); the GPU numbers come from benchmarks/gpu_job.py on the device.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from relaxtune.config import CompileConfig, CudaLibraries
from relaxtune.relax_passes.cublas_batched_gemm import RewriteBatchedGemmToCublas
from relaxtune.relax_passes.cublas_gemm import RewriteGemmToCublas
from relaxtune.relax_passes.cublas_gemm_add import RewriteResidualAddToCublas


@I.ir_module
class AttentionBefore:  # DecomposeAttention's output for grouped-query attention (4 query heads, 2 kv heads)
    @R.function(private=True)
    def main_n65_128(
        q: R.Tensor((1, "n", 4, 16), "float16"),
        k: R.Tensor((1, "n", 2, 16), "float16"),
        v: R.Tensor((1, "n", 2, 16), "float16"),
        mask: R.Tensor(("n", "n"), "float16"),
    ) -> R.Tensor((1, "n", 4, 16), "float16"):
        R.func_attr({"relaxtune.bucket": {"n": [65, 128, 128]}})
        n = T.int64()
        with R.dataflow():
            kr = R.repeat(k, 2, axis=2)
            vr = R.repeat(v, 2, axis=2)
            qt = R.permute_dims(q, [0, 2, 1, 3])
            kt = R.permute_dims(kr, [0, 2, 3, 1])
            vt = R.permute_dims(vr, [0, 2, 1, 3])
            s = R.matmul(qt, kt)
            scaled = R.multiply(s, R.const(0.25, "float16"))
            masked = R.add(scaled, mask)
            p = R.nn.softmax(masked, axis=-1)
            o = R.matmul(p, vt)
            out = R.permute_dims(o, [0, 2, 1, 3])
            R.output(out)
        return out


@I.ir_module
class AttentionExpected:
    @T.prim_func(private=True, s_tir=True)
    def softmax_bias(var_s: T.handle, var_bias: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        s = T.match_buffer(var_s, (T.int64(1), T.int64(4), n, n), "float16")
        bias = T.match_buffer(var_bias, (n, n), "float16")
        T_softmax_norm = T.match_buffer(var_out, (T.int64(1), T.int64(4), n, n), "float16")
        # fp32 add, max and sum (the row softmax GPU rule inlines the add)
        T_add = T.sblock_alloc_buffer((T.int64(1), T.int64(4), n, n))
        T_softmax_maxelem = T.sblock_alloc_buffer((T.int64(1), T.int64(4), n))
        T_softmax_expsum = T.sblock_alloc_buffer((T.int64(1), T.int64(4), n))
        for i0, i1, i2, i3 in T.grid(T.int64(1), T.int64(4), n, n):
            with T.sblock("T_add"):
                v_i0, v_i1, v_i2, v_i3 = T.axis.remap("SSSS", [i0, i1, i2, i3])
                T_add[v_i0, v_i1, v_i2, v_i3] = T.Cast("float32", s[v_i0, v_i1, v_i2, v_i3]) + T.Cast(
                    "float32", bias[v_i2, v_i3]
                )
        for i0, i1, i2, k in T.grid(T.int64(1), T.int64(4), n, n):
            with T.sblock("T_softmax_maxelem"):
                v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
                with T.init():
                    T_softmax_maxelem[v_i0, v_i1, v_i2] = T.float32(-340282346638528859811704183484516925440.0)
                T_softmax_maxelem[v_i0, v_i1, v_i2] = T.max(
                    T_softmax_maxelem[v_i0, v_i1, v_i2], T_add[v_i0, v_i1, v_i2, v_k]
                )
        for i0, i1, i2, k in T.grid(T.int64(1), T.int64(4), n, n):
            with T.sblock("T_softmax_expsum"):
                v_i0, v_i1, v_i2, v_k = T.axis.remap("SSSR", [i0, i1, i2, k])
                with T.init():
                    T_softmax_expsum[v_i0, v_i1, v_i2] = T.float32(0.0)
                T_softmax_expsum[v_i0, v_i1, v_i2] = T_softmax_expsum[v_i0, v_i1, v_i2] + T.exp(
                    T_add[v_i0, v_i1, v_i2, v_k] - T_softmax_maxelem[v_i0, v_i1, v_i2]
                )
        for i0, i1, i2, i3 in T.grid(T.int64(1), T.int64(4), n, n):
            with T.sblock("T_softmax_norm"):
                v_i0, v_i1, v_i2, v_i3 = T.axis.remap("SSSS", [i0, i1, i2, i3])
                T.sblock_attr({"axis": 3})
                T_softmax_norm[v_i0, v_i1, v_i2, v_i3] = T.Cast(
                    "float16",
                    T.exp(T_add[v_i0, v_i1, v_i2, v_i3] - T_softmax_maxelem[v_i0, v_i1, v_i2])
                    / T_softmax_expsum[v_i0, v_i1, v_i2],
                )

    @R.function(private=True)
    def main_n65_128(
        q: R.Tensor((1, "n", 4, 16), "float16"),
        k: R.Tensor((1, "n", 2, 16), "float16"),
        v: R.Tensor((1, "n", 2, 16), "float16"),
        mask: R.Tensor(("n", "n"), "float16"),
    ) -> R.Tensor((1, "n", 4, 16), "float16"):
        R.func_attr({"relaxtune.bucket": {"n": [65, 128, 128]}})
        n = T.int64()
        cls = AttentionExpected
        with R.dataflow():
            kr = R.repeat(k, 2, axis=2)
            vr = R.repeat(v, 2, axis=2)
            # q and k read in place (transpose flags), the scale is cuBLAS's alpha
            scaled = R.call_dps_packed(
                "relaxtune_cublas_batched_gemm",
                (
                    q,
                    kr,
                    R.shape([0, 2, 1, 3]),
                    R.shape([0, 2, 3, 1]),
                    R.shape([0, 1, 2, 3]),
                    R.prim_value(T.float64(0.25)),
                ),
                out_ty=R.Tensor((1, 4, n, n), "float16"),
            )
            p = R.call_tir(
                cls.softmax_bias, (scaled, mask), out_ty=R.Tensor((1, 4, n, n), "float16")
            )  # the mask inside the softmax
            # written straight into the (b, n, h, d) layout the output permute_dims asked for
            out = R.call_dps_packed(
                "relaxtune_cublas_batched_gemm",
                (
                    p,
                    vr,
                    R.shape([0, 1, 2, 3]),
                    R.shape([0, 2, 1, 3]),
                    R.shape([0, 2, 1, 3]),
                    R.prim_value(T.float64(1.0)),
                ),
                out_ty=R.Tensor((1, n, 4, 16), "float16"),
            )
            R.output(out)
        return out


@I.ir_module
class Untouched:
    @R.function(private=True)
    def main_n2_64(q: R.Tensor((1, 4, "n", 16), "float16"), k: R.Tensor((1, 4, 16, "n"), "float16")) -> R.Tensor(
        (1, 4, "n", "n"), "float16"
    ):
        R.func_attr({"relaxtune.bucket": {"n": [2, 64, 64]}})  # lower bound 2 < min_rows 64: dlight's kernels stay
        with R.dataflow():
            s = R.matmul(q, k)
            R.output(s)
        return s

    @R.function(private=True)
    def main_n65_128(
        q: R.Tensor((1, 4, "n", 16), "float32"),
        k: R.Tensor((1, 4, 16, "n"), "float32"),
        x: R.Tensor((1, "n", 64), "float16"),
        w: R.Tensor((64, 32), "float16"),
        h: R.Tensor((1, 4, "n", 16), "float16"),
        g: R.Tensor((1, 1, 16, "n"), "float16"),
    ) -> R.Tuple(
        R.Tensor((1, 4, "n", "n"), "float32"),
        R.Tensor((1, "n", 32), "float16"),
        R.Tensor((1, "n", 32), "float16"),
        R.Tensor((1, 4, "n", "n"), "float16"),
    ):
        R.func_attr({"relaxtune.bucket": {"n": [65, 128, 128]}})
        n = T.int64()
        with R.dataflow():
            s = R.matmul(q, k)  # float32
            y = R.call_dps_packed(
                "relaxtune_cublas_gemm", (x, w), out_ty=R.Tensor((1, n, 32), "float16")
            )  # already cuBLAS
            z = R.matmul(x, w)  # a weight GEMM: RewriteGemmToCublas's
            b = R.matmul(h, g)  # broadcast batch dimension (1 vs 4)
            out = (s, y, z, b)
            R.output(out)
        return out


def test_attention_gemms_become_cublas_calls():
    tvm.ir.assert_structural_equal(RewriteBatchedGemmToCublas()(AttentionBefore), AttentionExpected)


def test_does_not_fire_on_small_buckets_fp32_weight_gemms_or_broadcasts():
    tvm.ir.assert_structural_equal(RewriteBatchedGemmToCublas()(Untouched), Untouched)
    # the threshold is the bucket's lower bound of n
    assert "relaxtune_cublas_batched_gemm" in RewriteBatchedGemmToCublas(min_rows=2)(Untouched)["main_n2_64"].script()
    assert "relaxtune_cublas_batched_gemm" not in RewriteBatchedGemmToCublas(dim="m", min_rows=2)(Untouched).script()
    # with both rewrites the weight GEMM goes to the 2-D kernel, never to the batched one
    both = tvm.transform.Sequential(
        [RewriteGemmToCublas(), RewriteResidualAddToCublas(), RewriteBatchedGemmToCublas()]
    )(Untouched)["main_n65_128"].script()
    assert both.count("relaxtune_cublas_gemm") == 2 and "relaxtune_cublas_batched_gemm" not in both


def test_every_bucket_gets_its_own_softmax_kernel():
    from tvm import relax

    func = AttentionBefore["main_n65_128"]
    mod = AttentionBefore.clone()
    mod[relax.GlobalVar("main_n129_256")] = func.with_attr("relaxtune.bucket", {"n": [129, 256, 256]})
    out = RewriteBatchedGemmToCublas()(mod)
    kernels = sorted(gv.name_hint for gv, f in out.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
    assert len(kernels) in (1, 2) and all(
        k.startswith("softmax_bias") for k in kernels
    )  # shared or renamed, never clashing
    for name in ("main_n65_128", "main_n129_256"):
        assert out[name].script().count("relaxtune_cublas_batched_gemm") == 2


def test_cublas_options(chosen_passes):
    cuda, names = (
        tvm.target.Target({"kind": "cuda", "arch": "sm_90"}),
        ("RewriteGemmToCublas", "RewriteResidualAddToCublas", "RewriteBatchedGemmToCublas"),
    )

    def types(libraries):
        return [type(p) for p in chosen_passes(cuda, CompileConfig(cublas=libraries), *names)]

    assert types(CudaLibraries()) == [RewriteGemmToCublas, RewriteResidualAddToCublas, RewriteBatchedGemmToCublas]
    assert types(CudaLibraries(min_rows=2, batched=False, residual=False)) == [RewriteGemmToCublas]
    (_gemm, _residual, batched) = chosen_passes(cuda, CompileConfig(cublas=CudaLibraries(batched_min_rows=17)), *names)
    assert batched.min_rows == 17 and RewriteBatchedGemmToCublas().min_rows == 64
    assert (
        types(CudaLibraries(enabled=False)) == []
        and chosen_passes(tvm.target.Target("llvm"), CompileConfig(), *names) == []
    )


# ---- the kernel on the host, through a stand-in libcublas
HOST_CHECK = r"""
import sys, numpy as np, tvm, tvm_ffi
from tvm import relax
rng = np.random.default_rng(0)
bmm = tvm_ffi.load_module(sys.argv[1])["relaxtune_cublas_batched_gemm"]

def case(a_shape, a_axes, b_shape, b_axes, c_axes, alpha=1.0):
    a, b = rng.standard_normal(a_shape).astype("float16"), rng.standard_normal(b_shape).astype("float16")
    want = alpha * (np.transpose(a, a_axes).astype("float32") @ np.transpose(b, b_axes).astype("float32"))
    c = tvm.runtime.empty([want.shape[c_axes.index(i)] for i in range(want.ndim)], "float16")
    axes = (tvm_ffi.Shape(a_axes), tvm_ffi.Shape(b_axes), tvm_ffi.Shape(c_axes))
    bmm(tvm.runtime.tensor(a), tvm.runtime.tensor(b), *axes, alpha, c)
    err = np.abs(np.transpose(c.numpy(), c_axes) - want).max() / np.abs(want).max()
    assert err < 3e-3, (a_shape, a_axes, b_shape, b_axes, c_axes, err)

n, h, d = 33, 3, 8
case((1, n, h, d), (0, 2, 1, 3), (1, n, h, d), (0, 2, 3, 1), (0, 1, 2, 3), 0.125)  # scores = q k^T, read in place
case((1, h, n, n), (0, 1, 2, 3), (1, n, h, d), (0, 2, 1, 3), (0, 2, 1, 3))  # p v, written as (b, n, h, d)
case((2, n, h, d), (0, 2, 1, 3), (2, n, h, d), (0, 2, 3, 1), (0, 1, 2, 3), 0.5)  # batch (b, h) does not merge: a loop
case((4, 7, 5), (0, 2, 1), (4, 6, 7), (0, 2, 1), (0, 1, 2))  # both operands transposed
case((6, 4, 7), (1, 0, 2), (4, 7, 6), (0, 1, 2), (1, 0, 2))  # batch axis in the middle, for c too
case((1, 1, h, d), (0, 2, 1, 3), (1, 5, h, d), (0, 2, 3, 1), (0, 1, 2, 3))  # one query row

# the weight GEMMs: w (K, N), and (N, K) read with a transpose flag
library = tvm_ffi.load_module(sys.argv[1])
for rows, k, cols in ((1, 24, 40), (37, 16, 8)):
    x, w = rng.standard_normal((1, rows, k)).astype("float16"), rng.standard_normal((k, cols)).astype("float16")
    want = x.astype("float32") @ w.astype("float32")
    for name, weight in (("relaxtune_cublas_gemm", w), ("relaxtune_cublas_gemm_nk", np.ascontiguousarray(w.T))):
        y = tvm.runtime.empty((1, rows, cols), "float16")
        library[name](tvm.runtime.tensor(x), tvm.runtime.tensor(weight), y)
        assert np.abs(y.numpy() - want).max() / np.abs(want).max() < 3e-3, (name, rows, k, cols)

# the rewritten module through the VM: axes as shapes, alpha as a float, the library function linked in
vm = relax.VirtualMachine(tvm.runtime.load_module(sys.argv[2]), tvm.cpu())
inputs = dict(np.load(sys.argv[3]))
out = vm["main"](*(tvm.runtime.tensor(inputs[k]) for k in ("q", "k", "v", "mask"))).numpy()
np.save(sys.argv[4], out)
"""


@I.ir_module
class Attention:  # the reference: AttentionBefore with fp32 accumulation, in TIR
    @R.function
    def main(
        q: R.Tensor((1, "n", 4, 16), "float16"),
        k: R.Tensor((1, "n", 2, 16), "float16"),
        v: R.Tensor((1, "n", 2, 16), "float16"),
        mask: R.Tensor(("n", "n"), "float16"),
    ) -> R.Tensor((1, "n", 4, 16), "float16"):
        with R.dataflow():
            kr = R.repeat(k, 2, axis=2)
            vr = R.repeat(v, 2, axis=2)
            s = R.matmul(R.permute_dims(q, [0, 2, 1, 3]), R.permute_dims(kr, [0, 2, 3, 1]), out_dtype="float32")
            masked = R.add(R.multiply(s, R.const(0.25, "float32")), R.astype(mask, "float32"))
            p = R.astype(R.nn.softmax(masked, axis=-1), "float16")
            o = R.permute_dims(R.matmul(p, R.permute_dims(vr, [0, 2, 1, 3]), out_dtype="float32"), [0, 2, 1, 3])
            out = R.astype(o, "float16")
            R.output(out)
        return out


@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("g++") is None, reason="no host C/C++ compiler")
def test_kernel_and_vm_call_against_a_host_cublas_stand_in(tmp_path):
    import tvm_ffi.libinfo
    from tvm import relax

    from relaxtune.kernels.cublas import object_file

    # the stand-in, under the soname the kernel dlopens
    fake = tmp_path / "libcublas.so.13"
    subprocess.run(
        [
            "gcc",
            "-O2",
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcublas.so.13",
            str(Path(__file__).with_name("fake_cublas.c")),
            "-o",
            str(fake),
        ],
        check=True,
    )
    obj = object_file(tmp_path)  # the addon source compiles with the host compiler
    ffi_lib = Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent
    kernel = tmp_path / "kernel.so"
    subprocess.run(
        ["g++", "-shared", str(obj), "-o", str(kernel), f"-L{ffi_lib}", "-ltvm_ffi", f"-Wl,-rpath,{ffi_lib}", "-ldl"],
        check=True,
    )

    rewritten = RewriteBatchedGemmToCublas()(_public(AttentionBefore["main_n65_128"]))
    assert (
        rewritten["main"].script().count("relaxtune_cublas_batched_gemm") == 2
        and "softmax_bias" in rewritten["main"].script()
    )
    so = tmp_path / "attention.so"
    tvm.compile(rewritten, target="llvm").export_library(str(so), addons=[str(obj)], options=["-ldl"])

    rng = np.random.default_rng(1)
    inputs = {
        "q": rng.standard_normal((1, 70, 4, 16)),
        "k": rng.standard_normal((1, 70, 2, 16)),
        "v": rng.standard_normal((1, 70, 2, 16)),
    }
    inputs["mask"] = np.triu(np.full((70, 70), -np.inf), 1)  # causal
    inputs = {k: v.astype("float16") for k, v in inputs.items()}
    np.savez(tmp_path / "in.npz", **inputs)
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}  # the stand-in is the libcublas.so.13 found first
    args = [str(kernel), str(so), str(tmp_path / "in.npz"), str(tmp_path / "out.npy")]
    done = subprocess.run([sys.executable, "-c", HOST_CHECK, *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    # the reference: the same attention in TIR, fp32 accumulation
    vm = relax.VirtualMachine(tvm.compile(Attention, target="llvm"), tvm.cpu())
    want = vm["main"](*(tvm.runtime.tensor(inputs[k]) for k in ("q", "k", "v", "mask"))).numpy().astype("float32")
    got = np.load(tmp_path / "out.npy").astype("float32")
    assert np.abs(got - want).max() < 2e-2, np.abs(got - want).max()


def _public(func) -> tvm.IRModule:
    """`func` as the public `main` of a module of its own (what the VM can call)."""
    from tvm import relax

    main = relax.Function(func.params, func.body, func.ret_ty, is_pure=True, attrs=func.attrs).with_attr(
        "global_symbol", "main"
    )
    return tvm.IRModule({relax.GlobalVar("main"): main})
