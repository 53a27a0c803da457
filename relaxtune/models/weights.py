"""The one place model weights are read: each parameter of the model builder's module from the
tensors of a model source (`GGUFModel`, `HFCheckpoint`) its module names in `sources`.

A source offers tensors by GGUF name as float32 arrays in PyTorch's (out, in) layout; a parameter
made of several (the merged q/k/v rows, gate/up rows) is their rows concatenated. A quantized module
(`quant_linear.py`) names a `Blocks` recipe instead: one part of the weight in a `WeightFormat`, from
the file's own blocks (`source.blocks`, a GGUF's Q4_0 / Q4_1 / Q8_0 / F16) or quantized here from float32
(relaxtune's own groups); each weight is split or quantized once for all its parts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import UserError
from ..kernels.quant_formats import GGUF, WeightFormat, quantize

logger = logging.getLogger(__name__)


class WeightSource(Protocol):
    """What a model file offers: tensor names, and each tensor as float32."""

    def names(self) -> list[str]: ...

    def tensor(self, name: str) -> np.ndarray: ...


@dataclass(frozen=True)
class Blocks:
    """Part `part` of the weight made of the tensors `sources` (rows concatenated) in format `fmt`."""

    sources: tuple[str, ...]
    fmt: WeightFormat
    part: str


def _weight_parts(recipe: Blocks, source) -> dict[str, np.ndarray]:
    """Every part of a `Blocks` weight: the file's own blocks when it stores them in `fmt`, else quantized."""
    kind_of = getattr(source, "quant_type", None)
    kinds = {kind_of(t) for t in recipe.sources} if kind_of is not None else set()
    if len(kinds) == 1 and GGUF.get(kinds.pop()) == recipe.fmt:
        pieces = [source.blocks(t) for t in recipe.sources]
        return {p: np.concatenate([x[p] for x in pieces], axis=0) for p in recipe.fmt.part_names}
    rows = [source.tensor(t) for t in recipe.sources]
    return quantize(recipe.fmt, rows[0] if len(rows) == 1 else np.concatenate(rows, axis=0))


def parameter_sources(model) -> dict[str, tuple[str, ...] | Blocks]:
    """Full parameter name -> the source tensors it is made of (or its `Blocks` recipe), from every module's
    `sources`."""
    out = {}
    for prefix, module in _modules(model, ""):
        for local, names in getattr(module, "sources", {}).items():
            out[f"{prefix}{local}"] = names if isinstance(names, Blocks) else tuple(names)
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
    """Every parameter in `names` (the exported functions' order) as an array of its declared shape and dtype
    (float32, or a quantized weight's part)."""
    declared = {name: (tuple(int(d) for d in p.shape), p.dtype) for name, p in model.named_parameters()}
    recipes = parameter_sources(model)
    out, split = {}, {}
    for name in names:
        if name not in recipes:
            raise ValueError(f"parameter {name} has no sources: its module must declare them")
        recipe = recipes[name]
        if isinstance(recipe, Blocks):
            key = (recipe.sources, recipe.fmt)
            if key not in split:
                split[key] = _weight_parts(recipe, source)
            value, what = split[key][recipe.part], " + ".join(recipe.sources)
        else:
            parts = [source.tensor(t) for t in recipe]
            value, what = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0), " + ".join(recipe)
        shape, dtype = declared[name]
        if value.shape != shape:
            raise UserError(f"tensor {what} has shape {value.shape}; the model's {name} takes {shape}")
        out[name] = np.ascontiguousarray(value, dtype=dtype)
    return out
