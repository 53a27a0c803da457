"""RowSoftmax (schedules/rules/gpu_row_softmax.py) without a GPU: the compute definition's numbers
on the CPU, the CUDA schedule's structure, and its source through nvcc for sm_90.

Its speed comes from benchmarks/gpu_job.py on the device (the softmax_bias row of the kernel table).
"""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import tvm
from tvm import te, tirx, topi

from relaxtune import targets
from relaxtune.kernels import device_code as cdc
from relaxtune.relax_passes.cublas_batched_gemm import _softmax_bias
from relaxtune.schedules.rules.gpu_row_softmax import RowSoftmax

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit")
I64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731 - Relax legalizes with int64 shapes


def _biased(heads: int = 4, static: int | None = None) -> tirx.PrimFunc:
    """softmax_bias as RewriteBatchedGemmToCublas emits it: (1, h, n, m) scores + (n, m) mask."""
    n = tirx.Var("n", "int64")
    m = I64(static) if static else tirx.Var("m", "int64")
    s = te.placeholder((I64(1), I64(heads), n, m), "float16", "s")
    b = te.placeholder((n, m), "float16", "b")
    return te.create_prim_func([s, b, _softmax_bias(s, b)])


def _plain(dtype: str = "float16", axis: int = -1) -> tirx.PrimFunc:
    """R.nn.softmax as LegalizeOps writes it (topi, in its own dtype)."""
    n = tirx.Var("n", "int64")
    x = te.placeholder((I64(1), I64(4), n, n), dtype, "x")
    return te.create_prim_func([x, topi.nn.softmax(x, axis=axis)])


def _schedule(func: tirx.PrimFunc) -> tvm.IRModule | None:
    target = targets.resolve("cuda").target
    with target:
        sch = RowSoftmax().apply(func.with_attr("global_symbol", "main"), target, False)
    return None if sch is None else sch.mod


