"""On an NVIDIA GPU (`python -m pytest -m gpu`): relaxtune's 4-bit decode GEMV (kernels/qgemv.cu) against torch's
dequantize-then-matmul, and a q4f16 llama-block artifact (4-bit GEMV at n = 1, dequantize + cuBLAS beyond) against
torch on the same dequantized weights at every bucket. Skipped where no GPU is (CI has none)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("g++") is None, reason="no nvcc / g++"),
]

# (rows, K, N, group, residual): the 7B block's shapes, N odd (a half-filled feature pair) or below the SM count (a
# block per row), K off the 2-vector chunk, 3 pieces of K per thread (11008), a scale row of 3 (K = 96: the
# streamed kernels do not apply and fall back to the register one)
CASES = [
    (r, k, n, g, res)
    for r in (1, 2, 3, 5)
    for k, n, g, res in (
        (4096, 4096, 32, r % 2 == 1),
        (4096, 11008, 128, r % 2 == 0),
        (11008, 4096, 32, True),
        (96, 37, 32, False),
        (4096, 12288, 128, True),
        (256, 37, 32, r % 2 == 1),
        (1024, 300, 128, r % 2 == 0),
    )
]
# the kernel families (qgemv_host.cc, read per launch), a ring of two slots, lists of families
SETTINGS = [{"RELAXTUNE_Q4GEMV": f} for f in ("reg", "s2r4", "s2r8", "s2r2", "s3r2", "s1r8")]
SETTINGS.append({"RELAXTUNE_Q4GEMV": "s2r4", "RELAXTUNE_Q4GEMV_STAGES": "2"})
SETTINGS += [{"RELAXTUNE_Q4GEMV": "s2r8,s2r4"}, {"RELAXTUNE_Q4GEMV": "s3r2,reg,s2r4"}]  # the first that applies
# int8 activations (checked against quant_formats.q4_gemv_int8_reference, their own arithmetic)
SETTINGS += [{"RELAXTUNE_Q4GEMV": f} for f in ("i8s2r4", "i8s2r8,i8s2r4", "i8s1r8")]
HOST = (Path(__file__).parents[2] / "relaxtune" / "kernels" / "qgemv_host.cc").read_text()
DEFAULT_FAMILY = re.search(r'kQ4DefaultFamily = "(\w+)"', HOST).group(1)
DEFAULT_INT8_FAMILY = re.search(r'kQ4DefaultInt8Family = "([\w,]+)"', HOST).group(1)


def _expected_kernel(settings: dict, rows: int, k: int, group: int) -> str:
    """The kernel qgemv_host.cc must choose on compute capability 9.0+: for the first family of the list that applies,
    its streamed kernel with the fewest pieces of K that cover K (s2r8 and s3r2 have one: K <= 4096, the others
    three: <= 12288), where K / group is a multiple of 8; else (or from "reg" on) the register kernel. With "int8"
    (relaxtune_q4gemv_i8) the default family is the host's int8 one."""
    m, pieces = min(rows, 2), -(-k // (16 * 256))
    default = DEFAULT_INT8_FAMILY if settings.get("int8") else DEFAULT_FAMILY
    for family in settings.get("RELAXTUNE_Q4GEMV", default).split(","):
        kinds = {"s2r4": (1, 3), "s2r8": (1,), "s2r2": (3,), "s3r2": (1,), "s1r8": (1, 3)}
        kinds.update({"i8s2r4": (1, 3), "i8s2r8": (1,), "i8s1r8": (1, 3)})
        kinds = kinds.get(family, ())
        available = [p for p in kinds if p >= pieces]
        if family == "reg":
            break
        if (k // group) % 8 == 0 and available:
            return f"relaxtune_q4gemv_{family}p{min(available)}_m{m}"
    return f"relaxtune_q4gemv_f16_m{m}"


@pytest.mark.parametrize("rows,k,n,group,residual", CASES)
def test_q4gemv_matches_torch_dequantize_then_matmul(gemv_library, monkeypatch, rows, k, n, group, residual):
    """The default kernel, then every family of SETTINGS, on the same operands."""
    import tvm
    import tvm_ffi

    from relaxtune.kernels import quant_formats as qf

    rng = np.random.default_rng(rows * 7 + k + n)
    parts = qf.quantize(qf.own_format(4, group), rng.standard_normal((n, k)).astype(np.float32) / k**0.5)
    packed = qf.pack_q4_gpu(parts["qweight"])
    w = torch.from_numpy(qf.dequantize_q4_gpu(packed, parts["scale"])).cuda()  # float32, exact
    x = torch.randn(1, rows, k, device="cuda", dtype=torch.float16)
    r = torch.randn(1, rows, n, device="cuda", dtype=torch.float16)
    ref = x.float() @ w.t() + (r.float() if residual else 0)
    torch_err = ((x @ w.half().t() + (r if residual else 0)).float() - ref).abs().max().item()
    as_ffi = tvm_ffi.from_dlpack
    wq = tvm.runtime.tensor(packed, tvm.cuda(0))  # uint32: through TVM, not torch
    s = tvm.runtime.tensor(parts["scale"], tvm.cuda(0))
    int8_ref = torch.from_numpy(qf.q4_gemv_int8_reference(x[0].cpu().numpy(), packed, parts["scale"])).cuda()
    int8_ref = int8_ref.float()[None] + (r.float() if residual else 0)
    for settings in [{}, {"int8": True}, *SETTINGS]:
        prefix = "relaxtune_q4gemv_i8" if settings.get("int8") else "relaxtune_q4gemv"
        with monkeypatch.context() as scope:
            for name, value in settings.items():
                if name != "int8":
                    scope.setenv(name, value)
            y = torch.full((1, rows, n), float("nan"), device="cuda", dtype=torch.float16)
            chosen = str(gemv_library[f"{prefix}_kernel"](as_ffi(x), wq, s, as_ffi(y)))
            if torch.cuda.get_device_capability()[0] >= 9:
                assert chosen == _expected_kernel(settings, rows, k, group), settings
            if residual:
                gemv_library[f"{prefix}_add"](as_ffi(x), wq, s, as_ffi(r), as_ffi(y))
            else:
                gemv_library[prefix](as_ffi(x), wq, s, as_ffi(y))
            torch.cuda.synchronize()
        err = (y.float() - (int8_ref if "_i8" in chosen else ref)).abs().max().item()
        # fp16 sums of 8 products per half, then fp32: emulated in numpy (double rounding) 2.0e-3 .. 2.5e-3 on these
        # shapes, against 1.3e-3 .. 1.4e-3 for torch's fp16 matmul of the same weights; int8 activations: exact
        # integer sums, so the float32 sum order and y's rounding against their reference
        assert err == err and err <= max(2 * torch_err, 5e-3), (settings, err, torch_err)


@pytest.mark.parametrize("n,k,group", [(4096, 4096, 32), (12288, 4096, 128), (4096, 11008, 32), (37, 96, 32)])
def test_dequantize_kernel_matches_numpy_bit_for_bit(n, k, group):
    """The prefill buckets' dequantize kernel (quant_gpu_tir.dequantize_kernel, a 16-byte store per thread): numpy's
    float32 dequantization rounded to float16, every bit, on the 7B shapes and on one of fewer words than a block."""
    import tvm

    from relaxtune.kernels import quant_formats as qf
    from relaxtune.kernels import quant_gpu_tir

    rng = np.random.default_rng(n + k + group)
    parts = qf.quantize(qf.own_format(4, group), rng.standard_normal((n, k)).astype(np.float32))
    packed = qf.pack_q4_gpu(parts["qweight"])
    func = quant_gpu_tir.dequantize_kernel(n, k // 8, k // group).with_attr("global_symbol", "main")
    ex = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))
    dev = tvm.cuda(0)
    out = tvm.runtime.tensor(np.full((n, k), np.nan, np.float16), dev)
    ex["main"](tvm.runtime.tensor(packed, dev), tvm.runtime.tensor(parts["scale"], dev), out)
    want = qf.dequantize_q4_gpu(packed, parts["scale"]).astype(np.float16)
    np.testing.assert_array_equal(out.numpy().view(np.uint16), want.view(np.uint16))


# int8 activations (the default): x's rounding per 16 values, about 4e-3 of the largest output per projection
BLOCK_TOLERANCE = {True: 3e-2, False: 1e-2}


@pytest.mark.parametrize("int8", [True, False])
def test_q4f16_llama_block_matches_torch_at_every_bucket(tmp_path, int8):
    from relaxtune import api, targets
    from relaxtune.config import CompileConfig, JobConfig, QuantizeConfig
    from relaxtune.runtime.artifact import Artifact
    from relaxtune.workloads import load, parse_config

    config = parse_config("hidden=256,heads=4,kv_heads=2,ffn=512,max_seq=128,max_batch=2")
    workload = load("llama-block", config, quantize=QuantizeConfig("q4f16", 32))
    arch = "cuda:sm_{}{}".format(*torch.cuda.get_device_capability())
    job = JobConfig(cache_dir=tmp_path / "cache", compile=CompileConfig(int8_activations=int8))
    api.compile(workload, targets.resolve(arch), job, tmp_path / "q.so")
    art = Artifact.load(tmp_path / "q.so")
    for b, n in ((1, 1), (2, 1), (1, 2), (1, 17), (2, 64), (1, 128)):  # the GEMV kernel for n <= 2, cuBLAS beyond
        inputs = workload.random_inputs({"b": b, "n": n})
        got = art(inputs).astype("float32")
        want = np.asarray(workload.reference(inputs, workload.params), dtype="float32")  # dequantized weights
        err = float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))
        assert err < BLOCK_TOLERANCE[int8], (b, n, err)


