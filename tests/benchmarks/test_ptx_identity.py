"""benchmarks/ptx_identity.py: a pure move of code leaves every kernel's digest as it was, a changed kernel is named and
fails the comparison, a module variable more changes the globals' digest alone (nvcc on the CPU, no GPU)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from relaxtune.errors import UserError
from relaxtune.kernels.device_code import find_nvcc

ROOT = Path(__file__).resolve().parents[2]
KERNEL = """namespace {
__device__ __forceinline__ float twice(float v) { return 2.0f * v; }
__shared__ float scratch[32];
}  // namespace
extern "C" __global__ void first(float* y) {
  scratch[threadIdx.x] = y[threadIdx.x];
  __syncthreads();
  y[threadIdx.x] = twice(scratch[31 - threadIdx.x]);
}
extern "C" __global__ void second(float* y) { y[threadIdx.x] += SECOND; }
"""


def _ptx(tmp_path: Path, name: str, source: str) -> str:
    (tmp_path / name).mkdir()
    src, out = tmp_path / name / "kernels.cu", tmp_path / name / "kernels.ptx"  # one file name, as the fatbins'
    src.write_text(source)
    subprocess.run([find_nvcc(), "--ptx", "-arch=sm_80", "-o", str(out), str(src)], check=True, capture_output=True)
    return out.read_text()


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    script = ROOT / "benchmarks" / "ptx_identity.py"
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_moved_code_same_digests_changed_kernel_named(tmp_path):
    try:
        find_nvcc()
    except UserError:
        pytest.skip("nvcc is not installed")
    spec = importlib.util.spec_from_file_location("ptx_identity", ROOT / "benchmarks" / "ptx_identity.py")
    ptx_identity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ptx_identity)
    base = _ptx(tmp_path, "base", KERNEL.replace("SECOND", "1.0f"))
    # the same code with a comment before it: another file hash in the anonymous namespace's name, the same kernels
    moved = _ptx(tmp_path, "moved", "// moved here from another file\n" + KERNEL.replace("SECOND", "1.0f"))
    changed = _ptx(tmp_path, "changed", KERNEL.replace("SECOND", "3.0f"))
    assert "_GLOBAL__N__" in base and base != moved
    digests = {name: {"unit": ptx_identity.kernel_digests(ptx)} for name, ptx in (("a", base), ("b", moved))}
    assert set(digests["a"]["unit"]) == {"<globals>", "first", "second"}
    assert ptx_identity.compare(digests["a"], digests["b"]) == []
    third = {"unit": ptx_identity.kernel_digests(changed)}
    assert ptx_identity.compare(digests["a"], third) == ["unit: second differs"]
    # a module variable more: nvcc writes it after the first kernel's `// .globl` line, yet only the globals differ
    counted = _ptx(tmp_path, "counted", "__device__ unsigned int counter;\n" + KERNEL.replace("SECOND", "1.0f"))
    assert counted.index("// .globl") < counted.index(".global .align 4 .u32 counter")
    more = {"unit": ptx_identity.kernel_digests(counted)}
    assert ptx_identity.compare(digests["a"], more) == ["unit: <globals> differs"]
    for name, value in (("a", digests["a"]), ("c", third)):
        (tmp_path / f"{name}.json").write_text(json.dumps(value))
    assert _run("compare", "a.json", "a.json", cwd=tmp_path).returncode == 0
    done = _run("compare", "a.json", "c.json", cwd=tmp_path)
    assert done.returncode == 1 and "unit: second differs" in done.stdout
