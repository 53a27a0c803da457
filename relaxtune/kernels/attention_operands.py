"""Where the fused attention kernel reads q, k and v: `Operands`, which `attention_kernel` (`attention_tir.py`)
takes and FuseAttentionPrologue sets, and the expressions the kernel reads them with (`plus`, `rotated`).

With ``operands`` q, k and v are read where the model computed them: each from a ``(b, seq, total heads, d)``
tensor (the merged projection's output, viewed as heads) at a head offset, not from sliced copies; with
``rope`` q and k are also rotated, rotate-half form ``x·cos + rot(x)·sin``, ``rot(x)[i] = -x[i + d/2]`` for
``i < d/2`` else ``x[i - d/2]``, from ``(rows >= n, d)`` cos and sin tables (inputs after v; position ``i``
reads row ``i``). ``OPERAND_FIELDS``: the fields in the order the kernel records them in its ``ARGS_ATTR``
(`attention_spec.py`), which `retiled` (`attention_retile.py`) reads back.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T


@dataclass(frozen=True)
class Operands:
    """Where the kernel reads q, k and v (module docstring): each from a tensor of ``*_heads`` heads
    starting at head ``*_offset``; ``rope``: q and k rotated (rotate-half) on load."""

    q_heads: int
    k_heads: int
    v_heads: int
    q_offset: int = 0
    k_offset: int = 0
    v_offset: int = 0
    rope: bool = False

    def check(self, heads: int, kv_heads: int, head_dim: int) -> None:
        """Raises ValueError unless these operands hold `heads` query and `kv_heads` key/value heads (and, with
        ``rope``, `head_dim` is even)."""
        if (
            self.q_offset + heads > self.q_heads
            or self.k_offset + kv_heads > self.k_heads
            or self.v_offset + kv_heads > self.v_heads
        ):
            raise ValueError(f"operands {self} do not hold {heads} query and {kv_heads} key/value heads")
        if self.rope and head_dim % 2:
            raise ValueError(f"rotate-half needs an even head_dim, not {head_dim}")


OPERAND_FIELDS = ("q_heads", "k_heads", "v_heads", "q_offset", "k_offset", "v_offset", "rope")


def plus(base, offset: int):
    """The head index ``base + offset`` in a source tensor (`offset` an int64 constant, as the kernel's extents)."""
    return base if offset == 0 else base + tirx.const(offset, "int64")


def rotated(x, table_cos, table_sin, bi, row, head, side, i, half: int):
    """Element ``side * d/2 + i`` of x[bi, row, head] rotated (rotate-half) with the tables, as float32;
    `half`: d/2."""
    acc = "float32"
    d = side * half + i
    partner = T.Cast(acc, x[bi, row, head, (1 - side) * half + i])
    turned = T.if_then_else(side == 0, -partner, partner)
    return T.Cast(acc, x[bi, row, head, d]) * T.Cast(acc, table_cos[row, d]) + turned * T.Cast(acc, table_sin[row, d])
