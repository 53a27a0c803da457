"""One GPT-2 transformer block, written with ``tvm.relax.frontend.nn``.

``x (b, n, hidden)`` → LayerNorm → fused qkv projection (with bias) → multi-head causal
attention → output projection (with bias) → residual add → LayerNorm → MLP (fc with bias,
GELU with the tanh approximation of GPT-2's ``gelu_new``, proj with bias) → residual add.

Batch ``b`` and sequence ``n`` are symbolic; ``x`` is the only input. Attention uses
``op.scaled_dot_product_attention(..., is_causal=True)``. The projections are ordinary
``Linear`` layers (weight ``(out, in)``), not GPT-2's transposed ``Conv1D``.

Weights (names as in ``main`` and the torch reference's state_dict): ``ln_1.{weight,bias}``,
``attn.c_attn.{weight,bias}`` (q, k, v stacked along the output), ``attn.c_proj.{weight,bias}``,
``ln_2.{weight,bias}``, ``mlp.c_fc.{weight,bias}``, ``mlp.c_proj.{weight,bias}``.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from .base import Workload
from .common import Builtin, check_dtype, check_positive, load_torch, make_workload, require

NAME = "gpt2-block"
DEFAULTS: dict[str, object] = {
    "hidden": 256,
    "heads": 4,
    "ffn": 1024,
    "max_seq": 1024,
    "max_batch": 4,
    "eps": 1e-5,
    "dtype": "float32",
}


class Attention(nn.Module):
    """Multi-head causal self-attention with a fused, biased qkv projection."""

    def __init__(self, hidden: int, heads: int, dtype: str):
        self.heads, self.head_dim = heads, hidden // heads
        self.c_attn = nn.Linear(hidden, 3 * hidden, bias=True, dtype=dtype)
        self.c_proj = nn.Linear(hidden, hidden, bias=True, dtype=dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        b, n, hidden = x.shape
        q, k, v = op.split(self.c_attn(x), 3, axis=-1)
        shape = (b, n, self.heads, self.head_dim)
        o = op.scaled_dot_product_attention(
            op.reshape(q, shape), op.reshape(k, shape), op.reshape(v, shape), is_causal=True
        )
        return self.c_proj(op.reshape(o, (b, n, hidden)))


class MLP(nn.Module):
    """GPT-2 MLP: ``c_proj(gelu_tanh(c_fc(x)))``."""

    def __init__(self, hidden: int, ffn: int, dtype: str):
        self.c_fc = nn.Linear(hidden, ffn, bias=True, dtype=dtype)
        self.c_proj = nn.Linear(ffn, hidden, bias=True, dtype=dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return self.c_proj(op.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    """The Relax ``nn`` GPT-2 block."""

    def __init__(self, cfg: Mapping[str, object]):
        hidden, dtype, eps = int(cfg["hidden"]), str(cfg["dtype"]), float(cfg["eps"])
        self.ln_1 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.attn = Attention(hidden, int(cfg["heads"]), dtype)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.mlp = MLP(hidden, int(cfg["ffn"]), dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        h = x + self.attn(self.ln_1(x))
        return h + self.mlp(self.ln_2(h))


class TorchAttention(torch.nn.Module):
    """Torch reference of :class:`Attention`."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.c_attn = torch.nn.Linear(hidden, 3 * hidden)
        self.c_proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, hidden = x.shape
        q, k, v = (
            t.view(b, n, self.heads, self.head_dim).transpose(1, 2) for t in self.c_attn(x).split(hidden, dim=-1)
        )
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(o.transpose(1, 2).reshape(b, n, hidden))


class TorchGPT2Block(torch.nn.Module):
    """Torch reference of :class:`GPT2Block`; same state_dict keys as the exported weights."""

    def __init__(self, cfg: Mapping[str, object]):
        super().__init__()
        hidden, ffn, eps = int(cfg["hidden"]), int(cfg["ffn"]), float(cfg["eps"])
        self.ln_1 = torch.nn.LayerNorm(hidden, eps=eps)
        self.attn = TorchAttention(hidden, int(cfg["heads"]))
        self.ln_2 = torch.nn.LayerNorm(hidden, eps=eps)
        self.mlp = torch.nn.Module()
        self.mlp.c_fc = torch.nn.Linear(hidden, ffn)
        self.mlp.c_proj = torch.nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.ln_1(x))
        m = self.mlp.c_proj(torch.nn.functional.gelu(self.mlp.c_fc(self.ln_2(h)), approximate="tanh"))
        return h + m


def torch_reference(config: Mapping[str, object], params: Mapping[str, np.ndarray]) -> TorchGPT2Block:
    """Build the float32 torch reference for ``config`` holding ``params``."""
    return load_torch(TorchGPT2Block(config), params)


def block_flops(config: Mapping[str, object], b: int, n: int) -> float:
    """FLOPs: projections, full (unmasked) QK^T and PV, MLP, and approximate elementwise work."""
    hidden, heads, ffn = int(config["hidden"]), int(config["heads"]), int(config["ffn"])
    tokens = b * n
    matmuls = 2.0 * tokens * (4 * hidden * hidden + 2 * hidden * ffn)
    attention = 4.0 * b * heads * n * n * (hidden // heads) + 5.0 * b * heads * n * n
    elementwise = tokens * (2 * 8.0 * hidden + 4.0 * hidden + 10.0 * ffn)
    return matmuls + attention + elementwise


def build(config: dict[str, object]) -> Workload:
    """Build the ``gpt2-block`` workload from a complete, typed config (see :data:`DEFAULTS`)."""
    check_positive(config, "hidden", "heads", "ffn", "max_seq", "max_batch", "eps")
    check_dtype(config["dtype"])
    # TVM 0.27 legalizes layer_norm for float32 and float16 only (its bfloat16 build fails deep in LegalizeOps)
    require(
        config["dtype"] != "bfloat16",
        "gpt2-block does not support dtype 'bfloat16' (TVM's layer_norm takes float32 or float16): use one of float32, "
        "float16",
    )
    hidden, heads = int(config["hidden"]), int(config["heads"])
    require(hidden % heads == 0, f"config hidden={hidden} is invalid: it must be a multiple of heads={heads}")

    def flops(dims: Mapping[str, int]) -> float:
        return block_flops(config, dims["b"], dims["n"])

    return make_workload(NAME, GPT2Block(config), config, lambda params: torch_reference(config, params), flops)


BUILTIN = Builtin(NAME, "GPT-2 block (LayerNorm, fused qkv, causal attention, gelu_tanh MLP)", DEFAULTS, build)
