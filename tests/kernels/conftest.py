"""Shared by the GPU kernel tests: a kernel object (fatbin inside) linked into a library the TVM runtime loads, and the
gemv fatbin's library (the fp16 GEMVs, the 4-bit GEMVs, the fused 4-bit MLP) linked once for all of them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def link_kernels(tmp_path_factory):
    """link(object_path, name): the object linked with g++ into lib<name>.so beside the test's files, loaded."""

    def link(obj: Path, name: str):
        import tvm
        import tvm_ffi.libinfo

        out = tmp_path_factory.mktemp(name) / f"lib{name}.so"
        lib_dir = Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent
        command = ["g++", "-shared", "-o", str(out), str(obj), "-ldl", f"-L{lib_dir}", "-ltvm_ffi"]
        subprocess.run(command, check=True)
        return tvm.runtime.load_module(str(out))

    return link


@pytest.fixture(scope="session")
def gemv_library(link_kernels):
    """kernels/gemv.py's host object for this GPU's arch, linked and loaded (once a session)."""
    import torch

    from relaxtune.kernels.gemv import object_file

    return link_kernels(object_file("sm_{}{}".format(*torch.cuda.get_device_capability())), "gemv")
