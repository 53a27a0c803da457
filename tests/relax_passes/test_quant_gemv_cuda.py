"""RewriteQuantGemvToCuda (relax_passes/quant_gemv_cuda.py) and the 4-bit GEMV kernel (relaxtune/kernels/qgemv.cu),
without a GPU: the rewrite's structure per bucket (Before / Expected), the cuda pipeline on a q4f16 llama-block,
the kernel assembled by nvcc for sm_90 without spills and with the PTX it relies on, and its host entry points.
Its numbers on a GPU: tests/kernels/test_gpu_qgemv.py (`-m gpu`) and benchmarks/qgemv_check.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import tvm
from tvm import relax, tirx

from relaxtune.kernels import gemv as gemv_module
from relaxtune.kernels import quant_gpu_tir
from relaxtune.kernels.gemv import (
    Q4_ADD_FUNCTION,
    Q4_FUNCTION,
    Q4_I8_ADD_FUNCTION,
    Q4_I8_FUNCTION,
    Q4_I8_KERNEL_FUNCTION,
    Q4_KERNEL_FUNCTION,
    Q4_MLP_KERNELS,
    Q4_STREAM_KERNELS,
)
from relaxtune.relax_passes.quant_gemv_cuda import RewriteQuantGemvToCuda

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")


@pytest.fixture(scope="module")
def sm90_build(tmp_path_factory):
    """The GEMV fatbin's sm_90 build, once for the module: ptxas's per-kernel report ({name: its lines}) and the PTX."""
    from relaxtune.kernels.gemv import KERNEL_SOURCE, nvcc_command

    tmp_path = tmp_path_factory.mktemp("sm90")
    src = tmp_path / "gemv.cu"
    src.write_text(KERNEL_SOURCE)
    done = subprocess.run(
        nvcc_command("sm_90", src, tmp_path / "gemv.fatbin", extra=("-Xptxas", "-v")), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = dict(re.findall(r"Compiling entry function '(\w+)'.*?\n(.*?)(?=Compiling entry|\Z)", done.stderr, re.S))
    done = subprocess.run(
        nvcc_command("sm_90", src, tmp_path / "gemv.ptx", kind="--ptx"), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return report, (tmp_path / "gemv.ptx").read_text()


N, K, G = 16, 64, 32
BUCKETS = {"main_n1": [1, 1, 1], "main_n2_16": [2, 16, 16]}


def _types(rows):
    return (
        relax.TensorType((1, rows, K), "float16"),
        relax.TensorType((1, rows, N), "float16"),
        relax.TensorType((N, K // 8), "uint32"),
        relax.TensorType((N, K // G), "float16"),
    )


def _module(expected: bool) -> tvm.IRModule:
    """Two buckets of `r + proj(x)` over a packed weight (PackQuantWeightsCuda's form); `expected`: the rewrite."""
    bb = relax.BlockBuilder()
    for name, bucket in BUCKETS.items():
        rows = 1 if bucket[1] == 1 else tirx.Var("n", "int64")
        tx, tr, tw, ts = _types(rows)
        x, r, w, s = relax.Var("x", tx), relax.Var("r", tr), relax.Var("w", tw), relax.Var("s", ts)
        with bb.function(name, [x, r, w, s], attrs={"relaxtune.bucket": {"n": bucket}}, private=True):
            with bb.dataflow():
                if not expected:
                    y = bb.emit(bb.call_te(quant_gpu_tir.linear, x, w, s, primfunc_name_hint="q4_gpu_linear"))
                    out = bb.emit_output(relax.op.add(r, y))
                elif bucket[1] == 1:
                    out = bb.emit_output(relax.call_dps_packed(Q4_ADD_FUNCTION, [x, w, s, r], tr))
                else:
                    kernel = bb.add_func(
                        quant_gpu_tir.dequantize_kernel(N, K // 8, K // G), f"dequantize_q4_gpu_{N}x{K}"
                    )
                    wd = bb.emit(relax.call_tir(kernel, [w, s], relax.TensorType((N, K), "float16")))
                    y = bb.emit(relax.call_dps_packed("relaxtune_cublas_gemm_nk", [x, wd], tr))
                    out = bb.emit_output(relax.op.add(r, y))
            bb.emit_func_output(out)
    return bb.get()


def _rewritten(mod, **kwargs):
    return relax.transform.DeadCodeElimination(list(BUCKETS))(RewriteQuantGemvToCuda(**kwargs)(mod))


def test_decode_buckets_call_the_4bit_gemv_with_the_residual_and_others_dequantize_for_cublas():
    tvm.ir.assert_structural_equal(_rewritten(_module(False)), _module(True))


def test_options_and_where_it_does_not_fire():
    plain = _rewritten(_module(False), residual=False)["main_n1"].script()
    assert f'"{Q4_FUNCTION}"' in plain and Q4_ADD_FUNCTION not in plain and "R.add(r" in plain
    wide = _rewritten(_module(False), max_rows=16)["main_n2_16"].script()
    assert Q4_ADD_FUNCTION in wide and "cublas" not in wide
    int8 = _rewritten(_module(False), int8=True)
    assert f'"{Q4_I8_ADD_FUNCTION}"' in int8["main_n1"].script() and "q4gemv" not in int8["main_n2_16"].script()
    assert f'"{Q4_I8_FUNCTION}"' in _rewritten(_module(False), int8=True, residual=False)["main_n1"].script()
    bb = relax.BlockBuilder()  # a weight computed in the function, not a parameter: no kernel may read it early
    tx, _tr, tw, ts = _types(1)
    x, w, s = relax.Var("x", tx), relax.Var("w", tw), relax.Var("s", ts)
    with bb.function("main_n1", [x, w, s], attrs={"relaxtune.bucket": {"n": [1, 1, 1]}}, private=True):
        with bb.dataflow():
            w2 = bb.emit(relax.op.add(w, w))
            out = bb.emit_output(bb.call_te(quant_gpu_tir.linear, x, w2, s, primfunc_name_hint="q4_gpu_linear"))
        bb.emit_func_output(out)
    mod = bb.get()
    tvm.ir.assert_structural_equal(RewriteQuantGemvToCuda()(mod), mod)


@pytest.mark.slow  # about 80 s on 2 loaded cores
def test_q4f16_llama_block_builds_for_cuda_with_the_4bit_kernels():
    """The whole cuda pipeline (no nvcc: tvm.compile leaves CUDA C): n = 1 calls the GEMV kernel (o_proj and down
    with their residual adds), larger buckets dequantize for cuBLAS; every TIR kernel has a GPU schedule."""
    from relaxtune import api, targets
    from relaxtune.config import CompileConfig, JobConfig, QuantizeConfig
    from relaxtune.workloads import load, parse_config

    config = parse_config("hidden=128,heads=4,kv_heads=2,ffn=256,max_seq=64,max_batch=1")
    workload = load("llama-block", config, quantize=QuantizeConfig("q4f16", 32))
    assert workload.config["dtype"] == "float16"
    ex = api.build(workload, targets.resolve("cuda"), JobConfig(compile=CompileConfig(use_cache=False)))[0]
    text = ex.as_text()
    # int8 activations by default (CompileConfig.int8_activations)
    assert text.count(f"{Q4_I8_ADD_FUNCTION}") >= 2 and re.search(rf"\b{Q4_I8_FUNCTION}\b", text)
    assert "relaxtune_cublas_gemm" in text and "dequantize_q4_gpu" in text and "pack_q4_gpu" in text


@needs_nvcc
def test_kernel_assembles_without_spills_and_reads_weights_before_the_wait(sm90_build):

    report, ptx = sm90_build
    names = sorted(n for n in report if n.startswith("relaxtune_q4gemv") and n not in Q4_STREAM_KERNELS)
    assert names == ["relaxtune_q4gemv_f16_m1", "relaxtune_q4gemv_f16_m2"], sorted(report)
    for name in names:
        assert "0 bytes spill stores, 0 bytes spill loads" in report[name] and "0 bytes stack frame" in report[name]
        registers = int(re.search(r"Used (\d+) registers", report[name]).group(1))
        assert registers <= 128, (name, registers)  # two 256-thread blocks per SM
    bodies = dict(re.findall(r"\.entry (relaxtune_q4gemv\w+)\((.*?)(?=\.entry|\Z)", ptx, re.S))
    bodies = {name: body for name, body in bodies.items() if name not in Q4_STREAM_KERNELS}
    assert sorted(bodies) == names
    for name, body in bodies.items():
        assert ".maxntid 256, 1, 1" in body and ".minnctapersm 2" in body, name
        assert ".shared" not in body and "atom." not in body and "shfl.sync.bfly" in body, name
        wait = body.index("griddepcontrol.wait")
        # 2 features x 2 vectors (16 bytes) and their scales in flight before the wait, 4 + 4 more per chunk
        assert body[:wait].count("ld.global.nc.L1::no_allocate.v4.u32") == 4, name
        assert body[:wait].count("ld.global.nc.L1::no_allocate.u16") == 4, name
        assert body.count("griddepcontrol.wait") == 1, name
        # the nibbles become half2 by and / or with the 0x64006400 exponent (ptxas: LOP3) and f16x2 adds / FMAs
        # (cuda_fp16 writes both as fma.rn.f16x2), no integer-to-float conversion; the products in fp16 pairs
        assert "1677747200" in body and body.count("fma.rn.f16x2") >= 64, name  # 0x64006400
        assert not re.search(r"cvt\.rn\.f(16|32)\.[su](8|16|32)", body), name


def _stream_kind(name: str) -> tuple[int, int, int, int]:
    """(GR, RPG, PMAX, M) of a streamed kernel's name relaxtune_q4gemv_[i8]s<GR>r<RPG>p<PMAX>[_rms]_m<M>."""
    found = re.fullmatch(r"relaxtune_q4gemv_(?:i8)?s(\d)r(\d)p(\d)(?:_rms)?_m(\d)", name)
    return tuple(int(v) for v in found.groups())


@needs_nvcc
def test_streamed_kernels_assemble_without_spills_copy_in_bulk_and_list_alike_in_the_host(sm90_build):
    """qgemv_stream.cu for sm_90: every kernel the host lists exists, fits its launch bounds (one block of
    256 GR + 32 threads per SM) without spills; its PTX issues the bulk copies (weights and scales) before the one
    griddepcontrol.wait, counts them on mbarriers, reduces with shuffles and keeps the sums in shared memory (no
    atomics), and dequantizes as qgemv.cu (the 0x64006400 exponent, f16x2 FMAs, no integer-to-float conversion)."""

    host = (Path(gemv_module.__file__).parent / "qgemv_host.cc").read_text()
    table = host[host.index("kQ4StreamKernels[] = {") : host.index("};", host.index("kQ4StreamKernels[] = {"))]
    listed = {
        f"relaxtune_q4gemv_{f}p{p}_m{m}"
        for f, p in re.findall(r'\{"((?:i8)?s\dr\d)", \d, \d, (\d)\}', table)
        for m in (1, 2)
    }
    for numbers in re.findall(r'\{"(?:i8)?s(\d)r(\d)", (\d), (\d), \d\}', table):  # the label is [i8]s<GR>r<RPG>
        assert numbers[:2] == numbers[2:], numbers
    prologues = {name for name in Q4_STREAM_KERNELS if "_rms_" in name}
    assert {name.replace("_rms", "") for name in prologues} <= listed
    assert listed == set(Q4_STREAM_KERNELS) - prologues, sorted(listed)
    report, ptx = sm90_build
    for name in Q4_STREAM_KERNELS:
        groups = _stream_kind(name)[0]
        assert "0 bytes spill stores, 0 bytes spill loads" in report[name] and "0 bytes stack frame" in report[name]
        registers = int(re.search(r"Used (\d+) registers", report[name]).group(1))
        assert registers * (256 * groups + 32) <= 65536, (name, registers)
    bodies = dict(re.findall(r"\.entry (relaxtune_q4gemv_(?:i8)?s\w+)\((.*?)(?=\.entry|\Z)", ptx, re.S))
    assert sorted(bodies) == sorted(Q4_STREAM_KERNELS)
    for name, body in bodies.items():
        groups, rows_per_group, pieces, rows = _stream_kind(name)
        assert f".maxntid {256 * groups + 32}, 1, 1" in body and ".minnctapersm 1" in body, name
        wait = body.index("griddepcontrol.wait")
        assert body.count("griddepcontrol.wait") == 1, name
        bulk = [
            m.start() for m in re.finditer(r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx", body)
        ]
        assert len(bulk) >= 2 and max(bulk) < wait, name  # the producer's copies: before the consumers' wait
        assert "mbarrier.arrive.expect_tx" in body and "mbarrier.try_wait.parity" in body, name
        assert "atom." not in body and "red.global" not in body and "shfl.sync.bfly" in body, name
        assert "ld.global.nc.L1::no_allocate" not in body, name  # weights and scales come by the bulk copies only
        if name.startswith("relaxtune_q4gemv_i8"):  # int8 activations: 4 dp4a per row, piece and row of x
            assert body.count("dp4a.u32.s32") >= rows_per_group * pieces * 4 * rows, name
            assert "fma.rn.f16x2" not in body, name
            # x rounded to int8 once, by adding 1.5 * 2^23 (no conversion), its bytes gathered and summed
            assert "cvt.rni.s32.f32" not in body and "prmt.b32" in body and "dp4a.s32.s32" in body, name
            continue
        assert "1677747200" in body and body.count("fma.rn.f16x2") >= rows_per_group * pieces * (4 + 7 * rows), name
        assert not re.search(r"cvt\.rn\.f(16|32)\.[su](8|16|32)", body), name


Q4_I8_FUNCTIONS = (Q4_I8_FUNCTION, Q4_I8_ADD_FUNCTION, Q4_I8_KERNEL_FUNCTION)


@needs_nvcc
def test_host_object_exports_the_4bit_entry_points(tmp_path):
    from relaxtune.kernels.gemv import FUNCTION, object_file

    symbols = subprocess.run(
        ["nm", "-g", "--defined-only", str(object_file("sm_90", tmp_path))], capture_output=True, text=True
    ).stdout
    for name in (FUNCTION, Q4_FUNCTION, Q4_ADD_FUNCTION, Q4_KERNEL_FUNCTION, *Q4_I8_FUNCTIONS):
        assert f"__tvm_ffi_{name}" in symbols, name


def test_the_4bit_passes_follow_the_libraries_the_arch_and_the_fusion(chosen_passes):
    from relaxtune.config import CompileConfig, CudaLibraries

    names = ("PackQuantWeightsCuda", "MergeQuantProjections", "RewriteQuantGemvToCuda")

    def chosen(arch, **options):
        target = tvm.target.Target({"kind": "cuda", "arch": arch}) if arch else tvm.target.Target("llvm")
        return [p.info.name for p in chosen_passes(target, CompileConfig(**options), *names)]

    assert chosen("sm_90") == list(names) and chosen("sm_80") == list(names)
    assert chosen("sm_90", fusion="stock") == ["PackQuantWeightsCuda", "RewriteQuantGemvToCuda"]
    assert chosen("sm_90", cublas=CudaLibraries(enabled=False)) == [] and chosen("sm_75") == [] and chosen("") == []


@needs_nvcc
def test_mlp_kernels_assemble_without_spills_stream_in_bulk_and_meet_at_release_acquire_barriers(sm90_build):
    """qmlp_stream.cu for sm_90: the kernels qmlp_host.cc lists exist and fit one block of 2 x 256 + 32 threads per
    SM without spills; the PTX waits for the previous kernel once, streams the four weights by bulk copies counted on
    mbarriers, multiplies with dp4a, and meets the other blocks with a release-add and acquire loads (the count
    barrier) or atomics on the generation (the other), or, with no barrier, writes h and act also as words tagged
    with the launch and polls them with relaxed loads, no fence (kTaggedWords), with claimed tiles (kClaimedTiles)
    claiming them from the step counts, its producer waiting for the previous kernel once before its first claim, and
    stamps the globaltimer only for a trace."""
    host = (Path(gemv_module.__file__).parent / "qmlp_host.cc").read_text()
    table = host[host.index("kQ4MlpKernels[] = {") : host.index("};", host.index("kQ4MlpKernels[] = {"))]
    assert tuple(re.findall(r'\{"(relaxtune_q4mlp_\w+)"', table)) == Q4_MLP_KERNELS
    report, ptx = sm90_build
    for name in Q4_MLP_KERNELS:
        assert "0 bytes spill stores, 0 bytes spill loads" in report[name] and "0 bytes stack frame" in report[name]
        assert int(re.search(r"Used (\d+) registers", report[name]).group(1)) * (2 * 256 + 32) <= 65536, name
    bodies = dict(re.findall(r"\.entry (relaxtune_q4mlp_\w+)\((.*?)(?=\.entry|\Z)", ptx, re.S))
    assert sorted(bodies) == sorted(Q4_MLP_KERNELS)
    for name, body in bodies.items():
        assert ".maxntid 544, 1, 1" in body and body.count("griddepcontrol.wait") == 2, name  # consumers, producer
        assert len(re.findall(r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx", body)) >= 2, name
        assert "mbarrier.try_wait.parity" in body and "dp4a.u32.s32" in body, name
        assert "atom.add.release.gpu.global.u64" in body and "ld.acquire.gpu.global.u64" in body, name
        assert "atom.global.add.u32" in body and "%globaltimer" in body, name
        # tagged words: h and act stored relaxed beside their fp16 outputs (loops unrolled), the tag read once, polls of
        # four words at a time with a pause between the polls of one word
        assert body.count("st.relaxed.gpu.global.u32") >= 2 and body.count("ld.relaxed.gpu.global.u32 ") == 1, name
        assert "ld.relaxed.gpu.global.v4.u32" in body and "nanosleep.u32" in body, name
        # claimed tiles: the steps' counts of claims
        assert "relaxtune_q4mlp_claims" in body, name
