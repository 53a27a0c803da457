"""An artifact's input signature (the manifest's ``inputs`` and ``dims``): inputs checked against it, one line
naming the value and what is allowed for a wrong name, dtype, rank, size or a dimension outside its bounds; random
inputs made for it. Reads manifests only: nothing here loads a library.
"""

from __future__ import annotations

import numpy as np

from ..errors import UserError
from .tensor_spec import TensorSpec, fill


def check_dims(manifest: dict, values: dict[str, int]) -> None:
    for dim, value in values.items():
        bounds = manifest["dims"].get(dim)
        if bounds is None:
            raise UserError(f"unknown dimension {dim!r}: the artifact's dimensions are {sorted(manifest['dims'])}")
        if not bounds["lower"] <= value <= bounds["upper"]:
            raise UserError(
                f"shape {dim}={value} is outside the compiled bounds: {dim} must be in [{bounds['lower']}, "
                f"{bounds['upper']}]"
            )


def dims_of(manifest: dict, inputs: dict[str, np.ndarray]) -> dict[str, int]:
    """Check inputs against the manifest (names, dtypes, ranks, static sizes, bounds); return the
    value of every symbolic dimension."""
    specs = {t["name"]: t for t in manifest["inputs"]}
    unknown = sorted(set(inputs) - set(specs))
    if unknown:
        raise UserError(f"unknown input {unknown[0]!r}: the inputs are {sorted(specs)}")
    values: dict[str, int] = {}
    for name, spec in specs.items():
        if name not in inputs:
            raise UserError(f"missing input {name!r} (shape {spec['shape']}, {spec['dtype']})")
        array = inputs[name]
        if str(array.dtype) != spec["dtype"]:
            raise UserError(f"input {name!r} has dtype {array.dtype}; the artifact takes {spec['dtype']}")
        if array.ndim != len(spec["shape"]):
            raise UserError(f"input {name!r} has {array.ndim} dimensions; the artifact takes shape {spec['shape']}")
        for axis, (want, got) in enumerate(zip(spec["shape"], array.shape)):
            if isinstance(want, str):
                if values.setdefault(want, got) != got:
                    raise UserError(f"dimension {want} is {values[want]} in one input and {got} in {name!r}")
            elif want != got:
                raise UserError(f"input {name!r} has size {got} on axis {axis}; the artifact takes {want}")
    check_dims(manifest, values)
    return values


def random_inputs(manifest: dict, dims: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs for the manifest's signature at `dims` (token ids within the vocabulary, masks of ones)."""
    check_dims(manifest, dims)
    missing = sorted(set(manifest["dims"]) - set(dims))
    if missing:
        raise UserError(f"no value given for dimension {missing[0]!r} (use --shape {missing[0]}=N)")
    rng = np.random.default_rng(seed)
    out = {}
    for spec in manifest["inputs"]:
        tensor = TensorSpec(
            spec["name"], tuple(spec["shape"]), spec["dtype"], spec.get("fill", "normal"), spec.get("high", 0)
        )
        out[spec["name"]] = fill(tensor, tensor.concrete(dims), rng)
    return out
