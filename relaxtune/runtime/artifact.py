"""The deployable artifact: `NAME.so` + `NAME.params.npz` + `NAME.json` (the manifest), and
`NAME.check.npz` (inputs at a small shape and the reference output: `relaxtune run`'s check on a
host that cannot rebuild the workload).

Loading needs the TVM runtime only: nothing here compiles. The manifest says what the library
expects (inputs with symbolic dimensions and their bounds, dtypes, weights), so a call with a
wrong name, dtype or a shape outside the bounds is refused with one clear line before it runs.

CUDA artifacts carry compiled device code: TVM's codegen leaves CUDA C source in its device
module (compiled by NVRTC/nvcc when the GPU host loads the library), so `export` compiles that
source here with nvcc into a fatbin for the target's arch and packs it in the `.so` in place of
the source (see `cuda_device_code.py`). The GPU host needs the driver and the TVM runtime only.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError
from .signature import check_dims, dims_of, random_inputs
from .tensor_spec import restore

logger = logging.getLogger(__name__)

FORMAT = 1
# how far an output may be from its reference: max |out - ref| / max(1, max |ref|), by the inputs' dtype
TOLERANCE = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 6e-2}


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out - ref| / max(1, max |ref|) (0 for empty outputs)."""
    if np.size(ref) == 0:
        return 0.0
    ref = np.asarray(ref, dtype="float64")
    return float(np.max(np.abs(np.asarray(out, dtype="float64") - ref)) / max(1.0, float(np.max(np.abs(ref)))))


def _beside(so_path: Path, suffix: str) -> Path:
    stem = Path(so_path).with_suffix("")
    return stem.with_name(stem.name + suffix)


def paths(so_path: Path) -> tuple[Path, Path]:
    """The params and manifest files that go with a `.so`."""
    return _beside(so_path, ".params.npz"), _beside(so_path, ".json")


def check_path(so_path: Path) -> Path:
    """NAME.check.npz: inputs at one small shape and the workload's reference output for them."""
    return _beside(so_path, ".check.npz")


def write_check(workload, so_path: Path) -> dict | None:
    """Store the reference check `relaxtune run NAME.so` (no --shape) compares against, so a host with
    the TVM runtime only (which cannot rebuild the workload) still checks the output: each dimension
    at 3 within its bounds (not a tile multiple; batch and length alike), seed 0."""
    if workload.reference is None:
        return None
    dims = {d.name: min(d.upper, max(d.lower, 3)) for d in workload.dims.values()}
    inputs = workload.random_inputs(dims)
    try:
        expected = np.asarray(workload.reference(inputs, workload.params))
    except Exception as err:  # noqa: BLE001 (the check is optional: an artifact without it still compiles and runs)
        logger.warning(
            "no stored reference check for %s: its reference failed at %s (%s: %s)",
            so_path.name,
            dims,
            type(err).__name__,
            err,
        )
        return None
    np.savez(
        check_path(so_path), expected=expected.astype(np.float32), **inputs
    )  # bfloat16 inputs: read back with `restore`
    return {"dims": dims}


def export_library(executable, target, so_path: Path) -> dict | None:
    """Write the library; for a GPU target with its device code as an nvcc fatbin and relaxtune's CUDA
    kernels linked in. Returns the manifest's ``device_code`` (None on the CPU)."""
    so_path.parent.mkdir(parents=True, exist_ok=True)
    if not target.is_gpu:
        executable.export_library(str(so_path))
        return None
    from ..kernels import cublas as cuda_cublas
    from ..kernels import flash_attention as cuda_flash_attention
    from ..kernels import gemv as cuda_gemv
    from ..kernels.device_code import FatbinPacker

    arch = target.config["arch"]
    packer = FatbinPacker(arch)
    # the cuBLAS kernels (relax_passes/cublas_gemm.py) are linked in; they open cuBLAS on first use;
    # so is the flash attention kernel (relax_passes/flash_attention_cuda.py), on sm_80+, where a function calls
    # it (a language model's attention is the KV cache's: no nvcc run of the flash kernels for it)
    addons = [str(cuda_cublas.object_file())]
    if cuda_flash_attention.supports(arch) and cuda_flash_attention.FUNCTION in executable.as_text():
        addons.append(str(cuda_flash_attention.object_file(arch)))
    if cuda_gemv.supports(arch):  # the decode buckets' GEMV kernel (relax_passes/gemv_cuda.py)
        addons.append(str(cuda_gemv.object_file(arch)))
    executable.export_library(str(so_path), fpack_imports=packer, addons=addons, options=["-ldl"])
    return packer.summary()


