"""cpu_matmul.Matmul: dense / batched matmul with symbolic rows, epilogues and prologues."""

from __future__ import annotations

import numpy as np
import pytest

from relaxtune.schedules.rules import apply_cpu_rules
from relaxtune.schedules.rules.cpu_matmul import Matmul

K, F = 64, 96  # small static reduction / output sizes keep the suite fast


def _dense_gelu(kit):
    x, w, bias = kit.tensor("x", (kit.B, kit.N, K)), kit.tensor("w", (K, F)), kit.tensor("bias", (F,))
    return kit.build([x, w, bias], lambda bb, x, w, bias: kit.R.nn.gelu(kit.R.add(kit.R.matmul(x, w), bias)))


def test_fires_on_dense_with_epilogue_and_keeps_predicates_out_of_inner_loops(kit, cpu_target):
    func = kit.only_prim_func(kit.fuse(_dense_gelu(kit), cpu_target), "matmul")
    sch = kit.apply_rule(Matmul(), func, cpu_target)
    assert sch is not None
    script = sch.mod["main"].script()
    assert "T.parallel" in script and "T.vectorized" in script and "T.unroll" in script
    preds = kit.block_predicates(sch.mod["main"])
    assert preds["matmul_update"] == "T.bool(True)"  # rows padded, not predicated
    assert "erf" not in script  # fast_math replaced the libm call
    assert "_pad" in script


def test_dense_gelu_numerics_symbolic_b_and_n(kit, cpu_target):
    mod = apply_cpu_rules(kit.fuse(_dense_gelu(kit), cpu_target), cpu_target)
    assert all(kit.is_scheduled(f) for f in kit.prim_funcs(mod).values())
    run = kit.Runner(mod, cpu_target)
    rng = np.random.default_rng(0)
    w, bias = kit.rand(rng, K, F, scale=0.2), kit.rand(rng, F)
    for b, n in [(1, 1), (2, 37), (1, 128)]:
        x = kit.rand(rng, b, n, K)
        kit.assert_close(run(x, w, bias), kit.np_gelu(x.astype("float64") @ w + bias))


def test_residual_and_multiply_epilogues(kit, cpu_target):
    x, w, r = kit.tensor("x", (1, kit.N, K)), kit.tensor("w", (K, K)), kit.tensor("r", (1, kit.N, K))
    mod = kit.build([x, w, r], lambda bb, x, w, r: kit.R.add(r, kit.R.multiply(kit.R.matmul(x, w), r)))
    fused = kit.fuse(mod, cpu_target)
    assert len(kit.prim_funcs(fused)) == 1  # matmul + multiply + add in one kernel
    run = kit.Runner(apply_cpu_rules(fused, cpu_target), cpu_target)
    rng = np.random.default_rng(1)
    wv = kit.rand(rng, K, K, scale=0.2)
    for n in kit.NS:
        xv, rv = kit.rand(rng, 1, n, K), kit.rand(rng, 1, n, K)
        kit.assert_close(run(xv, wv, rv), rv + (xv.astype("float64") @ wv) * rv)


@pytest.mark.parametrize("transpose_k", [False, True])
def test_attention_batched_matmuls(kit, cpu_target, transpose_k):
    """q @ k^T (symbolic columns) and p @ v (symbolic reduction), both with symbolic n."""
    h, d = 2, 16
    q, k, v = (kit.tensor(s, (kit.B, h, kit.N, d)) for s in "qkv")

    def body(bb, q, k, v):
        kt = bb.emit(kit.R.permute_dims(k, [0, 1, 3, 2]))
        scores = bb.emit(kit.R.matmul(q, kt))
        return kit.R.matmul(scores, v)

    fused = kit.fuse(kit.build([q, k, v], body), cpu_target)
    for name, func in kit.prim_funcs(fused).items():
        if name.startswith("matmul"):
            assert kit.apply_rule(Matmul(), func, cpu_target) is not None, name
    run = kit.Runner(apply_cpu_rules(fused, cpu_target), cpu_target)
    rng = np.random.default_rng(2)
    for b, n in [(1, 1), (2, 37), (1, 128)]:
        qv, kv, vv = (kit.rand(rng, b, h, n, d) for _ in range(3))
        want = (qv.astype("float64") @ kv.transpose(0, 1, 3, 2)) @ vv
        kit.assert_close(run(qv, kv, vv), want)


def test_decode_static_single_row_and_fused_prologue(kit, cpu_target):
    """n = 1 static (GEMV-like) and a silu(x) * y prologue fused by pattern into the matmul."""
    from tvm import relax
    from tvm.relax.dpl import is_op, wildcard

    x, y, w = kit.tensor("x", (1, 1, K)), kit.tensor("y", (1, 1, K)), kit.tensor("w", (K, F))
    mod = kit.build([x, y, w], lambda bb, x, y, w: kit.R.matmul(kit.R.multiply(kit.R.nn.silu(x), y), w))
    pattern = is_op("relax.matmul")(is_op("relax.multiply")(is_op("relax.nn.silu")(wildcard()), wildcard()), wildcard())
    mod = relax.transform.FuseOpsByPattern([("t.silu_mul_mm", pattern)], bind_constants=False)(mod)
    fused = kit.fuse(mod, cpu_target)
    func = kit.only_prim_func(fused)
    assert "sigmoid" in func.script()  # the prologue is inside the matmul kernel
    sch = kit.apply_rule(Matmul(), func, cpu_target)
    assert sch is not None and "T.parallel" in sch.mod["main"].script()
    rng = np.random.default_rng(3)
    xv, yv, wv = kit.rand(rng, 1, 1, K), kit.rand(rng, 1, 1, K), kit.rand(rng, K, F)
    got = kit.run(apply_cpu_rules(fused, cpu_target), cpu_target, [xv, yv, wv])
    x64 = xv.astype("float64")
    kit.assert_close(got, (x64 / (1 + np.exp(-x64)) * yv) @ wv)


def test_does_not_fire_on_softmax_or_elementwise(kit, cpu_target):
    x = kit.tensor("x", (kit.N, K))
    softmax = kit.only_prim_func(kit.fuse(kit.build([x], lambda bb, x: kit.R.nn.softmax(x, axis=-1)), cpu_target))
    add = kit.only_prim_func(kit.fuse(kit.build([x], lambda bb, x: kit.R.add(x, x)), cpu_target))
    assert kit.apply_rule(Matmul(), softmax, cpu_target) is None
    assert kit.apply_rule(Matmul(), add, cpu_target) is None
