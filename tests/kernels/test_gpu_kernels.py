"""On an NVIDIA GPU (`python -m pytest -m gpu`, the device job runs it): relaxtune's CUDA kernels and a
cuda artifact checked against torch. Skipped where no GPU is (CI has none)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("g++") is None, reason="no nvcc / g++"),
]

# (rows, K, N, dtype, residual): N off the 64-column tile, K off the 32 K lanes
GEMV_CASES = [
    (r, k, n, dt, res)
    for dt in ("float16", "bfloat16")
    for r in (1, 2, 5, 16)
    for k, n, res in ((4096, 4096, r % 2 == 1), (1000, 4104, r % 2 == 0), (11008, 4096, True))
]


@pytest.fixture(scope="module")
def gemv_library(tmp_path_factory):
    import tvm
    import tvm_ffi.libinfo

    from relaxtune.kernels.gemv import object_file

    arch = "sm_{}{}".format(*torch.cuda.get_device_capability())
    out = tmp_path_factory.mktemp("gemv") / "libgemv.so"
    lib_dir = Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent
    subprocess.run(
        ["g++", "-shared", "-o", str(out), str(object_file(arch)), "-ldl", f"-L{lib_dir}", "-ltvm_ffi"], check=True
    )
    return tvm.runtime.load_module(str(out))


@pytest.mark.parametrize("nk", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("rows,k,n,dtype,residual", GEMV_CASES)
def test_gemv_kernel_matches_fp32_torch(gemv_library, rows, k, n, dtype, residual, nk):
    import tvm_ffi

    as_ffi = tvm_ffi.from_dlpack
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    x, w = torch.randn(1, rows, k, device="cuda", dtype=dt), torch.randn(k, n, device="cuda", dtype=dt) / k**0.5
    r = torch.randn(1, rows, n, device="cuda", dtype=dt)
    ref = x.float() @ w.float() + (r.float() if residual else 0)
    torch_err = ((x @ w + (r if residual else 0)).float() - ref).abs().max().item()
    y = torch.full((1, rows, n), float("nan"), device="cuda", dtype=dt)
    weight = as_ffi(w.t().contiguous() if nk else w)
    name = "relaxtune_gemv" + ("_nk" if nk else "") + ("_add" if residual else "")
    args = (as_ffi(x), weight, as_ffi(r), as_ffi(y)) if residual else (as_ffi(x), weight, as_ffi(y))
    gemv_library[name](*args)
    torch.cuda.synchronize()
    err = (y.float() - ref).abs().max().item()
    assert err == err and err <= max(2 * torch_err, 4e-3 if dtype == "float16" else 3e-2), (err, torch_err)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_cuda_llama_block_matches_torch_at_every_bucket(tmp_path, dtype):
    """cuBLAS GEMMs, the GEMV kernel, the flash kernel and the TIR rules in one artifact."""
    from relaxtune import api, targets
    from relaxtune.config import JobConfig
    from relaxtune.runtime.artifact import Artifact
    from relaxtune.workloads import load, parse_config

    config = parse_config("hidden=256,heads=4,kv_heads=2,ffn=512,max_seq=128,max_batch=2")
    workload = load("llama-block", config, dtype)
    arch = "cuda:sm_{}{}".format(*torch.cuda.get_device_capability())
    api.compile(workload, targets.resolve(arch), JobConfig(cache_dir=tmp_path / "cache"), tmp_path / "b.so")
    art = Artifact.load(tmp_path / "b.so")
    for b, n in [(1, 1), (2, 1), (1, 2), (1, 17), (2, 64), (1, 128)]:
        inputs = workload.random_inputs({"b": b, "n": n})
        got = art(inputs).astype("float32")
        want = np.asarray(workload.reference(inputs, workload.params), dtype="float32")
        err = float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))
        assert err < (1e-2 if dtype == "float16" else 3e-2), (b, n, err)
