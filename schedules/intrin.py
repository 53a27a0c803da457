"""Register only the tensor intrinsics a target can use, instead of TVM's 35-second import of all.

`import tvm.s_tir.tensor_intrin` parses every intrinsic for every backend (CUDA alone is ~23 s);
MetaSchedule imports it when a TuneContext is made. We put a bare package object in its place and
import just the submodule for the target (x86: 0.3 s). Must run before MetaSchedule is imported
anywhere in the process; calling it again is a no-op for kinds already loaded.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
import types

logger = logging.getLogger(__name__)

_PACKAGE = "tvm.s_tir.tensor_intrin"
_BY_KIND = {"llvm": ("x86", "arm_cpu"), "cuda": ("cuda",)}


def register_for(kind: str) -> None:
    """Make the tensor intrinsics of target kind `kind` (llvm or cuda) available."""
    import tvm.s_tir

    package = sys.modules.get(_PACKAGE)
    if package is None:
        package = types.ModuleType(_PACKAGE)
        package.__path__ = [os.path.join(os.path.dirname(tvm.s_tir.__file__), "tensor_intrin")]
        package.__relaxtune_lazy__ = True
        sys.modules[_PACKAGE] = package
    elif not getattr(package, "__relaxtune_lazy__", False):
        return  # the real package was imported already: everything is registered
    for sub in _BY_KIND.get(kind, ()):
        name = f"{_PACKAGE}.{sub}"
        if name not in sys.modules:
            start = time.perf_counter()
            importlib.import_module(name)
            logger.debug("registered %s tensor intrinsics in %.1fs", sub, time.perf_counter() - start)
