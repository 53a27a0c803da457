"""The kernel cache (relaxtune/kernels/kernel_cache.py): processes that build one entry at the same time (pytest
workers compiling the flash attention object) build it once and each gets the finished file; an entry's key covers
the headers' contents, not their folder."""

import multiprocessing
import shutil
import time
from pathlib import Path

from relaxtune.kernels import kernel_cache
from relaxtune.kernels.kernel_cache import build_once


def _build_slowly(obj: str, log: str) -> str:
    def build() -> Path:
        with open(log, "a") as f:
            f.write("built\n")
        time.sleep(0.5)  # long enough for the other process to arrive while this one builds
        tmp = Path(f"{obj}.tmp")
        tmp.write_text("object")
        tmp.replace(obj)
        return Path(obj)

    return build_once(Path(obj), build).read_text()


def test_concurrent_builds_of_one_entry_build_it_once(tmp_path):
    obj, log = tmp_path / "cache" / "kernel.o", tmp_path / "log"
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        got = pool.starmap(_build_slowly, [(str(obj), str(log))] * 3)
    assert got == ["object"] * 3
    assert log.read_text() == "built\n"


def test_an_existing_entry_is_not_rebuilt(tmp_path):
    obj = tmp_path / "kernel.o"
    obj.write_text("cached")

    def build():
        raise AssertionError("rebuilt a cached entry")

    assert build_once(obj, build) == obj


def test_the_key_follows_the_headers_contents_not_their_folder(tmp_path, monkeypatch):
    import tvm_ffi.libinfo

    def key_with_headers_in(folder: Path) -> str:
        monkeypatch.setattr(tvm_ffi.libinfo, "find_include_path", lambda: str(folder / "include"))
        monkeypatch.setattr(tvm_ffi.libinfo, "find_dlpack_include_path", lambda: str(folder / "dlpack"))
        kernel_cache.headers_digest.cache_clear()
        return kernel_cache.entry_digest("source", "sm_90")

    for name in ("a", "b"):
        shutil.copytree(tvm_ffi.libinfo.find_include_path(), tmp_path / name / "include")
        shutil.copytree(tvm_ffi.libinfo.find_dlpack_include_path(), tmp_path / name / "dlpack")
    try:
        first = key_with_headers_in(tmp_path / "a")
        assert kernel_cache.entry_digest("other source", "sm_90") != first
        assert key_with_headers_in(tmp_path / "b") == first  # another virtual environment, the same headers
        header = next(p for p in sorted((tmp_path / "b" / "include").rglob("*.h")))
        header.write_text(header.read_text() + "\n// changed\n")
        assert key_with_headers_in(tmp_path / "b") != first
    finally:
        monkeypatch.undo()
        kernel_cache.headers_digest.cache_clear()
