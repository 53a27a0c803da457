"""RewriteAttentionToFlash (relax_passes/flash_attention_cuda.py) and its kernel, without a GPU.

The rewrite is checked structurally, the kernel by nvcc compiling it for sm_90 and by a
cross-compiled fp16 llama-block artifact that calls it; its numbers come from the GPU
(benchmarks/flash_check.py, a section of benchmarks/gpu_job.py run).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from relaxtune.kernels import flash_attention as cfa
from relaxtune.relax_passes.flash_attention_cuda import RewriteAttentionToFlash

needs_nvcc = pytest.mark.skipif(
    shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"), reason="no CUDA toolkit"
)


@I.ir_module
class Before:  # grouped-query causal attention as the llama block emits it (4 query heads, 2 kv heads)
    @R.function(private=True)
    def main_n65_128(
        q: R.Tensor((1, "n", 4, 64), "float16"),
        k: R.Tensor((1, "n", 2, 64), "float16"),
        v: R.Tensor((1, "n", 2, 64), "float16"),
    ) -> R.Tensor((1, "n", 4, 64), "float16"):
        R.func_attr({"relaxtune.bucket": {"n": [65, 128, 128]}})
        with R.dataflow():
            kr = R.repeat(k, 2, axis=2)
            vr = R.repeat(v, 2, axis=2)
            o = R.nn.attention(q, kr, vr, causal_mask="TopLeft")
            R.output(o)
        return o


@I.ir_module
class Expected:
    @R.function(private=True)
    def main_n65_128(
        q: R.Tensor((1, "n", 4, 64), "float16"),
        k: R.Tensor((1, "n", 2, 64), "float16"),
        v: R.Tensor((1, "n", 2, 64), "float16"),
    ) -> R.Tensor((1, "n", 4, 64), "float16"):
        R.func_attr({"relaxtune.bucket": {"n": [65, 128, 128]}})
        n = T.int64()
        with R.dataflow():
            # the kv heads read in place (query head h -> kv head h / 2): the repeats are gone
            o = R.call_dps_packed(
                "relaxtune_flash_attention",
                (q, k, v, R.prim_value(T.int64(1)), R.prim_value(T.float64(0.125)), R.prim_value(T.int64(0))),
                out_ty=R.Tensor((1, n, 4, 64), "float16"),
            )
            R.output(o)
        return o


def test_causal_gqa_attention_becomes_one_flash_call():
    tvm.ir.assert_structural_equal(RewriteAttentionToFlash("sm_90")(Before), Expected)


@I.ir_module
class MergedBefore:  # q, k, v as head slices of the merged projection (MergeProjections on GPU)
    @R.function
    def main(qkv: R.Tensor((1, "n", 8, 64), "float16")) -> R.Tensor((1, "n", 4, 64), "float16"):
        with R.dataflow():
            q = R.strided_slice(qkv, axes=[2], begin=[0], end=[4])
            k = R.strided_slice(qkv, axes=[2], begin=[4], end=[6])
            v = R.strided_slice(qkv, axes=[2], begin=[6], end=[8])
            o = R.nn.attention(q, R.repeat(k, 2, axis=2), R.repeat(v, 2, axis=2), causal_mask="TopLeft")
            R.output(o)
        return o


@I.ir_module
class MergedExpected:
    @R.function
    def main(qkv: R.Tensor((1, "n", 8, 64), "float16")) -> R.Tensor((1, "n", 4, 64), "float16"):
        n = T.int64()
        with R.dataflow():
            # no slice copies: heads (q_head0, k_head0, v_head0, kv_heads) of the one tensor
            o = R.call_dps_packed(
                "relaxtune_flash_attention_in_place",
                (
                    qkv,
                    qkv,
                    qkv,
                    R.shape([0, 4, 6, 2]),
                    R.prim_value(T.int64(1)),
                    R.prim_value(T.float64(0.125)),
                    R.prim_value(T.int64(0)),
                ),
                out_ty=R.Tensor((1, n, 4, 64), "float16"),
            )
            R.output(o)
        return o


def test_head_slices_are_read_in_place():
    tvm.ir.assert_structural_equal(RewriteAttentionToFlash("sm_90")(MergedBefore), MergedExpected)
    plain = RewriteAttentionToFlash("sm_90", in_place=False)(MergedBefore)["main"].script()
    assert '"relaxtune_flash_attention", (q, k, v,' in plain and "repeat" not in plain


def _llama_block_fused(flash=None) -> tvm.IRModule:
    from relaxtune import api, targets
    from relaxtune.config import CompileConfig, CudaLibraries, FlashAttention, JobConfig
    from relaxtune.relax_passes.pipeline import fusion_passes
    from relaxtune.workloads import load, parse_config

    workload = load(
        "llama-block", parse_config("hidden=256,heads=4,kv_heads=2,ffn=128,max_seq=128,max_batch=1"), "float16"
    )
    target = targets.resolve("cuda")
    plan = api.bucket_plan(workload, JobConfig(compile=CompileConfig(use_cache=False)))
    options = CompileConfig(
        cublas=CudaLibraries(gemv=False, weights_nk=False), flash_attention=flash or FlashAttention()
    )
    with target.target:
        return tvm.transform.Sequential(fusion_passes(target.target, plan, options))(workload.mod)


def _bucket(mod: tvm.IRModule, prefix: str) -> str:
    (gv,) = [gv for gv in mod.get_global_vars() if gv.name_hint.startswith(prefix)]
    return mod[gv].script()


def test_llama_block_reads_qkv_in_place_and_rotates_q_on_load():
    body = _bucket(_llama_block_fused(), "main_n65_128")
    # q (heads 0-3, rotated on load) and v (heads 6-7) from the merged projection; k rotated by its own kernel;
    # the tables: constants (LiftPositionTables), passed whole
    call = re.search(
        r'"relaxtune_flash_attention_rope", \((\w+), (\w+), (\w+), [^,]+, [^,]+, R.shape\(\[0, 0, 6, 2\]\), 1, '
        r"T.float64\(0.125\), 0\)",
        body,
    )
    assert call and call.group(1) == call.group(3) != call.group(2), body
    kernels = re.findall(r"R.call_tir\((?:cls\.)?(\w+),", body)
    assert sum("concatenate" in k for k in kernels) == 1 and not any("repeat" in k for k in kernels), kernels
    assert not any(k.startswith("strided_slice") for k in kernels), "no slice copies"
    assert "relaxtune_cublas_batched_gemm" not in body and "softmax" not in body
    # the rotary tables are constants (LiftPositionTables), read whole by k's rotation kernel (SliceAfterReshape)
    assert not any("rope_cos_sin" in k for k in kernels), kernels
    (rope,) = [k for k in kernels if "concatenate" in k]
    assert rope.startswith("fused_strided_slice") and rope.count("strided_slice") == 3, (
        rope
    )  # k's head slice and both tables


def test_buckets_of_one_query_block_rotate_k_on_load_too():
    from relaxtune.config import FlashAttention

    mod = _llama_block_fused()
    for prefix in ("main_n1_", "main_n33_64"):  # n <= 64: one block of the mma.sync kernel per head
        body = _bucket(mod, prefix)
        # q (heads 0-3), k (4-5), v (6-7) all read from the merged projection; both rotations on load
        call = re.search(r'"relaxtune_flash_attention_rope_qk", \((\w+), (\w+), (\w+), .*R.shape\(\[0, 4, 6, 2\]', body)
        assert call and call.group(1) == call.group(2) == call.group(3), body
        assert "concatenate" not in body and "negative" not in body, body  # no rotation kernel left
    assert "_rope_qk" not in _bucket(mod, "main_n65_128")  # two query blocks: k's rotation stays a kernel
    assert "_rope_qk" not in _bucket(_llama_block_fused(FlashAttention(rope_k=False)), "main_n1_")  # the switch
    for flash in (FlashAttention(block_m=90), FlashAttention(block_m=128)):  # the wgmma kernel; 128-row blocks
        mod = _llama_block_fused(flash)
        assert ("_rope_qk" in _bucket(mod, "main_n65_128")) == (flash.block_m == 128)
        assert ("_rope_qk" in _bucket(mod, "main_n1_")) == (flash.block_m == 128)


@I.ir_module
class Scaled:  # bf16, head_dim 128, explicit scale, no mask
    @R.function
    def main(
        q: R.Tensor((2, "n", 8, 128), "bfloat16"),
        k: R.Tensor((2, "m", 8, 128), "bfloat16"),
        v: R.Tensor((2, "m", 8, 128), "bfloat16"),
    ):
        with R.dataflow():
            o = R.nn.attention(q, k, v, scale=0.5)
            R.output(o)
        return o


def test_bf16_unmasked_attention_keeps_its_scale():
    body = RewriteAttentionToFlash("sm_80", block_m=128)(Scaled)["main"].script()
    assert re.search(r'"relaxtune_flash_attention", \(q, k, v, 0, T.float64\(0\.5\), 128\)', body), body


def _attention(dtype="float16", head_dim=64, causal="TopLeft", bias=False, bucket=(65, 128)):
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    q, k, v = (relax.Var(name, relax.TensorType((1, n, 4, head_dim), dtype)) for name in "qkv")
    params = [q, k, v]
    if bias:
        params.append(relax.Var("bias", relax.TensorType((1, 4, n, n), dtype)))
    with bb.function("main_bucket", params, {"relaxtune.bucket": {"n": list(bucket) + [bucket[1]]}}, private=True):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.attention(q, k, v, params[3] if bias else None, causal_mask=causal))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize(
    "kwargs, arch",
    [
        ({"dtype": "float32"}, "sm_90"),  # fp16 and bf16 only
        ({"head_dim": 80}, "sm_90"),  # head_dim 64 and 128 only
        ({"causal": "BottomRight"}, "sm_90"),  # the kernel's mask is top-left
        ({"bias": True}, "sm_90"),  # an additive mask / bias
        ({}, "sm_75"),  # no bf16 mma.sync, no cp.async
        ({"bucket": (1, 16)}, "sm_90"),  # below min_rows=17 (set below)
    ],
    ids=["fp32", "head_dim80", "bottom_right", "bias", "sm_75", "small_bucket"],
)
def test_unsupported_attention_is_left_alone(kwargs, arch):
    mod = _attention(**kwargs)
    out = RewriteAttentionToFlash(arch, min_rows=17)(mod)
    assert "relaxtune_flash_attention" not in out.script()
    tvm.ir.assert_structural_equal(out, mod)
    if not kwargs and arch == "sm_75":
        assert "relaxtune_flash_attention" in RewriteAttentionToFlash("sm_90")(mod).script()  # the same call on sm_90


def test_flash_passes_only_for_cuda_sm80_and_up(chosen_passes):
    from relaxtune.config import CompileConfig, FlashAttention

    def flash_passes(target, flash):
        passes = chosen_passes(
            target,
            CompileConfig(flash_attention=flash),
            "RewriteAttentionToFlash",
            "SliceAfterReshape",
            "LiftPositionTables",
            "BucketDispatch",
        )
        names = [p.info.name for p in passes]
        return passes[names.index("BucketDispatch") + 1 :]  # LiftPositionTables before it: the CPU fusion's

    assert flash_passes(tvm.target.Target({"kind": "llvm"}), True) == []
    assert flash_passes(tvm.target.Target({"kind": "cuda", "arch": "sm_75"}), True) == []
    assert flash_passes(tvm.target.Target({"kind": "cuda", "arch": "sm_90"}), False) == []
    lift, rewrite, views = flash_passes(
        tvm.target.Target({"kind": "cuda", "arch": "sm_90"}), FlashAttention(min_rows=2)
    )
    assert rewrite.arch == "sm_90" and rewrite.min_rows == 2
    assert (type(lift).__name__, type(views).__name__) == ("LiftPositionTables", "SliceAfterReshape")
    (rewrite,) = flash_passes(
        tvm.target.Target({"kind": "cuda", "arch": "sm_90"}), FlashAttention(lift_tables=False)
    )  # the pipeline before
    assert type(rewrite).__name__ == "RewriteAttentionToFlash"


@needs_nvcc
def test_nvcc_compiles_every_kernel_for_sm90(tmp_path):
    fatbin = cfa.compile_fatbin("sm_90", tmp_path)
    names = {
        name.replace("##DT##", dt)
        for name in re.findall(r"RELAXTUNE_FLASH\((relaxtune_flash_[#\w]+),", cfa.KERNEL_SOURCE)
        for dt in ("f16", "bf16")
    }
    assert len(names) == 16  # {f16, bf16} x {d64, d128} x {64, 128 query rows per block} x {1, 2 stages}
    cuobjdump = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    if os.path.exists(cuobjdump):
        listing = subprocess.run(
            [cuobjdump, "--list-elf", "--list-ptx", str(fatbin)], capture_output=True, text=True
        ).stdout
        assert "sm_90" in listing
        symbols = subprocess.run([cuobjdump, "--dump-elf-symbols", str(fatbin)], capture_output=True, text=True).stdout
        assert all(name in symbols for name in names), symbols[-2000:]
    obj = cfa.object_file("sm_90", tmp_path / "cache")
    nm = subprocess.run(["nm", str(obj)], capture_output=True, text=True).stdout
    assert re.search(r" T __tvm_ffi_relaxtune_flash_attention$", nm, re.M) and re.search(
        r" R relaxtune_flash_fatbin$", nm, re.M
    )
    assert (obj.parent / fatbin.name).read_bytes() in obj.read_bytes()  # embedded whole


@needs_nvcc
def test_hopper_kernels_assemble_for_sm90a_without_serialized_wgmma_or_spills(tmp_path):
    from relaxtune.kernels.device_code import find_nvcc

    src = tmp_path / "flash.cu"
    src.write_text(cfa.KERNEL_SOURCE)
    cmd = [
        find_nvcc(),
        "-cubin",
        "-gencode=arch=compute_90a,code=sm_90a",
        *cfa.NVCC_FLAGS,
        "-Xptxas",
        "-v",
        "-o",
        str(tmp_path / "flash.cubin"),
        str(src),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    # ptxas serializes every wgmma of a kernel where one sits on a path it cannot prove warpgroup-uniform (C7520)
    assert "C7520" not in done.stderr and "C7508" not in done.stderr, done.stderr[-3000:]
    report = dict(re.findall(r"Function properties for (\w+)\n\s+(.*)", done.stderr))
    hopper = {
        name: line for name, line in report.items() if name.startswith(("relaxtune_flash_sm90_", "relaxtune_flash_ws_"))
    }
    assert len(hopper) == 16, sorted(
        report
    )  # {f16, bf16} x {d64, d128} x (two-warpgroup n64/n128, warp-specialized, with ping-pong)
    assert all("0 bytes spill stores" in line for line in hopper.values()), hopper
    fatbin = cfa.compile_fatbin("sm_90", tmp_path / "fatbin").read_bytes()
    assert all(name.encode() in fatbin for name in hopper)


@needs_nvcc
def test_tiny_fp16_llama_artifact_calls_the_flash_kernel(tmp_path):
    from relaxtune import api, targets
    from relaxtune.config import CompileConfig, JobConfig
    from relaxtune.runtime import artifact
    from relaxtune.workloads import load, parse_config

    workload = load(
        "llama-block", parse_config("hidden=128,heads=2,kv_heads=1,ffn=128,max_seq=64,max_batch=1"), "float16"
    )
    target = targets.resolve("cuda")
    job = JobConfig(compile=CompileConfig(use_cache=False))
    executable, _report, _folder = api.build(workload, target, job)
    code = executable.as_text()
    # one call per bucket but n = 1's, whose attention is o_proj's prologue (fuse_attention_gemv_cuda.py)
    assert code.count("relaxtune_flash_attention") >= len(api.bucket_plan(workload, job)["n"]) - 1
    assert "relaxtune_gemv_nk_attn_add" in code
    assert "repeat" not in code  # GQA: kv heads read in place
    so = tmp_path / "llama.so"
    manifest = artifact.export(executable, workload, target, so, api.bucket_plan(workload, job), None, {})
    assert manifest["device_code"]["arch"] == "sm_90"
    library = so.read_bytes()
    assert (
        b"__tvm_ffi_relaxtune_flash_attention_rope" in library
        and b"relaxtune_flash_f16_d64_m64" in library
        and b"relaxtune_flash_f16_d64_m128" in library
    )
    off = JobConfig(compile=CompileConfig(use_cache=False, flash_attention=False))
    assert "relaxtune_flash_attention" not in api.build(workload, target, off)[0].as_text()  # --no-flash-attention


def test_cuda_task_extraction_sees_the_kernels_the_build_keeps():
    """A cuda tuning job tunes what the build runs: no tasks for the GEMMs that call cuBLAS, none
    for the attention that runs as the flash kernel (the job used to tune both, for nothing)."""
    from relaxtune import api, targets
    from relaxtune.config import CompileConfig, JobConfig
    from relaxtune.workloads import load, parse_config

    workload = load(
        "llama-block", parse_config("hidden=128,heads=2,kv_heads=1,ffn=128,max_seq=64,max_batch=1"), "float16"
    )

    def tasks(cublas, flash):
        job = JobConfig(compile=CompileConfig(cublas=cublas, flash_attention=flash))
        return {t.name for t in api.extract_tasks(workload, targets.resolve("cuda"), job)}

    weights, attention, neither = tasks(False, True), tasks(True, False), tasks(False, False)
    assert tasks(True, True) == set()  # every contraction is a library call
    assert weights and attention and not weights & attention
    assert len(weights) + len(attention) == len(neither)  # each library rewrite removes exactly its own kernels
