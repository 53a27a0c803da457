"""Compiled CUDA device code for artifacts: an nvcc fatbin in place of the CUDA C source.

TVM 0.27's CUDA codegen leaves CUDA C source in the device module of a compiled executable; the
runtime compiles it when the library is loaded, which needs NVRTC or nvcc and a compile callback
on the GPU host (and that callback breaks in runtime-only mode). `FatbinPacker` is the
`fpack_imports` hook of `export_library`: it serialises the imports as TVM does
(`ModulePackImportsToTensor`), compiles each CUDA module's source with nvcc here into a fatbin for
one arch (SASS for it, plus its PTX for newer GPUs), rewrites that module's record from format
`cuda` to `fatbin` (same kernel table), and links the blob into the `.so` under TVM's symbol. The
runtime's CUDA loader passes any format other than `cuda` straight to `cuModuleLoadData`.

Runs after `tvm.compile` (on a host with nvcc; no GPU needed); the loader is `Artifact.load`.

Blob layout (tvm-ffi library_module): u64 size of the rest; the import tree as two u64 vectors;
then per module its kind (u64 length + bytes) and, except for the host library `_lib`, its
`SaveToBytes` payload (u64 length + bytes). A CUDA payload is: format string, kernel table,
data string (u64 length + bytes) — the data comes last, so the table is kept byte for byte.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import struct
import subprocess
import time
from pathlib import Path

from ..errors import UserError

logger = logging.getLogger(__name__)

SOURCE_FORMAT = b"cuda"
BINARY_FORMAT = b"fatbin"
# device code the CUDA runtime loads without a compiler; TVM's build-time callback (tvm.support.nvcc,
# registered where a GPU and CUDA bindings are present) leaves one of these instead of source
PREBUILT_FORMATS = (b"fatbin", b"cubin", b"ptx")
FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
NVCC_FLAGS = (
    "-O3",
    "--use_fast_math",  # what TVM's own nvcc path uses
    "--expt-relaxed-constexpr",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT162_OPERATORS__",
    "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
)


def find_nvcc() -> str:
    """nvcc on PATH, else under CUDA_HOME or /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    raise UserError(
        "compiling for --target cuda needs nvcc (the CUDA toolkit): not on PATH, CUDA_HOME or /usr/local/cuda"
    )


def arch_number(arch: str) -> int:
    """The compute capability of "sm_90" or "sm_90a": 90."""
    return int(arch.removeprefix("sm_").rstrip("a"))