def export(executable, workload, target, so_path: Path, plan, cache_fingerprint, schedules) -> dict:
    import tvm

    device_code = export_library(executable, target, so_path)
    params_path, manifest_path = paths(so_path)
    np.savez(params_path, **workload.params)
    check = write_check(workload, so_path)
    manifest = {
        "format": FORMAT,
        "workload": workload.name,
        "spec": workload.spec or workload.name,  # what `workloads.load` takes to rebuild the reference
        "spec_config": workload.spec_config if workload.spec else workload.config,
        "config": workload.config,
        "entry": "main",
        "inputs": [
            {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "fill": t.fill, "high": t.high}
            for t in workload.inputs
        ],
        "params": [{"name": k, "shape": list(v.shape), "dtype": str(v.dtype)} for k, v in workload.params.items()],
        "dims": {d.name: {"lower": d.lower, "upper": d.upper} for d in workload.dims.values()},
        "buckets": {dim: [[b.lo, b.hi, b.tune_at] for b in buckets] for dim, buckets in plan.items()},
        "target": target.config,
        "device": "cuda" if target.is_gpu else "cpu",
        "device_code": device_code,  # cuda: {"format": "fatbin", "arch": ..., "kernels": ..., "bytes": ...}
        "tvm_version": tvm.__version__,
        "cache_fingerprint": cache_fingerprint,
        "schedules": schedules,
        "check": check,  # the stored reference check (NAME.check.npz): its shape, or None
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # every file beside the manifest, as written: checked before anything is loaded (read_manifest)
        "files": file_digests(so_path, ("so", "params", "check") if check else ("so", "params")),
    }
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def role_path(so_path: Path, role: str) -> Path:
    """The file of an artifact with this role ("so", "params", "check"), beside its `.so`."""
    return {"so": Path(so_path), "params": paths(so_path)[0], "check": check_path(so_path)}[role]


def file_digests(so_path: Path, roles: tuple[str, ...]) -> dict[str, dict]:
    """{role: {"bytes": size, "sha256": hex digest}} of an artifact's files (by role, so that the
    artifact may be renamed as a whole)."""
    return {r: {"bytes": role_path(so_path, r).stat().st_size, "sha256": sha256(role_path(so_path, r))} for r in roles}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_files(manifest: dict, so_path: Path) -> None:
    """Each file the manifest lists has its recorded size and SHA-256 (a copy cut short, or changed
    after compile, is refused in one line before the loader maps it)."""
    for role, want in (manifest.get("files") or {}).items():
        path = role_path(so_path, role)
        if not path.exists():
            raise UserError(f"artifact file {path} does not exist (the manifest lists it)")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise UserError(f"artifact file {path} is damaged: {size} bytes, the manifest says {want['bytes']}")
        if sha256(path) != want["sha256"]:
            raise UserError(f"artifact file {path} is damaged: its SHA-256 differs from the one in the manifest")


def ensure_cuda_runtime() -> None:
    """Load TVM's CUDA runtime library where `import tvm` did not (runtime-only mode skips it)."""
    import os

    import tvm

    if tvm.runtime.enabled("cuda"):
        return
    import tvm_ffi

    lib_dir = Path(os.path.dirname(tvm.__file__)) / "lib"
    try:
        tvm_ffi.libinfo.load_lib_ctypes(
            package="tvm", target_name="tvm_runtime_cuda", extra_lib_paths=[lib_dir], mode="RTLD_LOCAL"
        )
    except Exception as err:  # missing driver (libcuda.so.1) or CUDA runtime: say which
        raise UserError(
            f"this artifact runs on cuda, but TVM's CUDA runtime does not load here: {str(err).splitlines()[-1]}"
        ) from None


