"""The CPU rule for the fused attention kernel (`schedules/rules/cpu_attention.py`): its loop
structure, and the scheduled kernel against numpy where q, k and v are read in place from a merged
projection (the form FuseAttentionPrologue builds in llama-block / gpt2-block), at n = 1, a middle
value that ends in a partial key tile, and the blocks' upper bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm

from relaxtune.kernels.attention_operands import Operands
from relaxtune.kernels.attention_tir import attention_kernel
from relaxtune.schedules.rules.cpu_attention import Attention

TARGET = {"kind": "llvm", "num-cores": 2}
SHAPES = {  # name: heads, kv_heads, head_dim, operands (the merged q/k/v projection, heads at offsets)
    "gpt2": (4, 4, 64, Operands(12, 12, 12, 0, 4, 8)),
    "llama-rope-gqa": (4, 2, 64, Operands(8, 8, 8, 0, 4, 6, rope=True)),
}
BOUND = 1024  # both blocks' max_seq


def scheduled(name: str):
    heads, kv_heads, head_dim, operands = SHAPES[name]
    sch = Attention().apply(
        attention_kernel(heads, kv_heads, head_dim, "float32", "TopLeft", operands=operands),
        tvm.target.Target(TARGET),
        False,
    )
    assert sch is not None
    return sch.mod["main"]


def test_keys_transposed_in_parallel_along_head_dim():
    """The keys' transpose is a parallel loop of its own, each key row read along head_dim (the old
    schedule ran it on one thread with gathers along the key tile: a third of the kernel at n = 128)."""
    script = scheduled("gpt2").script()
    transpose = script[: script.index('T.sblock("k_transpose")')].splitlines()
    assert script.count("T.parallel") == 2 and "T.parallel" in "".join(transpose)
    innermost = transpose[-2].strip()  # the loop right above the block: head_dim, vectorized (key rows read along d)
    assert innermost.startswith("for dd") and "T.vectorized" in innermost


def numpy_reference(qkv, operands, heads, kv_heads, head_dim, cos, sin):
    n = qkv.shape[1]
    take = lambda offset, count: qkv[:, :, offset : offset + count].astype(np.float64)  # noqa: E731
    q, k, v = take(operands.q_offset, heads), take(operands.k_offset, kv_heads), take(operands.v_offset, kv_heads)
    if operands.rope:
        half = head_dim // 2
        rotate = lambda x: x * cos[:n, None] + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin[:n, None]  # noqa: E731
        q, k = rotate(q), rotate(k)
    k, v = np.repeat(k, heads // kv_heads, 2), np.repeat(v, heads // kv_heads, 2)
    s = np.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(head_dim)
    s = np.where(np.arange(n)[None, :] <= np.arange(n)[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhij,bjhd->bihd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_in_place_kernel_matches_numpy(name):
    heads, kv_heads, head_dim, operands = SHAPES[name]
    kernel = tvm.compile(
        tvm.IRModule({"attn": scheduled(name).with_attr("global_symbol", "attn")}), target=tvm.target.Target(TARGET)
    )["attn"]
    rng = np.random.default_rng(0)
    angles = np.arange(BOUND)[:, None] * 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)[None]
    cos, sin = (f(np.concatenate([angles, angles], -1)).astype("float32") for f in (np.cos, np.sin))
    for batch, n in [(1, 1), (2, 100), (1, BOUND)]:
        qkv = rng.standard_normal((batch, n, operands.q_heads, head_dim)).astype("float32") * 2
        tables = [tvm.runtime.tensor(cos), tvm.runtime.tensor(sin)] if operands.rope else []
        out = tvm.runtime.tensor(np.full((batch, n, heads, head_dim), np.nan, "float32"))
        kernel(*[tvm.runtime.tensor(qkv)] * 3, *tables, out)
        expected = numpy_reference(qkv, operands, heads, kv_heads, head_dim, cos, sin)
        np.testing.assert_allclose(out.numpy(), expected, rtol=2e-5, atol=2e-5, err_msg=f"{name} b={batch} n={n}")
