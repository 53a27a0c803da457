"""One Llama decoder block, written with ``tvm.relax.frontend.nn`` (the module API MLC-LLM uses).

``x (b, n, hidden)`` → RMSNorm → q/k/v projections → rotary embedding (rotate-half) →
grouped-query causal attention over the current sequence (no KV cache; each of the
``kv_heads`` key/value heads is repeated ``heads // kv_heads`` times, like HF ``repeat_kv``) →
o_proj → residual add → RMSNorm → SwiGLU MLP (``down(silu(gate(h)) * up(h))``) → residual add.

Batch ``b`` and sequence ``n`` are both symbolic and ``x`` is the only input: the rotary
``cos``/``sin`` tables of shape ``(n, head_dim)`` are computed inside the graph by a TE
compute (``op.tensor_expr_op``) from the positions ``0..n-1``. The angle
``pos * rope_theta ** (-2i / head_dim)`` is evaluated in float64 and only the final cos/sin
are cast to ``dtype``, so positions near ``max_seq`` still match the reference to float32
rounding. Attention uses ``op.scaled_dot_product_attention(..., is_causal=True)``.

Weights (names as in ``main`` and the torch reference's state_dict): ``input_layernorm.weight``,
``self_attn.{q,k,v,o}_proj.weight``, ``post_attention_layernorm.weight``,
``mlp.{gate,up,down}_proj.weight``; no biases.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import torch
import tvm
from tvm import te
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from .base import Workload
from .common import Builtin, check_dtype, check_positive, load_torch, make_workload, require
from .mlp import SwiGLU, TorchSwiGLU, mlp_flops

NAME = "llama-block"
DEFAULTS: dict[str, object] = {
    "hidden": 256,
    "heads": 4,
    "kv_heads": 2,
    "ffn": 704,
    "max_seq": 1024,
    "max_batch": 4,
    "rope_theta": 10000.0,
    "eps": 1e-5,
    "dtype": "float32",
}


def _rope_tables(n, head_dim: int, theta: float, dtype: str):
    """TE compute of the rotate-half cos and sin tables, shape ``(n, head_dim)``."""
    half = head_dim // 2
    f64 = "float64"

    def angle(s, d):
        exponent = (d % half).astype(f64) * tvm.tirx.const(-2.0 / head_dim, f64)
        return s.astype(f64) * tvm.tirx.power(tvm.tirx.const(theta, f64), exponent)

    cos = te.compute((n, head_dim), lambda s, d: tvm.tirx.cos(angle(s, d)).astype(dtype), name="rope_cos")
    sin = te.compute((n, head_dim), lambda s, d: tvm.tirx.sin(angle(s, d)).astype(dtype), name="rope_sin")
    return [cos, sin]


def _rotate_half(x: nn.Tensor) -> nn.Tensor:
    x1, x2 = op.split(x, 2, axis=-1)
    return op.concat([op.negative(x2), x1], dim=-1)


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary embedding (no KV cache)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, theta: float, dtype: str):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.theta, self.dtype = theta, dtype
        kv_dim = kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        b, n, _ = x.shape
        d = self.head_dim
        q = op.reshape(self.q_proj(x), (b, n, self.heads, d))
        k = op.reshape(self.k_proj(x), (b, n, self.kv_heads, d))
        v = op.reshape(self.v_proj(x), (b, n, self.kv_heads, d))
        cos, sin = op.tensor_expr_op(
            lambda length: _rope_tables(length, d, self.theta, self.dtype), "rope_cos_sin", [n]
        )
        cos, sin = op.reshape(cos, (1, n, 1, d)), op.reshape(sin, (1, n, 1, d))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.heads != self.kv_heads:
            k = op.repeat(k, self.heads // self.kv_heads, axis=2)
            v = op.repeat(v, self.heads // self.kv_heads, axis=2)
        o = op.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, n, heads, d)
        return self.o_proj(op.reshape(o, (b, n, self.heads * d)))


class LlamaBlock(nn.Module):
    """The Relax ``nn`` Llama decoder block."""

    def __init__(self, cfg: Mapping[str, object]):
        hidden, dtype, eps = int(cfg["hidden"]), str(cfg["dtype"]), float(cfg["eps"])
        self.input_layernorm = nn.RMSNorm(hidden, -1, eps, bias=False, dtype=dtype)
        self.self_attn = Attention(hidden, int(cfg["heads"]), int(cfg["kv_heads"]), float(cfg["rope_theta"]), dtype)
        self.post_attention_layernorm = nn.RMSNorm(hidden, -1, eps, bias=False, dtype=dtype)
        self.mlp = SwiGLU(hidden, int(cfg["ffn"]), dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        h = x + self.self_attn(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


class TorchAttention(torch.nn.Module):
    """Torch reference of :class:`Attention` (HF Llama semantics, float32)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, theta: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, hidden // heads, theta
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, n, self.heads, d).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, d).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, d).transpose(1, 2)
        inv_freq = 1.0 / self.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)

        def rotate_half(t):
            return torch.cat([-t[..., d // 2 :], t[..., : d // 2]], dim=-1)

        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, n, self.heads * d))


class TorchLlamaBlock(torch.nn.Module):
    """Torch reference of :class:`LlamaBlock`; same state_dict keys as the exported weights."""

    def __init__(self, cfg: Mapping[str, object]):
        super().__init__()
        hidden, eps = int(cfg["hidden"]), float(cfg["eps"])
        self.input_layernorm = torch.nn.RMSNorm(hidden, eps=eps)
        self.self_attn = TorchAttention(hidden, int(cfg["heads"]), int(cfg["kv_heads"]), float(cfg["rope_theta"]))
        self.post_attention_layernorm = torch.nn.RMSNorm(hidden, eps=eps)
        self.mlp = TorchSwiGLU(hidden, int(cfg["ffn"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


def torch_reference(config: Mapping[str, object], params: Mapping[str, np.ndarray]) -> TorchLlamaBlock:
    """Build the float32 torch reference for ``config`` holding ``params``."""
    return load_torch(TorchLlamaBlock(config), params)


def block_flops(config: Mapping[str, object], b: int, n: int) -> float:
    """FLOPs: projections, full (unmasked) QK^T and PV, softmax/rope/norm elementwise, MLP."""
    hidden, heads, kv_heads = int(config["hidden"]), int(config["heads"]), int(config["kv_heads"])
    d = hidden // heads
    tokens = b * n
    proj = 2.0 * tokens * hidden * (2 * hidden + 2 * kv_heads * d)
    attention = 4.0 * b * heads * n * n * d + 5.0 * b * heads * n * n
    elementwise = tokens * (2 * 4.0 * hidden + 6.0 * (heads + kv_heads) * d + 2.0 * hidden)
    return proj + attention + elementwise + mlp_flops(hidden, int(config["ffn"]), tokens)


def build(config: dict[str, object]) -> Workload:
    """Build the ``llama-block`` workload from a complete, typed config (see :data:`DEFAULTS`)."""
    check_positive(config, "hidden", "heads", "kv_heads", "ffn", "max_seq", "max_batch", "rope_theta", "eps")
    check_dtype(config["dtype"])
    hidden, heads, kv_heads = int(config["hidden"]), int(config["heads"]), int(config["kv_heads"])
    require(hidden % heads == 0, f"config hidden={hidden} is invalid: it must be a multiple of heads={heads}")
    require(heads % kv_heads == 0, f"config kv_heads={kv_heads} is invalid: it must divide heads={heads}")
    require(
        (hidden // heads) % 2 == 0,
        f"config hidden={hidden}, heads={heads} is invalid: head_dim=hidden/heads must be even for rotary",
    )
    require(math.isfinite(float(config["rope_theta"])), "config rope_theta must be finite")

    def flops(dims: Mapping[str, int]) -> float:
        return block_flops(config, dims["b"], dims["n"])

    return make_workload(NAME, LlamaBlock(config), config, lambda params: torch_reference(config, params), flops)


BUILTIN = Builtin(NAME, "Llama decoder block (RMSNorm, RoPE, GQA causal attention, SwiGLU)", DEFAULTS, build)