def test_q4f16_llama_7b_block_matches_its_dequantized_reference(tmp_path):
    """The Llama-7B-sized block (hidden 4096, 32 heads, ffn 11008) with 4-bit projections: the 4-bit GEMV at n = 1,
    dequantize + cuBLAS at n = 128, against the float32 reference on the same weights dequantized."""
    from relaxtune import api, targets
    from relaxtune.config import BucketConfig, CompileConfig, JobConfig, QuantizeConfig
    from relaxtune.runtime.artifact import Artifact
    from relaxtune.workloads import load

    config = {"hidden": "4096", "heads": "32", "kv_heads": "32", "ffn": "11008", "max_seq": "128", "max_batch": "1"}
    workload = load("llama-block", config, quantize=QuantizeConfig("q4f16", 32))
    arch = "cuda:sm_{}{}".format(*torch.cuda.get_device_capability())
    job = JobConfig(
        cache_dir=tmp_path / "cache",
        compile=CompileConfig(use_cache=False),
        buckets=BucketConfig(edges={"n": (1, 128)}),
    )
    api.compile(workload, targets.resolve(arch), job, tmp_path / "q7b.so")
    art = Artifact.load(tmp_path / "q7b.so")
    for n in (1, 128):
        inputs = workload.random_inputs({"b": 1, "n": n})
        got = art(inputs).astype("float32")
        want = np.asarray(workload.reference(inputs, workload.params), dtype="float32")
        err = float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))
        assert err < BLOCK_TOLERANCE[True], (n, err)  # int8 activations at n = 1