def run_nvcc(cmd: list[str], what: str = "") -> None:
    """Run an nvcc command; a failure raises with the command and nvcc's errors (each with the two
    lines after it; warnings left out when there are errors), else the end of what it printed."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.splitlines()
        errors = [i for i, line in enumerate(lines) if ": error" in line]
        shown = "\n".join("\n".join(lines[i : i + 3]) for i in errors[:8]) if errors else done.stderr[-4000:]
        raise RuntimeError(f"nvcc failed{' on ' + what if what else ''} ({' '.join(cmd)}):\n{shown[-4000:]}")


EXTERN_HOST = Path(__file__).with_name("extern_host.h").read_text()


def extern_host_source(name: str, own: str) -> str:
    """One extern's host source: the host side every extern shares (cuda_extern_host.h: the driver by
    dlopen, errors naming `name`, the fatbin's module per device, kernels and device attributes looked
    up once), then its own code `own`."""
    return f'#define RELAXTUNE_EXTERN "{name}"\n' + EXTERN_HOST + own


def embedded_fatbin_object(
    name: str,
    stem: str,
    arch: str,
    kernel_source: str,
    host_source: str,
    make_fatbin,
    cache_dir: Path | None,
    what: str,
) -> Path:
    """The host object of one of relaxtune's CUDA externs (flash attention, GEMV): `host_source` with
    the fatbin `make_fatbin(arch, folder)` writes embedded as the hidden symbol
    `relaxtune_<name>_fatbin`. Cached as <cache>/relaxtune/<name>_<arch>_<digest>/<stem>.o (kernel_cache: the
    digest taken over both sources, the arch, nvcc's and the host compiler's versions and the tvm-ffi headers)."""
    from . import kernel_cache

    tools = kernel_cache.toolchain(find_nvcc(), kernel_cache.host_compiler())
    digest = kernel_cache.entry_digest(kernel_source, host_source, arch, tools)
    folder = kernel_cache.cache_root(cache_dir) / f"{name}_{arch}_{digest}"
    obj = folder / f"{stem}.o"

    def build() -> Path:
        fatbin = make_fatbin(arch, folder)
        symbol = f"relaxtune_{name}_fatbin"
        embed = (
            f'asm(".section .rodata\\n.balign 16\\n.globl {symbol}\\n.hidden {symbol}\\n'
            f'{symbol}:\\n.incbin \\"{fatbin}\\"\\n.byte 0\\n.previous\\n");\n'
        )
        return kernel_cache.compile_host_object(
            host_source + embed, folder / f"{stem}_host.cc", obj, f"{what} (fatbin {fatbin.stat().st_size} bytes)"
        )

    return kernel_cache.build_once(obj, build)


INF_PRELUDE = "#define inff (__int_as_float(0x7f800000))  // what TVM's `inff` means: a float infinity\n"


def compile_fatbin(source: str, arch: str, workdir: Path) -> bytes:
    """nvcc `source` into a fatbin holding SASS for `arch` (e.g. sm_90) and that arch's PTX."""
    number = arch.removeprefix("sm_")
    workdir.mkdir(parents=True, exist_ok=True)
    src, out = workdir / "device.cu", workdir / "device.fatbin"
    if re.search(r"\binff\b", source):  # TVM 0.27 prints a bfloat16 infinity as `__float2bfloat16_rn(-inff)`
        source = INF_PRELUDE + source
    src.write_text(source)
    gencode = f"-gencode=arch=compute_{number},code=[sm_{number},compute_{number}]"
    cmd = [find_nvcc(), "--fatbin", gencode, *NVCC_FLAGS, "-o", str(out), str(src)]
    start = time.perf_counter()
    run_nvcc(cmd)
    logger.info(
        "nvcc %s: %d chars of CUDA C -> %d-byte fatbin in %.1fs",
        arch,
        len(source),
        out.stat().st_size,
        time.perf_counter() - start,
    )
    return out.read_bytes()


class _Reader:
    def __init__(self, data: bytes, pos: int = 0):
        self.data, self.pos = data, pos

    def u64(self) -> int:
        (value,) = struct.unpack_from("<Q", self.data, self.pos)
        self.pos += 8
        return value

    def raw(self) -> bytes:
        size = self.u64()
        if self.pos + size > len(self.data):
            raise ValueError(f"record of {size} bytes at offset {self.pos} runs past the blob ({len(self.data)} bytes)")
        value = self.data[self.pos : self.pos + size]
        self.pos += size
        return value

    def vector(self) -> list[int]:
        return [self.u64() for _ in range(self.u64())]