def test_softmax_bias_compute_matches_numpy_with_a_causal_mask():
    """fp32 max/sum: rows of 300 random fp16 scores, the masked part at fp16's minimum."""
    func = _biased(heads=2)
    ex = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    rng = np.random.default_rng(0)
    n = 300
    s = (rng.standard_normal((1, 2, n, n)) * 4).astype("float16")
    mask = np.triu(np.full((n, n), np.finfo("float16").min, "float16"), 1)
    out = tvm.runtime.tensor(np.zeros_like(s))
    ex["main"](tvm.runtime.tensor(s), tvm.runtime.tensor(mask), out)
    z = s.astype("float64") + mask.astype("float64")
    ref = np.exp(z - z.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(out.numpy().astype("float64"), ref, atol=2e-3)
    assert np.all(out.numpy()[0, :, 0, 1:] == 0), "masked keys get probability 0"


@pytest.mark.parametrize("make", [_biased, _plain], ids=["softmax_bias", "softmax"])
def test_one_block_per_row_and_one_store_per_element(make):
    mod = _schedule(make())
    assert mod is not None
    script = mod.script()
    # rows on blockIdx.x, the key axis on 256 threads, the per-row max and sum in shared memory
    assert len(re.findall(r'thread="blockIdx.x"', script)) == 1
    assert re.search(r'T.thread_binding\(T.int64\(256\), thread="threadIdx.x"\)', script)
    assert script.count('scope="shared"') == 2
    src = cdc.cuda_sources(tvm.compile(mod, target=targets.resolve("cuda").target).mod)[0].decode()
    (kernel,) = set(re.findall(r"__global__ void __launch_bounds__\(256\) (\w+)\(", src))  # declaration + definition
    assert src.count("__shfl_down_sync") >= 2 * 5, "max and sum: warp-shuffle all-reduces"
    # one output block; in CUDA 8 unrolled stores per thread and chunk of 2048, once in the whole
    # chunks (no bound checks, LoopPartition) and once in the checked tail
    assert script.count('T.sblock("T_softmax_norm")') == 1 and kernel
    assert src.count("T_softmax_norm_ptr[") == 2 * 8
    assert "pragma_loop_partition_hint" in script and "T.unroll(T.int64(8))" in script


def test_static_row_length_writes_vectors():
    mod = _schedule(_biased(static=4096))
    # 16 bytes of fp32 math per thread (the scores' max and sum are fp32): 4 elements
    assert mod is not None and "T.vectorized(T.int64(4))" in mod.script()


def _rms_norm(width: int = 4096) -> tirx.PrimFunc:
    """R.nn.rms_norm as LegalizeOps writes it for fp16 (fp32 sum of squares, rsqrt, fp16 output)."""
    n = tirx.Var("n", "int64")
    x = te.placeholder((I64(1), n, I64(width)), "float16", "x")
    w = te.placeholder((I64(width),), "float16", "w")
    return te.create_prim_func([x, w, topi.nn.rms_norm(x, w, axis=[2])])


def test_rms_norm_reads_16_byte_vectors_in_the_reduction():
    mod = _schedule(_rms_norm())
    assert mod is not None
    script = mod.script()
    # the row into registers 8 fp16 at a time (local cache, vectorised), 2 vectors per thread of 256, unrolled
    assert 'scope="local"' in script and script.count("T.vectorized(T.int64(8))") == 1, script
    assert "T.unroll(T.int64(2))" in script and "T.unroll(T.int64(8))" in script
    assert script.count('scope="shared"') == 1  # the sum of squares, one per row
    # the output pass: 4 elements (16 bytes of fp32 math) per thread and step
    assert "T.vectorized(T.int64(4))" in script
    body = _kernel_body(_cuda(mod))
    assert body.count("*(uint4*)(x_ptr") == 2, "2 16-byte vectors per thread in the reduction"
    assert body.count("*(half4*)(x_ptr") == 1 and body.count("*(half4*)(T_cast_ptr") == 1 and "__shfl_down_sync" in body


def test_vector_bytes_0_keeps_scalar_reduction_loads():
    target = targets.resolve("cuda").target
    with target:
        sch = RowSoftmax(vector_bytes=0).apply(_rms_norm().with_attr("global_symbol", "main"), target, False)
    assert (
        sch is not None and 'scope="local"' not in sch.mod.script() and sch.mod.script().count("T.vectorized") == 1
    )  # the output pass only


def test_row_not_a_multiple_of_the_vectors_keeps_scalar_loads():
    mod = _schedule(_rms_norm(width=4000))
    assert mod is not None and 'scope="local"' not in mod.script()


def _cuda(mod) -> str:
    return cdc.cuda_sources(tvm.compile(mod, target=targets.resolve("cuda").target).mod)[0].decode()


def _kernel_body(src: str) -> str:
    return src[src.rindex('extern "C" __global__') :]


@needs_nvcc
@pytest.mark.parametrize(
    "make",
    [lambda: _biased(heads=32), _rms_norm, lambda: _biased(static=4096)],
    ids=["softmax_bias", "rms_norm", "static-softmax"],
)
def test_generated_cuda_compiles_for_sm_90(make, tmp_path):
    mod = _schedule(make())
    src = cdc.cuda_sources(tvm.compile(mod, target=targets.resolve("cuda").target).mod)[0].decode()
    (tmp_path / "k.cu").write_text(src)
    done = subprocess.run(
        ["nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), str(tmp_path / "k.cu")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def _row_sum() -> tirx.PrimFunc:
    n = tirx.Var("n", "int64")
    x = te.placeholder((n, I64(64)), "float32", "x")
    return te.create_prim_func([x, topi.sum(x, axis=-1)])


def _add() -> tirx.PrimFunc:
    n = tirx.Var("n", "int64")
    x = te.placeholder((n, I64(64)), "float16", "x")
    return te.create_prim_func([x, topi.add(x, x)])


def _col_sum_normalise() -> tirx.PrimFunc:
    """x / sum(x, axis=0): a reduction over the outer axis is not a row softmax."""
    n = tirx.Var("n", "int64")
    x = te.placeholder((n, I64(64)), "float32", "x")
    total = topi.sum(x, axis=0)
    return te.create_prim_func([x, te.compute(x.shape, lambda i, j: x[i, j] / total[j], name="norm")])


@pytest.mark.parametrize(
    "make",
    [_row_sum, _add, _col_sum_normalise, lambda: _plain(axis=1)],
    ids=["reduction", "elementwise", "column", "softmax-axis1"],
)
def test_does_not_apply(make):
    assert _schedule(make()) is None


def test_gpu_rules_try_it_before_general_reduction():
    from relaxtune.schedules.rules.gpu_rules import gpu_rules

    names = [type(rule.rule).__name__ for rule in gpu_rules()]
    assert names.index("RowSoftmax") < names.index("GeneralReduction")


@needs_nvcc
def test_tiny_llama_softmax_kernels_use_the_rule(tmp_path, monkeypatch):
    """fp16 llama-block for cuda: every softmax kernel (plain in small buckets, softmax_bias where
    attention is on cuBLAS) is scheduled by RowSoftmax, and the artifact builds for sm_90."""
    from relaxtune import api
    from relaxtune.config import CompileConfig, JobConfig
    from relaxtune.runtime import artifact
    from relaxtune.schedules.rules import gpu_rules
    from relaxtune.workloads import load, parse_config

    scheduled = []

    class Recording(RowSoftmax):
        def apply(self, func, target, tunable):
            sch = super().apply(func, target, tunable)
            if sch is not None:
                scheduled.append("T_softmax_norm" in sch.mod.script())
            return sch

    monkeypatch.setattr(gpu_rules, "RowSoftmax", Recording)
    workload = load(
        "llama-block", parse_config("hidden=64,heads=4,kv_heads=2,ffn=128,max_seq=128,max_batch=1"), "float16"
    )
    target = targets.resolve("cuda")
    job = JobConfig(compile=CompileConfig(use_cache=False))
    executable = api.build(workload, target, job)[0]
    src = "".join(s.decode() for s in cdc.cuda_sources(executable.mod))
    softmax = set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(softmax\w*)\(", src))
    assert {name.startswith("softmax_bias") for name in softmax} == {True, False}, softmax
    assert scheduled.count(True) == len(softmax), (scheduled, softmax)
    manifest = artifact.export(
        executable, workload, target, tmp_path / "llama.so", api.bucket_plan(workload, job), None, {}
    )
    assert manifest["device_code"]["format"] == "fatbin"  # nvcc compiled every kernel for sm_90
