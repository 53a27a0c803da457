"""What a workload is: a Relax module with symbolic, bounded dimensions, its weights, and a reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from ..errors import UserError
from ..runtime.tensor_spec import FILLS, TensorSpec, fill  # noqa: F401 (workloads name them from here)


@dataclass(frozen=True)
class Dim:
    """A symbolic dimension: its name in the IR, its bounds, and the value tuning specialises at."""

    name: str
    lower: int
    upper: int
    representative: int

    def check(self, value: int) -> None:
        if not self.lower <= value <= self.upper:
            raise UserError(
                f"shape {self.name}={value} is outside the declared bounds: "
                f"{self.name} must be in [{self.lower}, {self.upper}]"
            )


@dataclass(frozen=True)
class Workload:
    """A model ready for the pipeline.

    ``mod["main"]`` takes the inputs first, then every weight, in the order of ``inputs`` and
    ``params``; it carries ``num_input`` and ``tir_var_upper_bound`` / ``tir_var_lower_bound``.
    ``reference(inputs, params)`` computes the expected output with numpy or torch, and
    ``torch_module()`` (when given) builds an equivalent ``torch.nn.Module`` with these weights,
    whose ``forward`` takes the inputs positionally, for benchmarks.

    A module with several entry functions (a language model: ``embed``, ``prefill``, ``decode``)
    names in ``entries`` the ones split into shape buckets; ``weights_nk`` keeps its GEMMs reading the
    weights as stored, (out, in) (the pipeline's `target_fusion_passes`); ``exporter``, when set,
    writes its artifact instead of `relaxtune.runtime.artifact.export` (same arguments).
    """

    name: str
    mod: object  # tvm.IRModule; typed loosely so this module imports without TVM
    params: dict[str, np.ndarray]
    inputs: tuple[TensorSpec, ...]
    dims: dict[str, Dim]
    config: dict[str, object] = field(default_factory=dict)
    reference: Callable[[dict[str, np.ndarray], dict[str, np.ndarray]], np.ndarray] | None = None
    torch_module: Callable[[], object] | None = None
    flops: Callable[[Mapping[str, int]], float] | None = None
    spec: str = ""  # how it was named to `workloads.load` (built-in name, hf:..., torch:..., path)
    spec_config: dict[str, object] = field(default_factory=dict)  # the config given to `load` with it
    entries: tuple[str, ...] = ("main",)
    weights_nk: bool = False
    exporter: Callable[..., dict] | None = None
    # what `relaxtune bench` runs when --systems is not given (empty: bench's default)
    bench_systems: tuple[str, ...] = ()

    def check_shape(self, values: Mapping[str, int]) -> None:
        unknown = sorted(set(values) - set(self.dims))
        if unknown:
            raise UserError(
                f"unknown dimension {unknown[0]!r} for {self.name}: its symbolic dimensions are {sorted(self.dims)}"
            )
        missing = sorted(set(self.dims) - set(values))
        if missing:
            raise UserError(f"no value given for dimension {missing[0]!r} of {self.name} (use --shape {missing[0]}=N)")
        for name, value in values.items():
            self.dims[name].check(value)

    def random_inputs(self, values: Mapping[str, int], seed: int = 0) -> dict[str, np.ndarray]:
        self.check_shape(values)
        rng = np.random.default_rng(seed)
        return {t.name: fill(t, t.concrete(values), rng) for t in self.inputs}
