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


def numpy_dtype(dtype: str) -> np.dtype:
    """``dtype`` as numpy knows it: bfloat16 through ml_dtypes (which TVM itself needs for it)."""
    if dtype != "bfloat16":
        return np.dtype(dtype)
    try:
        import ml_dtypes
    except ImportError as err:
        raise ValueError("bfloat16 tensors need the ml_dtypes package (pip install ml_dtypes)") from err
    return np.dtype(ml_dtypes.bfloat16)


def restore(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` as read back from an .npz, with its dtype: numpy stores bfloat16 as 2-byte void ("V2")."""
    want = numpy_dtype(dtype)
    if array.dtype != want and array.dtype.kind == "V" and array.dtype.itemsize == want.itemsize:
        return array.view(want)
    return array


def fill(spec: TensorSpec, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A random input of ``shape`` as ``spec.fill`` says (normal, ones, or indices below ``high``)."""
    dtype = numpy_dtype(spec.dtype)
    if spec.fill == "ones":
        return np.ones(shape, dtype=dtype)
    if spec.fill == "index":
        return rng.integers(0, spec.high, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)
