"""The one place model weights are read: each parameter of the model builder's module from the
tensors of a model source (`GGUFModel`, `HFCheckpoint`) its module names in `sources`.

A source offers tensors by GGUF name as float32 arrays in PyTorch's (out, in) layout; a parameter
made of several (the merged q/k/v rows, gate/up rows) is their rows concatenated. Another weight
format (quantized blocks kept as they are) is a different module type declaring its `sources`, read
here by its own rule.
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from ..errors import UserError

logger = logging.getLogger(__name__)


class WeightSource(Protocol):
    """What a model file offers: tensor names, and each tensor as float32."""

    def names(self) -> list[str]: ...

    def tensor(self, name: str) -> np.ndarray: ...


def parameter_sources(model) -> dict[str, tuple[str, ...]]:
    """Full parameter name -> the source tensors it is made of, from every module's `sources`."""
    out = {}
    for prefix, module in _modules(model, ""):
        for local, names in getattr(module, "sources", {}).items():
            out[f"{prefix}{local}"] = tuple(names)
    return out


def _modules(module, prefix: str):
    from tvm.relax.frontend import nn

    yield prefix, module
    for name, child in vars(module).items():
        if isinstance(child, nn.ModuleList):
            for i, item in enumerate(child):
                yield from _modules(item, f"{prefix}{name}.{i}.")
        elif isinstance(child, nn.Module):
            yield from _modules(child, f"{prefix}{name}.")


def load_params(model, names: list[str], source: WeightSource) -> dict[str, np.ndarray]:
    """Every parameter in `names` (the exported functions' order) as a float32 array of its declared shape."""
    shapes = {name: tuple(int(d) for d in p.shape) for name, p in model.named_parameters()}
    recipes = parameter_sources(model)
    out = {}
    for name in names:
        if name not in recipes:
            raise ValueError(f"parameter {name} has no sources: its module must declare them")
        parts = [source.tensor(t) for t in recipes[name]]
        value = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        if value.shape != shapes[name]:
            raise UserError(
                f"tensor {' + '.join(recipes[name])} has shape {value.shape}; the model's {name} takes {shapes[name]}"
            )
        out[name] = np.ascontiguousarray(value, dtype=np.float32)
    return out
