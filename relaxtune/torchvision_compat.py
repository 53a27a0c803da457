"""``import torchvision`` where its C++ extension cannot load (a CPU build of torch beside PyPI's
torchvision, which links ``libtorch_cuda.so``: what pip installs on a machine whose torch is a local
CPU wheel).

torchvision loads its extension if it can and carries on without it, but then registers fake
(meta) kernels for two of the extension's operators, ``torchvision::nms`` and ``qnms``, without
checking that they exist: ``import torchvision`` fails with "operator torchvision::nms does not
exist", and with it everything that imports torchvision when it is installed (``transformers``'
model code, through its image utilities). :func:`install` adds an import hook that runs just
before torchvision's ``__init__``: it loads the extension as torchvision would, and only where
that fails defines the schemas of those two operators, so that the registrations succeed. Nothing
else changes: the classification models (pure Python) work, and calling an operator of the
missing extension raises as it would without the hook. With a torch / torchvision pair whose
extension loads, the hook does nothing.

Installed by the entry points (the CLI, the test session) and by the loaders of workloads that
import torchvision or transformers, before they import it; importing relaxtune installs nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

# what torchvision's _meta_registrations registers unguarded (torchvision 0.28), with the schemas its extension defines
SCHEMAS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARIES: list = []  # torch.library.Library objects must stay alive for their definitions to stay


def _extension(package_dir: str) -> str | None:
    for name in sorted(os.listdir(package_dir)):
        if name.startswith("_C.") and any(name.endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES):
            return os.path.join(package_dir, name)
    return None


def define_missing_operators(package_dir: str) -> bool:
    """Load torchvision's extension from ``package_dir``; where it does not load, define the
    operators torchvision registers fake kernels for unguarded. Returns whether it defined them."""
    import torch

    path = _extension(package_dir)
    if path is not None:
        try:
            torch.ops.load_library(path)
            _LIBRARIES.append(None)  # loaded: nothing to define, not again
            return False
        except (OSError, RuntimeError) as err:
            logger.debug("torchvision's extension %s does not load (%s)", path, str(err).splitlines()[0])
    library = torch.library.Library("torchvision", "FRAGMENT")  # kept alive in _LIBRARIES
    for name, schema in SCHEMAS.items():
        library.define(name + schema)
    _LIBRARIES.append(library)
    return True


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, package_dir: str):
        self.inner, self.package_dir = inner, package_dir

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        if not _LIBRARIES:
            define_missing_operators(self.package_dir)
        self.inner.exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``torchvision`` where the path finder does, with :class:`_Loader` around its loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torchvision":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not spec.submodule_search_locations:
            return spec
        spec.loader = _Loader(spec.loader, next(iter(spec.submodule_search_locations)))
        return spec


def install() -> None:
    """Put the import hook first on ``sys.meta_path`` unless torchvision is imported already."""
    if "torchvision" not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