def _raw(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value


def parse_blob(blob: bytes) -> tuple[bytes, list[tuple[bytes, bytes | None]]]:
    """(import-tree bytes, [(kind, payload or None for `_lib`)]) of a packed-imports blob."""
    reader = _Reader(blob)
    if reader.u64() != len(blob) - 8:
        raise ValueError("packed imports blob: size header does not match its length")
    reader.vector(), reader.vector()  # row pointers, child indices
    tree = blob[8 : reader.pos]
    modules = []
    while reader.pos < len(blob):
        kind = reader.raw()
        modules.append((kind, None if kind == b"_lib" else reader.raw()))
    return tree, modules


def join_blob(tree: bytes, modules: list[tuple[bytes, bytes | None]]) -> bytes:
    body = tree + b"".join(_raw(kind) + (b"" if payload is None else _raw(payload)) for kind, payload in modules)
    return struct.pack("<Q", len(body)) + body


def with_binary(payload: bytes, source: bytes, binary: bytes) -> bytes:
    """A CUDA module payload holding `binary` (format fatbin) where it held `source`."""
    reader = _Reader(payload)
    if reader.raw() != SOURCE_FORMAT:
        raise ValueError("CUDA module record is not in source format")
    table_start, data_start = reader.pos, len(payload) - len(source) - 8
    if data_start < table_start or payload[data_start:] != _raw(source):
        raise ValueError("CUDA module record does not end with the module's source")
    return _raw(BINARY_FORMAT) + payload[table_start:data_start] + _raw(binary)


def cuda_sources(module) -> list[bytes]:
    """The CUDA C source of every CUDA module imported (transitively) by `module`."""
    found, stack = [], [module]
    while stack:
        current = stack.pop()
        if current.kind == "cuda":
            found.append(current.inspect_source("cuda").encode())
        stack.extend(current.imports)
    return found


class FatbinPacker:
    """`export_library(..., fpack_imports=FatbinPacker(arch))`: imports packed with nvcc fatbins."""

    def __init__(self, arch: str):
        self.arch = arch
        self.compiled: list[dict] = []

    def __call__(self, module, is_system_lib: bool, prefix: str, workspace_dir: str) -> str:
        from tvm.runtime import _ffi_api

        if is_system_lib:
            raise UserError("a CUDA artifact is a shared library; system-lib builds are not supported")
        workdir = Path(workspace_dir)
        blob = bytes(_ffi_api.ModulePackImportsToTensor(module).numpy().tobytes())
        tree, modules = parse_blob(blob)
        sources = cuda_sources(module)
        for index, (kind, payload) in enumerate(modules):
            if kind == b"cuda":
                modules[index] = (kind, self.device_code(payload, sources, workdir / f"cuda{index}"))
        if not self.compiled:
            raise RuntimeError("the executable has no CUDA device module to compile")
        symbol = prefix + _ffi_api.ModuleImportsBlobName()
        blob_path, asm_path = workdir / "devc.bin", workdir / "devc.S"
        blob_path.write_bytes(join_blob(tree, modules))
        asm_path.write_text(
            f"\t.section .rodata\n\t.globl {symbol}\n\t.type {symbol}, @object\n\t.balign 16\n{symbol}:\n"
            f'\t.incbin "{blob_path}"\n\t.size {symbol}, . - {symbol}\n\t.section .note.GNU-stack,"",@progbits\n'
        )
        return str(asm_path)

    def device_code(self, payload: bytes, sources: list[bytes], workdir: Path) -> bytes:
        """One packed CUDA module's payload with nvcc device code for the arch in place of its source;
        as it is when TVM compiled it at build time already (cubin, fatbin or ptx)."""
        held = _Reader(payload).raw()
        if (
            held in PREBUILT_FORMATS
        ):  # TVM's build-time callback (tvm.support.nvcc; a host with a GPU and CUDA bindings)
            self.compiled.append({"prebuilt": held.decode(), "bytes": len(payload)})
            return payload
        source = next((s for s in sources if payload.endswith(s)), None)
        if source is None:
            raise RuntimeError(
                f"packed CUDA module ({held.decode(errors='replace')!r} format) matches no CUDA module of the "
                "executable"
            )
        start = time.perf_counter()
        fatbin = compile_fatbin(source.decode(), self.arch, workdir)
        self.compiled.append(
            {
                "kernels": source.count(b"__global__"),
                "source_chars": len(source),
                "bytes": len(fatbin),
                "nvcc_s": round(time.perf_counter() - start, 2),
            }
        )
        return with_binary(payload, source, fatbin)

    def summary(self) -> dict:
        """What the manifest records: format, arch and the compiled modules."""
        return {"format": BINARY_FORMAT.decode(), "arch": self.arch, "modules": self.compiled}