@pytest.mark.parametrize("rows,k,n", [(1, 4096, 4096), (2, 4096, 12288), (1, 11008, 4096), (3, 256, 37)])
def test_q4gemv_i8_rms_matches_the_norm_then_the_gemv(gemv_library, rows, k, n):
    """relaxtune_q4gemv_i8_rms (x = rms_norm(x, g) first, qgemv_stream.cu's kRmsX) against the int8 reference on the
    x the norm kernel would write (fp32 with one rounding to fp16), on compute capability 9.0+ (where it exists);
    K over the prologue kernels' reach gets one line."""
    import tvm
    import tvm_ffi

    from relaxtune.kernels import quant_formats as qf

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the prologue kernels are streamed ones: compute capability 9.0+")
    rng = np.random.default_rng(rows + k + n)
    parts = qf.quantize(qf.own_format(4, 32), rng.standard_normal((n, k)).astype(np.float32) / k**0.5)
    packed = qf.pack_q4_gpu(parts["qweight"])
    wq, s = tvm.runtime.tensor(packed, tvm.cuda(0)), tvm.runtime.tensor(parts["scale"], tvm.cuda(0))
    T = tvm_ffi.from_dlpack
    x = torch.randn(1, rows, k, device="cuda", dtype=torch.float16) * 3
    g = (torch.rand(k, device="cuda") + 0.5).half()
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-5) * g.float()).half()
    want = torch.from_numpy(qf.q4_gemv_int8_reference(normed[0].cpu().numpy(), packed, parts["scale"])).cuda()
    for _ in range(2):  # twice: the second launch's named barriers and scratch start as the first's
        y = torch.full((1, rows, n), float("nan"), device="cuda", dtype=torch.float16)
        gemv_library["relaxtune_q4gemv_i8_rms"](T(x), T(g), wq, s, 1e-5, T(y))
        torch.cuda.synchronize()
        err = (y.float() - want.float()[None]).abs().max().item()
        # the plain kernel's bound against its reference; x rounded to int8 one step apart moves an output ~3e-4
        assert err == err and err <= 5e-3, err
    if rows == 1 and k == 4096:
        wide = qf.quantize(qf.own_format(4, 32), rng.standard_normal((8, 16384)).astype(np.float32))
        xw = torch.randn(1, 1, 16384, device="cuda", dtype=torch.float16)
        gw, yw = torch.ones(16384, device="cuda", dtype=torch.float16), torch.empty(1, 1, 8, device="cuda").half()
        wwq = tvm.runtime.tensor(qf.pack_q4_gpu(wide["qweight"]), tvm.cuda(0))
        with pytest.raises(Exception, match="no streamed kernel takes this product's prologue") as raised:
            gemv_library["relaxtune_q4gemv_i8_rms"](
                T(xw), T(gw), wwq, tvm.runtime.tensor(wide["scale"], tvm.cuda(0)), 1e-5, T(yw)
            )
        assert "K = 16384" in str(raised.value).splitlines()[-1]


