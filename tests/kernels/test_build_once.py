"""The kernel cache's `build_once`: processes that build one cache entry at the same time (pytest
workers compiling the flash attention object) build it once, and each gets the finished file."""

import multiprocessing
import time
from pathlib import Path

from relaxtune.kernels.cublas import build_once


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
