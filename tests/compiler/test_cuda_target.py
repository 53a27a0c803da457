"""--target cuda on a CPU-only host: the target, and artifacts that carry nvcc-compiled device code."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys

import pytest

from relaxtune import targets
from relaxtune.__main__ import main
from relaxtune.errors import UserError
from relaxtune.kernels import device_code as cdc

SMALL = "hidden=64,ffn=128,max_seq=64,max_batch=2"
needs_nvcc = pytest.mark.skipif(
    shutil.which("nvcc") is None and not cdc.os.path.exists("/usr/local/cuda/bin/nvcc"), reason="no CUDA toolkit"
)


@pytest.mark.parametrize("spec, arch", [("cuda", "sm_90"), ("cuda:sm_80", "sm_80")])
def test_cuda_target_has_every_metaschedule_limit(spec, arch):
    resolved = targets.resolve(spec)
    assert resolved.is_gpu and resolved.slug.startswith(f"cuda-{arch}-")
    t = resolved.target
    assert t.kind.name == "cuda" and str(t.attrs["arch"]) == arch and "gpu" in t.keys
    for key, value in {
        "max_threads_per_block": 1024,
        "max_shared_memory_per_block": 49152,
        "thread_warp_size": 32,
        "registers_per_block": 65536,
    }.items():
        assert int(t.attrs[key]) == value, key


def test_bad_arch_is_one_line(capsys):
    with pytest.raises(UserError, match="'sm_99'.*sm_80.*sm_90"):
        targets.resolve("cuda:sm_99")
    assert main(["compile", "mlp", "--target", "cuda:sm_99", "-o", "x.so"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'sm_99'" in err[0] and "sm_90" in err[0]


def _payload(fmt: bytes, table: bytes, data: bytes) -> bytes:
    return b"".join(struct.pack("<Q", len(x)) + x for x in (fmt,)) + table + struct.pack("<Q", len(data)) + data


def test_blob_rewrite_keeps_tree_and_kernel_table():
    table = struct.pack("<Q", 1) + b"\x05\x00\x00\x00\x00\x00\x00\x00k_one" + b"\x07" * 13
    source = b'extern "C" __global__ void k_one() {}'
    modules = [(b"relax.VMExecutable", b"vm-bytes"), (b"_lib", None), (b"cuda", _payload(b"cuda", table, source))]
    tree = struct.pack("<Q", 0) + struct.pack("<Q", 0)
    tree_out, parsed = cdc.parse_blob(cdc.join_blob(tree, modules))
    assert tree_out == tree and parsed == modules
    rewritten = cdc.with_binary(parsed[2][1], source, cdc.FATBIN_MAGIC + b"sass")
    assert rewritten == _payload(b"fatbin", table, cdc.FATBIN_MAGIC + b"sass")
    with pytest.raises(ValueError, match="source format"):
        cdc.with_binary(rewritten, source, b"x")
    with pytest.raises(ValueError, match="does not end with"):
        cdc.with_binary(parsed[2][1], b"other source", b"x")
    with pytest.raises(ValueError, match="size header"):
        cdc.parse_blob(cdc.join_blob(tree, modules) + b"\x00")


def test_device_code_built_by_tvm_at_build_time_is_kept(tmp_path):
    # on a host with a GPU, TVM's build-time callback (tvm.support.nvcc, nvrtc) leaves a cubin, not source:
    # the packer keeps it (the H200 build of 2026-12-01 failed with "matches no CUDA module")
    table = struct.pack("<Q", 1) + b"\x05\x00\x00\x00\x00\x00\x00\x00k_one" + b"\x07" * 13
    packer = cdc.FatbinPacker("sm_90")
    for fmt in (b"cubin", b"ptx", b"fatbin"):
        payload = _payload(fmt, table, b"\x7fELF device code")
        assert packer.device_code(payload, [b"some source"], tmp_path) == payload
    assert [m["prebuilt"] for m in packer.compiled] == ["cubin", "ptx", "fatbin"]
    with pytest.raises(RuntimeError, match="'cuda' format.*matches no CUDA module"):
        packer.device_code(_payload(b"cuda", table, b"one source"), [b"another source"], tmp_path)


@needs_nvcc
def test_tiny_workload_cross_compiles_to_a_fatbin(tmp_path):
    from relaxtune import api
    from relaxtune.config import CompileConfig, JobConfig
    from relaxtune.workloads import load

    target = targets.resolve("cuda")
    workload = load("mlp", dict(item.split("=") for item in SMALL.split(",")))
    job = JobConfig(compile=CompileConfig(use_cache=False))
    executable, _report, _folder = api.build(workload, target, job)
    sources = cdc.cuda_sources(executable.mod)
    assert len(sources) == 1 and b"__global__" in sources[0]
    kernels = re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", sources[0].decode())

    packer = cdc.FatbinPacker("sm_90")
    so = tmp_path / "mlp.so"
    executable.export_library(str(so), fpack_imports=packer, workspace_dir=str(tmp_path))
    _tree, modules = cdc.parse_blob((tmp_path / "devc.bin").read_bytes())
    (index,) = [i for i, (kind, _payload) in enumerate(modules) if kind == b"cuda"]
    cuda, fatbin = modules[index][1], tmp_path / f"cuda{index}" / "device.fatbin"
    reader = cdc._Reader(cuda)
    assert reader.raw() == b"fatbin" and fatbin.read_bytes().startswith(cdc.FATBIN_MAGIC)
    assert cuda.endswith(struct.pack("<Q", fatbin.stat().st_size) + fatbin.read_bytes())
    table = cuda[reader.pos : len(cuda) - 8 - fatbin.stat().st_size]
    assert kernels and all(name.encode() in table for name in kernels)
    library = so.read_bytes()
    assert (tmp_path / "devc.bin").read_bytes() in library, "the rewritten blob is linked into the .so"
    assert b"__global__" not in library and b'extern "C"' not in library
    assert packer.summary()["arch"] == "sm_90" and packer.summary()["modules"][0]["kernels"] == len(kernels)
    cuobjdump = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    if cdc.os.path.exists(cuobjdump):
        listing = subprocess.run([cuobjdump, "--list-elf", str(fatbin)], capture_output=True, text=True).stdout
        assert "sm_90" in listing


@needs_nvcc
def test_cli_artifact_names_arch_and_loads_only_where_cuda_is(tmp_path):
    so = tmp_path / "mlp.so"
    assert main(["compile", "mlp", "--config", SMALL, "--target", "cuda:sm_80", "--no-cache", "-o", str(so)]) == 0
    manifest = json.loads((tmp_path / "mlp.json").read_text())
    assert manifest["device"] == "cuda" and manifest["target"]["arch"] == "sm_80"
    assert manifest["device_code"]["format"] == "fatbin" and manifest["device_code"]["arch"] == "sm_80"
    assert b"__global__" not in so.read_bytes()
    # on this GPU-less host the runtime refuses in one line, before any compile is attempted
    code = (
        "import sys, tvm; tvm.compile = lambda *a, **k: sys.exit('compiled at load');"
        "from relaxtune.__main__ import main;"
        f"sys.exit(main(['run', {str(so)!r}, '--shape', 'b=1', '--shape', 'n=3']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    import tvm

    if tvm.runtime.enabled("cuda"):
        pytest.skip("this host has a CUDA driver: the GPU job checks the run")
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and "cuda" in err[0], err


# ---- RewriteGemmToCublas (relax_passes/cublas_gemm.py); its numbers are checked on the GPU by benchmarks/gpu_job.py
from tvm.script import ir as I  # noqa: E402
from tvm.script import relax as R  # noqa: E402
from tvm.script import tirx as T  # noqa: E402


@I.ir_module
class GemmBefore:
    @R.function(private=True)
    def main_n17_128(x: R.Tensor((1, "n", 64), "float16"), w: R.Tensor((64, 32), "float16")) -> R.Tensor(
        (1, "n", 32), "float16"
    ):
        R.func_attr({"relaxtune.bucket": {"n": [17, 128, 128]}})
        n = T.int64()
        with R.dataflow():
            y = R.matmul(x, w)
            z = R.nn.silu(y)
            R.output(z)
        return z


@I.ir_module
class GemmExpected:
    @R.function(private=True)
    def main_n17_128(x: R.Tensor((1, "n", 64), "float16"), w: R.Tensor((64, 32), "float16")) -> R.Tensor(
        (1, "n", 32), "float16"
    ):
        R.func_attr({"relaxtune.bucket": {"n": [17, 128, 128]}})
        n = T.int64()
        with R.dataflow():
            y = R.call_dps_packed("relaxtune_cublas_gemm", (x, w), out_ty=R.Tensor((1, n, 32), "float16"))
            z = R.nn.silu(y)
            R.output(z)
        return z


@I.ir_module
class GemmUntouched:
    @R.function(private=True)
    def main_n1(x: R.Tensor((1, 1, 64), "float16"), w: R.Tensor((64, 32), "float16")) -> R.Tensor(
        (1, 1, 32), "float16"
    ):
        R.func_attr({"relaxtune.bucket": {"n": [1, 1, 1]}})  # decode bucket: the TIR GEMV stays
        with R.dataflow():
            y = R.matmul(x, w)
            R.output(y)
        return y

    @R.function(private=True)
    def main_n2_16(
        x: R.Tensor((1, "n", 64), "float32"), w: R.Tensor((64, 32), "float32"), v: R.Tensor((1, "n", 64), "float16")
    ) -> R.Tensor((1, "n", "n"), "float16"):
        R.func_attr({"relaxtune.bucket": {"n": [2, 16, 16]}})
        n = T.int64()
        with R.dataflow():
            y = R.matmul(x, w)  # float32: no
            s = R.matmul(v, R.permute_dims(v, [0, 2, 1]))  # activation x activation: no
            R.output(s)
        return s


def test_cublas_rewrite_matches_expected():
    from relaxtune.relax_passes.cublas_gemm import RewriteGemmToCublas

    tvm_ir = __import__("tvm").ir
    tvm_ir.assert_structural_equal(RewriteGemmToCublas()(GemmBefore), GemmExpected)


def test_cublas_rewrite_does_not_fire_on_decode_fp32_or_activations():
    from relaxtune.relax_passes.cublas_gemm import RewriteGemmToCublas

    tvm_ir = __import__("tvm").ir
    tvm_ir.assert_structural_equal(RewriteGemmToCublas(min_rows=2)(GemmUntouched), GemmUntouched)
    # the threshold is the bucket's lower bound: the default (min_rows=1) takes the decode bucket too
    assert "relaxtune_cublas_gemm" in RewriteGemmToCublas()(GemmUntouched)["main_n1"].script()
    assert "relaxtune_cublas_gemm" not in RewriteGemmToCublas()(GemmUntouched)["main_n2_16"].script()
    # decode buckets: only weights with a side >= decode_wide (here 64 x 32)
    assert "relaxtune_cublas_gemm" in RewriteGemmToCublas(min_rows=2, decode_wide=64)(GemmUntouched)["main_n1"].script()
    assert "relaxtune_cublas_gemm" not in RewriteGemmToCublas(min_rows=2, decode_wide=65)(GemmUntouched).script()


def test_a_failing_gpu_rule_declines_instead_of_failing_the_build():
    from relaxtune.schedules.rules.gpu_rules import Declining, gpu_rules

    class Broken:
        def apply(self, func, target, tunable):
            raise AssertionError("half-matched")

    class Works:
        def apply(self, func, target, tunable):
            return "schedule"

    assert Declining(Broken()).apply(GemmBefore["main_n17_128"], None, False) is None
    assert Declining(Works()).apply(None, None, False) == "schedule"
    assert [type(r.rule).__name__ for r in gpu_rules()][:3] == ["Matmul", "GEMV", "LowBatchGEMV"]


@I.ir_module
class OneKernel:
    @T.prim_func(private=True, s_tir=True)
    def add_one(a: T.Buffer((T.int64(64),), "float32"), b: T.Buffer((T.int64(64),), "float32")):
        for i in range(T.int64(64)):
            with T.sblock("add"):
                v = T.axis.spatial(T.int64(64), i)
                b[v] = a[v] + T.float32(1)


def test_an_unscheduled_gpu_kernel_is_an_error_naming_it():
    from tvm.s_tir import dlight as dl

    from relaxtune.schedules.rules.gpu_rules import gpu_rules, require_gpu_schedules, unscheduled_kernels

    with pytest.raises(
        (UserError, RuntimeError), match="no CUDA schedule for kernel.s. add_one"
    ):  # TVM re-raises across its pass boundary
        require_gpu_schedules()(OneKernel)
    with targets.resolve("cuda").target:
        scheduled = dl.ApplyDefaultSchedule(*gpu_rules())(OneKernel)
    assert unscheduled_kernels(scheduled) == [] and "threadIdx" in scheduled.script()
    require_gpu_schedules()(scheduled)


def test_cuda_build_calls_cublas_unless_told_not_to():
    """fp16 weight GEMMs go to cuBLAS by default on cuda (CompileConfig.cublas); cublas=False keeps TIR."""
    from relaxtune import api, targets
    from relaxtune.config import CompileConfig, JobConfig
    from relaxtune.workloads import load, parse_config

    workload = load("mlp", parse_config(SMALL), "float16")
    target = targets.resolve("cuda")
    for cublas in (True, False):
        job = JobConfig(compile=CompileConfig(use_cache=False, cublas=cublas, cuda_graphs=cublas))
        ex = api.build(workload, target, job)[0]
        assert ("relaxtune_cublas_gemm" in ex.as_text()) is cublas


@needs_nvcc
def test_cli_gpu_flags(tmp_path):
    so = tmp_path / "mlp.so"
    argv = [
        "compile",
        "mlp",
        "--config",
        SMALL,
        "--dtype",
        "float16",
        "--target",
        "cuda",
        "--no-cache",
        "-o",
        str(so),
        "--no-cublas",
        "--no-cuda-graphs",
        "--no-flash-attention",
    ]
    assert main(argv) == 0 and so.exists()
    from relaxtune.cli.common import job_config
    from relaxtune.config import CompileConfig

    args = type("Args", (), {"cache": tmp_path, "buckets": None, "flash_attention": False})()  # --no-flash-attention
    assert job_config(args).compile.flash_attention.enabled is False and CompileConfig().flash_attention.enabled is True


# ---- RewriteBatchedGemmToCublas (relax_passes/cublas_batched_gemm.py): attention's GEMMs on cuBLAS
TINY_LLAMA = "hidden=64,heads=4,kv_heads=2,ffn=128,max_seq=128,max_batch=1"  # grouped-query, buckets up to 65..128


def test_cublas_addon_compiles_and_exports_both_kernels(tmp_path):
    from relaxtune.kernels.cublas import BATCHED_FUNCTION, FUNCTION, object_file

    obj = object_file(tmp_path)
    symbols = subprocess.run(["nm", "-g", "--defined-only", str(obj)], capture_output=True, text=True).stdout
    for name in (FUNCTION, BATCHED_FUNCTION):
        assert f"__tvm_ffi_{name}" in symbols, name


@needs_nvcc
def test_tiny_llama_cross_compiles_with_attention_on_cublas(tmp_path):
    """fp16 llama-block for cuda: the 65..128 bucket's attention calls the batched kernel, the mask
    is inside its softmax; smaller buckets keep dlight's kernels; the artifact links the addon."""
    from relaxtune import api, targets
    from relaxtune.config import CompileConfig, JobConfig
    from relaxtune.runtime import artifact
    from relaxtune.workloads import load, parse_config

    workload = load("llama-block", parse_config(TINY_LLAMA), "float16")
    target = targets.resolve("cuda")
    job = JobConfig(compile=CompileConfig(use_cache=False))
    executable = api.build(workload, target, job)[0]
    text = executable.as_text()
    assert "relaxtune_cublas_batched_gemm" in text and "relaxtune_cublas_gemm" in text
    kernels = [
        name
        for src in cdc.cuda_sources(executable.mod)
        for name in re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", src.decode())
    ]
    assert any(k.startswith("softmax_bias") for k in kernels), kernels
    assert any(k.startswith("softmax") and "bias" not in k for k in kernels), "smaller buckets keep the plain softmax"
    manifest = artifact.export(
        executable, workload, target, tmp_path / "llama.so", api.bucket_plan(workload, job), None, {}
    )
    assert manifest["device_code"]["format"] == "fatbin"
    assert b"__tvm_ffi_relaxtune_cublas_batched_gemm" in (tmp_path / "llama.so").read_bytes()


@needs_nvcc
def test_bfloat16_llama_cross_compiles_with_the_nk_library_calls(tmp_path):
    # bfloat16 end to end for cuda: its (N, K) GEMV and cuBLAS calls, and the causal-bias kernel whose
    # -inf TVM 0.27 prints as `inff` (cuda_device_code.INF_PRELUDE; nvcc failed on it before)
    so = tmp_path / "bf.so"
    config = "hidden=64,heads=2,kv_heads=2,ffn=128,max_seq=64"
    assert (
        main(
            [
                "compile",
                "llama-block",
                "--config",
                config,
                "--dtype",
                "bfloat16",
                "--target",
                "cuda",
                "--no-cache",
                "-o",
                str(so),
            ]
        )
        == 0
    )
    library = so.read_bytes()
    for name in (b"relaxtune_gemv_nk", b"relaxtune_cublas_gemm_nk", b"relaxtune_cublas_gemm_add_nk"):
        assert name in library, name
    assert json.loads(so.with_suffix(".json").read_text())["config"]["dtype"] == "bfloat16"
