"""The cache of relaxtune's compiled extern objects (the cuBLAS, flash attention and GEMV host objects with their
fatbins): where an entry lives, what its key covers, and its one build.

An entry lives under `<cache>/relaxtune` (`cache_dir`, else $XDG_CACHE_HOME, else ~/.cache). Its key is a digest of
everything the object is made from: the sources, the arch, the contents of the tvm-ffi and dlpack headers it compiles
against (not their folder, so that the same headers in another virtual environment find the same entry) and the
compilers' versions (`toolchain`). An entry is built once (`build_once`): processes that need it at the same time wait
for the first, and a reader never sees half a file (each file is written under a temporary name and renamed).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_root(cache_dir: Path | None = None) -> Path:
    """`<cache_dir or $XDG_CACHE_HOME or ~/.cache>/relaxtune` (an empty $XDG_CACHE_HOME counts as unset)."""
    return Path(cache_dir or os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache") / "relaxtune"


@functools.cache
def headers_digest() -> str:
    """A digest of the tvm-ffi and dlpack headers' contents (every file under their include folders)."""
    import tvm_ffi.libinfo

    h = hashlib.sha1()
    for root in sorted({tvm_ffi.libinfo.find_include_path(), tvm_ffi.libinfo.find_dlpack_include_path()}):
        for path in sorted(Path(root).rglob("*")):
            if path.is_file():
                h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


@functools.cache
def toolchain(*commands: str) -> str:
    """What `<command> --version` prints for each command (the host compiler, nvcc), or "absent"."""
    versions = []
    for command in commands:
        try:
            done = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60)
            versions.append(done.stdout.strip() or "absent")
        except (OSError, subprocess.TimeoutExpired):
            versions.append("absent")
    return "\n".join(versions)


def host_compiler() -> str:
    """The host C++ compiler: $CXX, else g++."""
    return os.environ.get("CXX", "g++")


def entry_digest(*parts: str) -> str:
    """The 12-hex-digit key of an entry made from `parts` (sources, arch, compilers) and the headers."""
    return hashlib.sha1("\0".join((*parts, headers_digest())).encode()).hexdigest()[:12]


def build_once(obj: Path, build: Callable[[], Path]) -> Path:
    """`obj` if it exists, else what `build()` returns, run under an exclusive lock on `<obj>.lock`:
    processes building the same cache entry at once (pytest workers, two jobs) build it once, and
    none reads or renames another's half-written files."""
    if obj.exists():
        return obj
    obj.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{obj}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return obj if obj.exists() else build()


def compile_host_object(source: str, src: Path, obj: Path, what: str) -> Path:
    """Compile C++ `source` (written to `src`) against the tvm-ffi headers into `obj` with the host
    compiler; written to a temporary name and renamed, so a reader never sees half a file."""
    import tvm_ffi.libinfo

    src.write_text(source)
    tmp = f"{obj}.{os.getpid()}.tmp"
    includes = {tvm_ffi.libinfo.find_include_path(), tvm_ffi.libinfo.find_dlpack_include_path()}
    cmd = [host_compiler(), "-std=c++17", "-O2", "-fPIC", *(f"-I{p}" for p in includes), "-c", str(src), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {what} failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    os.replace(tmp, obj)
    logger.info("compiled %s", obj)
    return obj