def ensure_runtime_functions() -> None:
    """Register the Relax run-time helpers TVM defines in Python (`tvm.relax`, absent in runtime-only mode).

    `relax.run.assert_op` is what the bounds check of `main` calls.
    """
    import tvm
    import tvm_ffi

    if tvm_ffi.get_global_func("relax.run.assert_op", allow_missing=True) is not None:
        return

    def assert_op(condition, format_str, *format_args):
        value = condition.numpy() if isinstance(condition, tvm.runtime.Tensor) else condition
        if not value:
            rendered = [str(a.numpy()) if isinstance(a, tvm.runtime.Tensor) else str(a) for a in format_args]
            raise AssertionError(
                format_str.format(*rendered) if format_str else (", ".join(rendered) or "Assertion Failed")
            )

    tvm_ffi.register_global_func("relax.run.assert_op", assert_op)


def prepare_params(vm, params: list) -> list:
    """Run the weight-only work the compiler lifted out of `main` (`main_transform_params`), once."""
    if not params:
        return params
    try:
        transform = vm["main_transform_params"]
    except Exception:  # no lifted work: the weights are used as they are
        return params
    return list(transform(params))


def read_manifest(so_path: str | Path) -> dict:
    """An artifact's manifest (NAME.json), checked to be whole and of this format; its files must exist."""
    so_path = Path(so_path)
    params_path, manifest_path = paths(so_path)
    if manifest_path.exists() and '"kind": "llm"' in manifest_path.read_text():
        raise UserError(
            f"{so_path} is a language model (relaxtune compile gguf:...): "
            f"run it with relaxtune generate {so_path} --prompt TEXT"
        )
    for path in (so_path, params_path, manifest_path):
        if not path.exists():
            raise UserError(
                f"artifact file {path} does not exist (an artifact is NAME.so, NAME.params.npz and NAME.json)"
            )
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"artifact manifest {manifest_path} is damaged: {err.msg} at line {err.lineno}") from None
    if manifest.get("format") != FORMAT:
        raise UserError(
            f"artifact manifest {manifest_path} has format {manifest.get('format')!r}; this relaxtune reads format "
            f"{FORMAT}"
        )
    check_files(manifest, so_path)
    return manifest


@dataclass
class Artifact:
    """A loaded artifact: call it with named numpy inputs."""

    path: Path
    manifest: dict
    vm: object
    device: object
    params: list

    @staticmethod
    def load(so_path: str | Path) -> "Artifact":
        so_path = Path(so_path)
        params_path, _ = paths(so_path)
        manifest = read_manifest(so_path)
        import tvm
        from tvm.runtime.vm import VirtualMachine

        ensure_runtime_functions()
        if manifest["device"] == "cuda":
            ensure_cuda_runtime()
        device = tvm.cuda(0) if manifest["device"] == "cuda" else tvm.cpu(0)
        lib = tvm.runtime.load_module(str(so_path))
        vm = VirtualMachine(lib, device)
        stored = np.load(params_path)
        params = prepare_params(
            vm, [tvm.runtime.tensor(restore(stored[p["name"]], p["dtype"]), device) for p in manifest["params"]]
        )
        return Artifact(so_path, manifest, vm, device, params)

    def dims_of(self, inputs: dict[str, np.ndarray]) -> dict[str, int]:
        """Check inputs against the manifest; return the value of every symbolic dimension."""
        return dims_of(self.manifest, inputs)

    def check_dims(self, values: dict[str, int]) -> None:
        check_dims(self.manifest, values)

    def random_inputs(self, dims: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
        return random_inputs(self.manifest, dims, seed)

    def _args(self, inputs: dict[str, np.ndarray]) -> list:
        import tvm

        self.dims_of(inputs)
        ordered = [tvm.runtime.tensor(inputs[t["name"]], self.device) for t in self.manifest["inputs"]]
        return ordered + self.params

    def __call__(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        out = self.vm["main"](*self._args(inputs))
        return out.numpy()

    def caller(self, inputs: dict[str, np.ndarray]):
        """A call of `main` on these inputs (copied to the device once) that waits for the device: what timings time."""
        args = self._args(inputs)

        def call():
            self.vm["main"](*args)
            self.device.sync()

        return call

    def time_ms(self, inputs: dict[str, np.ndarray], repeat: int = 10, min_seconds: float = 0.5) -> list[float]:
        """Per-call latencies (ms) over at least `repeat` calls or `min_seconds`, after one warm-up."""
        call = self.caller(inputs)
        call()
        times, start = [], time.perf_counter()
        while len(times) < repeat or time.perf_counter() - start < min_seconds:
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
            if len(times) >= 1000:
                break
        return times
