"""The Llama SwiGLU MLP alone: ``down(silu(x @ Wgate^T) * (x @ Wup^T))``.

Input ``x`` has shape ``(b, n, hidden)`` with symbolic batch ``b`` and sequence ``n``.
Weights (``main``'s parameter names): ``gate_proj_weight (ffn, hidden)``,
``up_proj_weight (ffn, hidden)``, ``down_proj_weight (hidden, ffn)``; no biases.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from .base import Workload
from .common import Builtin, check_dtype, check_positive, load_torch, make_workload

NAME = "mlp"
DEFAULTS: dict[str, object] = {
    "hidden": 256,
    "ffn": 704,
    "max_seq": 1024,
    "max_batch": 4,
    "dtype": "float32",
}


class SwiGLU(nn.Module):
    """Relax ``nn`` SwiGLU MLP, as in Llama (no biases)."""

    def __init__(self, hidden: int, ffn: int, dtype: str):
        self.gate_proj = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(ffn, hidden, bias=False, dtype=dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return self.down_proj(op.silu(self.gate_proj(x)) * self.up_proj(x))


class TorchSwiGLU(torch.nn.Module):
    """The torch reference, with the same state_dict keys as :class:`SwiGLU` (dotted)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, ffn, bias=False)
        self.up_proj = torch.nn.Linear(hidden, ffn, bias=False)
        self.down_proj = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def torch_reference(config: Mapping[str, object], params: Mapping[str, np.ndarray]) -> TorchSwiGLU:
    """Build the float32 torch reference for ``config`` holding ``params``."""
    return load_torch(TorchSwiGLU(int(config["hidden"]), int(config["ffn"])), params)


def mlp_flops(hidden: int, ffn: int, tokens: int) -> float:
    """FLOPs of one SwiGLU MLP over ``tokens`` rows: 3 matmuls plus ~5 ops per silu*up element."""
    return tokens * (3 * 2.0 * hidden * ffn + 5.0 * ffn)


def build(config: dict[str, object]) -> Workload:
    """Build the ``mlp`` workload from a complete, typed config (see :data:`DEFAULTS`)."""
    check_positive(config, "hidden", "ffn", "max_seq", "max_batch")
    check_dtype(config["dtype"])
    hidden, ffn = int(config["hidden"]), int(config["ffn"])

    def flops(dims: Mapping[str, int]) -> float:
        return mlp_flops(hidden, ffn, dims["b"] * dims["n"])

    return make_workload(
        NAME,
        SwiGLU(hidden, ffn, str(config["dtype"])),
        config,
        lambda params: torch_reference(config, params),
        flops,
    )


BUILTIN = Builtin(NAME, "Llama SwiGLU MLP: down(silu(gate(x)) * up(x))", DEFAULTS, build)
