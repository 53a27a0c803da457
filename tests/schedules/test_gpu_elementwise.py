"""RowElementwise (schedules/rules/gpu_elementwise.py) without a GPU: which kernels it takes, the
structure of its CUDA schedule (rows on blocks, 16-byte vectors on threads, int32 indices where
the bounds allow), and its source through nvcc for sm_90.

Its speed comes from benchmarks/gpu_job.py on the device (the llama7b-rf-cublas-flash vs -prev rows).
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import tvm
from tvm import te, tirx, topi

from relaxtune import targets
from relaxtune.kernels import device_code as cdc
from relaxtune.schedules.rules.gpu_elementwise import RowElementwise
from relaxtune.schedules.rules.var_bounds import BOUND_ATTR, annotate_var_bounds

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA toolkit")
I64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731 - Relax legalizes with int64 shapes


def _silu_mul(ffn: int = 11008) -> tirx.PrimFunc:
    """silu(gate) * up on the merged gate/up projection, as FuseTIR writes it (slices, sigmoid, products)."""
    n = tirx.Var("n", "int64")
    lv = te.placeholder((I64(1), n, I64(2 * ffn)), "float16", "lv10")
    gate = te.compute((I64(1), n, I64(ffn)), lambda a, b, c: lv[a, b, c], name="gate")
    sig = te.compute(gate.shape, lambda a, b, c: tirx.sigmoid(gate[a, b, c]), name="compute")
    silu = te.compute(gate.shape, lambda a, b, c: gate[a, b, c] * sig[a, b, c], name="silu")
    up = te.compute(gate.shape, lambda a, b, c: lv[a, b, c + I64(ffn)], name="up")
    out = te.compute(gate.shape, lambda a, b, c: silu[a, b, c] * up[a, b, c], name="T_multiply1")
    return te.create_prim_func([lv, out])


def _add(width: int = 4096, static_n: int | None = None) -> tirx.PrimFunc:
    n = I64(static_n) if static_n else tirx.Var("n", "int64")
    x = te.placeholder((I64(1), n, I64(width)), "float16", "x")
    y = te.placeholder((I64(1), n, I64(width)), "float16", "y")
    return te.create_prim_func([x, y, topi.add(x, y)])


def _rope(heads: int = 32, dim: int = 128, split: int | None = None) -> tirx.PrimFunc:
    """k's rotate-half RoPE reading the merged q/k/v projection (1, n, 3h, d) and (1, n, 1, d) tables;
    `split`: the column where the select switches (d / 2 for RoPE)."""
    n = tirx.Var("n", "int64")
    qkv = te.placeholder((I64(1), n, I64(3 * heads), I64(dim)), "float16", "lv4")
    cos = te.placeholder((I64(1), n, I64(1), I64(dim)), "float16", "cos")
    sin = te.placeholder((I64(1), n, I64(1), I64(dim)), "float16", "sin")
    half = dim // 2
    split = half if split is None else split

    def body(a, s, h, d):
        k = lambda j: qkv[a, s, h + I64(heads), j]  # noqa: E731
        rot = tirx.if_then_else(d >= I64(split), k(d - I64(half)), -k(d + I64(half)))
        return k(d) * cos[a, s, I64(0), d] + rot * sin[a, s, I64(0), d]

    out = te.compute((I64(1), n, I64(heads), I64(dim)), body, name="T_add")
    return te.create_prim_func([qkv, cos, sin, out])


def _schedule(func: tirx.PrimFunc, bound: int | None = 2048):
    target = targets.resolve("cuda").target
    func = func.with_attr("global_symbol", "main")
    if bound is not None:
        func = func.with_attr(BOUND_ATTR, {"n": bound})
    with target:
        sch = RowElementwise().apply(func, target, False)
    return None if sch is None else sch.mod


def _cuda(mod) -> str:
    return cdc.cuda_sources(tvm.compile(mod, target=targets.resolve("cuda").target).mod)[0].decode()


def _kernel_body(src: str) -> str:
    return src[src.rindex('extern "C" __global__') :]


def test_silu_mul_rows_on_blocks_vectors_on_threads_int32():
    mod = _schedule(_silu_mul())
    assert mod is not None
    script = mod.script()
    assert 'thread="blockIdx.x"' in script and 'T.thread_binding(11, thread="blockIdx.y")' in script
    assert 'T.thread_binding(128, thread="threadIdx.x")' in script and "T.vectorized(8)" in script
    assert "int64" not in script, "n <= 2048: every index narrowed to int32"
    body = _kernel_body(_cuda(mod))
    assert "int64_t" not in body and "int n)" in body
    assert body.count("*(uint4*)(lv10_ptr") == 2, "gate and up: one 16-byte load each"
    assert body.count("*(uint4*)(T_multiply1_ptr") == 1, "one 16-byte store"
    assert not re.search(r"[/%] *\(?(\(int\))?11008", body) and "/ 11008" not in body, "no division by the row length"


def test_add_without_a_bound_keeps_int64_indices():
    mod = _schedule(_add(), bound=None)
    assert mod is not None
    script = mod.script()
    assert "T.vectorized(T.int64(8))" in script and 'T.thread_binding(T.int64(512), thread="threadIdx.x")' in script
    body = _kernel_body(_cuda(mod))
    assert "int64_t n" in body and body.count("*(uint4*)") == 3


def test_static_add_is_narrowed_without_a_bound():
    mod = _schedule(_add(static_n=1), bound=None)
    assert mod is not None and "int64" not in mod.script()


def test_short_rows_are_packed_into_blocks():
    mod = _schedule(_add(width=128))
    assert mod is not None
    script = mod.script()
    # 16 vectors of 8 per 128-wide row: 16 rows per block of 256 threads
    assert 'T.thread_binding(256, thread="threadIdx.x")' in script and "T.vectorized(8)" in script
    assert '"blockIdx.y"' not in script


def test_rope_is_scheduled_per_half_with_16_byte_vectors():
    mod = _schedule(_rope())
    assert mod is not None
    script = mod.script()
    # 32 rows (head rows) per block on threadIdx.y, each half's 8 vectors of 8 on threadIdx.x
    assert (
        'T.thread_binding(32, thread="threadIdx.y")' in script
        and script.count('T.thread_binding(8, thread="threadIdx.x")') == 2
    ), script
    assert script.count("T.vectorized(8)") == 2 and "int64" not in script
    body = _kernel_body(_cuda(mod))
    assert "?" not in body and "if_then_else" not in body, "each half's select folded away"
    assert body.count("*(uint4*)(T_add_ptr") == 2, "one 16-byte store per half"
    assert body.count("*(uint4*)(lv4_ptr") == 4, "k and its rotation partner, 16 bytes each, per half"


def test_rope_halves_off_declines_it():
    target = targets.resolve("cuda").target
    with target:
        assert RowElementwise(halves=False).apply(_rope().with_attr("global_symbol", "main"), target, False) is None


@needs_nvcc
@pytest.mark.parametrize(
    "make", [_silu_mul, _add, lambda: _add(width=128), _rope], ids=["silu_mul", "add", "short-rows", "rope"]
)
def test_generated_cuda_compiles_for_sm_90(make, tmp_path):
    src = _cuda(_schedule(make()))
    (tmp_path / "k.cu").write_text(src)
    done = subprocess.run(
        ["nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), str(tmp_path / "k.cu")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def _row_sum() -> tirx.PrimFunc:
    n = tirx.Var("n", "int64")
    x = te.placeholder((n, I64(64)), "float16", "x")
    return te.create_prim_func([x, topi.sum(x, axis=-1)])


def _rms_norm() -> tirx.PrimFunc:
    n = tirx.Var("n", "int64")
    x = te.placeholder((I64(1), n, I64(4096)), "float16", "x")
    w = te.placeholder((I64(4096),), "float16", "w")
    return te.create_prim_func([x, w, topi.nn.rms_norm(x, w, axis=[2])])


def _transpose() -> tirx.PrimFunc:
    x = te.placeholder((I64(4096), I64(11008)), "float16", "x")
    return te.create_prim_func([x, topi.transpose(x, [1, 0])])


def _symbolic_last() -> tirx.PrimFunc:
    n = tirx.Var("n", "int64")
    x = te.placeholder((I64(4), n), "float16", "x")
    return te.create_prim_func([x, topi.add(x, x)])


def _strided_last() -> tirx.PrimFunc:
    """Every other element along the last axis: not contiguous."""
    n = tirx.Var("n", "int64")
    x = te.placeholder((n, I64(128)), "float16", "x")
    return te.create_prim_func([x, te.compute((n, I64(64)), lambda i, j: x[i, j * I64(2)], name="y")])


@pytest.mark.parametrize(
    "make",
    [_row_sum, _rms_norm, _transpose, _symbolic_last, _strided_last, lambda: _rope(split=32)],
    ids=[
        "reduction",
        "rms_norm",
        "transpose",
        "symbolic-last-axis",
        "strided-last-axis",
        "select-not-constant-per-half",
    ],
)
def test_does_not_apply(make):
    assert _schedule(make()) is None


def test_gpu_rules_try_it_before_dlight_fallback():
    from relaxtune.schedules.rules.gpu_rules import gpu_rules

    names = [type(rule.rule).__name__ for rule in gpu_rules()]
    assert names.index("RowElementwise") < names.index("Fallback")


def test_annotate_var_bounds_takes_the_largest_caller_bound():
    """Two bucket functions call one kernel with n <= 16 and n <= 2048: the kernel gets n <= 2048."""
    from tvm import relax

    bb = relax.BlockBuilder()
    kernel = None
    for hi in (16, 2048):
        n = tirx.Var("n", "int64")
        x = relax.Var("x", relax.TensorType((1, n, 4096), "float16"))
        with bb.function(f"main_{hi}", [x], attrs={"tir_var_upper_bound": {"n": hi}, "tir_var_lower_bound": {"n": 1}}):
            with bb.dataflow():
                if kernel is None:
                    kernel = bb.add_func(_add().with_attr("global_symbol", "add"), "add")
                out = bb.emit_output(relax.call_tir(kernel, [x, x], relax.TensorType((1, n, 4096), "float16")))
            bb.emit_func_output(out)
    mod = annotate_var_bounds(bb.get())
    assert {k: int(v) for k, v in mod["add"].attrs[BOUND_ATTR].items()} == {"n": 2048}


@needs_nvcc
def test_tiny_llama_elementwise_kernels_use_the_rule(tmp_path, monkeypatch):
    """fp16 llama-block for cuda: silu(gate) * up, the residual adds and k's RoPE are scheduled by
    RowElementwise with int32 indices, and the artifact builds for sm_90."""
    from relaxtune import api
    from relaxtune.config import CompileConfig, JobConfig
    from relaxtune.runtime import artifact
    from relaxtune.schedules.rules import gpu_rules
    from relaxtune.workloads import load, parse_config

    scheduled = []

    class Recording(RowElementwise):
        def apply(self, func, target, tunable):
            sch = super().apply(func, target, tunable)
            if sch is not None:
                scheduled.append(sch.mod.script())
            return sch

    monkeypatch.setattr(gpu_rules, "RowElementwise", Recording)
    workload = load(
        "llama-block", parse_config("hidden=64,heads=4,kv_heads=2,ffn=128,max_seq=128,max_batch=1"), "float16"
    )
    target = targets.resolve("cuda")
    job = JobConfig(compile=CompileConfig(use_cache=False))
    executable = api.build(workload, target, job)[0]
    assert any("T.sigmoid" in s for s in scheduled), "silu(gate) * up"
    assert any('T.sblock("T_add")' in s and "T.sigmoid" not in s for s in scheduled), "residual add"
    assert any("threadIdx.y" in s and "T.if_then_else" in s for s in scheduled), "k's RoPE, per half"
    # max_seq 128: int32 indices everywhere, except in kernels with a scalar n parameter (kept int64):
    # the rotary table slices here (head_dim 16 has no flash kernel, so q's and k's rotation both read them)
    assert all("int64" not in s for s in scheduled if "n: T.int64," not in s), "max_seq 128: int32 indices"
    src = "".join(s.decode() for s in cdc.cuda_sources(executable.mod))
    assert "uint4" in src
    manifest = artifact.export(
        executable, workload, target, tmp_path / "llama.so", api.bucket_plan(workload, job), None, {}
    )
    assert manifest["device_code"]["format"] == "fatbin"