@pytest.mark.parametrize("q4_mlp,q4_block", [(True, True), (True, False), (False, False)])
def test_q4f16_one_row_block_with_and_without_the_fused_mlp(tmp_path, q4_mlp, q4_block):
    """max_batch 1: the n = 1 bucket's whole layer as relaxtune_q4block_i8 (FuseQuantBlockCuda), its o_proj .. down
    as relaxtune_q4mlp_i8 (FuseQuantMlpCuda) after the q/k/v GEMV, or as its five kernels, against torch's reference
    on the dequantized weights at n = 1, 2, 17."""
    from relaxtune import api, targets
    from relaxtune.config import CompileConfig, CudaLibraries, JobConfig, QuantizeConfig
    from relaxtune.runtime.artifact import Artifact
    from relaxtune.workloads import load, parse_config

    config = parse_config("hidden=256,heads=4,kv_heads=2,ffn=512,max_seq=128,max_batch=1")
    workload = load("llama-block", config, quantize=QuantizeConfig("q4f16", 32))
    arch = "cuda:sm_{}{}".format(*torch.cuda.get_device_capability())
    libraries = CudaLibraries(q4_mlp=q4_mlp, q4_block=q4_block)
    job = JobConfig(cache_dir=tmp_path / "cache", compile=CompileConfig(cublas=libraries))
    api.compile(workload, targets.resolve(arch), job, tmp_path / "q.so")
    art = Artifact.load(tmp_path / "q.so")
    for n in (1, 2, 17, 1):
        inputs = workload.random_inputs({"b": 1, "n": n})
        got = art(inputs).astype("float32")
        want = np.asarray(workload.reference(inputs, workload.params), dtype="float32")
        err = float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))
        assert err < BLOCK_TOLERANCE[True], (n, err)
