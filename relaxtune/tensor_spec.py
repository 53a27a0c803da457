"""One input tensor of a workload or an artifact, and random values for it: numpy only, so an
artifact's inputs can be made where only the TVM runtime is (workloads/ imports the compiler)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

FILLS = ("normal", "ones", "index")


@dataclass(frozen=True)
class TensorSpec:
    """One input tensor: its shape uses ints for static and dimension names for symbolic sizes.

    ``fill`` says what :meth:`Workload.random_inputs` puts in it: ``"normal"`` (standard normal,
    the default), ``"ones"`` (e.g. an attention mask) or ``"index"`` (random integers in
    ``[0, high)``, e.g. token ids within the vocabulary).
    """

    name: str
    shape: tuple[int | str, ...]
    dtype: str
    fill: str = "normal"
    high: int = 0

    def __post_init__(self) -> None:
        if self.fill not in FILLS or (self.fill == "index" and self.high < 1):
            raise ValueError(f"input {self.name!r}: fill {self.fill!r} must be one of {FILLS} (index needs high >= 1)")

    def concrete(self, values: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(values[d] if isinstance(d, str) else d for d in self.shape)


def fill(spec: TensorSpec, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A random input of ``shape`` as ``spec.fill`` says (normal, ones, or indices below ``high``)."""
    if spec.fill == "ones":
        return np.ones(shape, dtype=spec.dtype)
    if spec.fill == "index":
        return rng.integers(0, spec.high, size=shape).astype(spec.dtype)
    return rng.standard_normal(shape).astype(spec.dtype)
