"""cpu_reduction.Reduction: softmax over symbolic keys (causal mask), rms_norm, layer_norm."""

from __future__ import annotations

import re

import numpy as np

from relaxtune.schedules.rules import apply_cpu_rules
from relaxtune.schedules.rules.cpu_reduction import Reduction

H = 64


def _masked_softmax(kit):
    s, mask = kit.tensor("s", (kit.B, 2, kit.N, kit.N)), kit.tensor("mask", (kit.N, kit.N))
    return kit.build([s, mask], lambda bb, s, mask: kit.R.nn.softmax(kit.R.add(s, mask), axis=-1))


def test_fires_on_softmax_over_symbolic_keys(kit, cpu_target):
    func = kit.prim_funcs(kit.fuse(_masked_softmax(kit), cpu_target))["softmax"]
    sch = kit.apply_rule(Reduction(), func, cpu_target)
    assert sch is not None
    script = sch.mod["main"].script()
    assert "T.parallel" in script and "T.vectorized" in script
    assert "pragma_loop_partition_hint" in script  # symbolic loops peel their tail
    assert "_rf" in script  # vectorized partial max / sum
    # the keys are padded to the SIMD width: with -FLT_MAX for the max, 0 for the sum
    assert re.search(r"if_then_else\(.*T\.float32\(-340282346638528859811704183484516925440", script)
    assert re.search(r"if_then_else\(.*T\.float32\(0\.0\)\)", script)


def test_causal_softmax_numerics(kit, cpu_target):
    mod = apply_cpu_rules(kit.fuse(_masked_softmax(kit), cpu_target), cpu_target)
    assert all(kit.is_scheduled(f) for f in kit.prim_funcs(mod).values())
    run = kit.Runner(mod, cpu_target)
    rng = np.random.default_rng(0)
    for b, n in [(1, 1), (2, 37), (1, 128)]:
        s = kit.rand(rng, b, 2, n, n, scale=3.0) - 200.0  # exp(x - 0) underflows: a 0-padded max gives 0/0
        mask = kit.causal_mask(n)
        kit.assert_close(run(s, mask), kit.np_softmax(s.astype("float64") + mask), rtol=1e-6)


def test_rms_norm_and_layer_norm(kit, cpu_target):
    x, g, beta = kit.tensor("x", (kit.B, kit.N, H)), kit.tensor("g", (H,)), kit.tensor("beta", (H,))

    def body(bb, x, g, beta):
        r = bb.emit(kit.R.nn.rms_norm(x, g, axes=[-1], epsilon=1e-5))
        return kit.R.nn.layer_norm(r, g, beta, axes=[-1], epsilon=1e-5)

    fused = kit.fuse(kit.build([x, g, beta], body), cpu_target)
    for name, func in kit.prim_funcs(fused).items():
        sch = kit.apply_rule(Reduction(), func, cpu_target)
        assert sch is not None, name
        assert "T.parallel" in sch.mod["main"].script() and "_rf" in sch.mod["main"].script()
    run = kit.Runner(apply_cpu_rules(fused, cpu_target), cpu_target)
    rng = np.random.default_rng(1)
    gv, bv = kit.rand(rng, H), kit.rand(rng, H)
    for b, n in [(1, 1), (2, 37), (1, 128)]:
        xv = kit.rand(rng, b, n, H, scale=2.0) + 1.0
        kit.assert_close(run(xv, gv, bv), kit.np_layer_norm(kit.np_rms_norm(xv, gv), gv, bv))


def test_does_not_fire_on_matmul_or_elementwise(kit, cpu_target):
    x, w = kit.tensor("x", (kit.N, H)), kit.tensor("w", (H, H))
    matmul = kit.only_prim_func(kit.fuse(kit.build([x, w], lambda bb, x, w: kit.R.matmul(x, w)), cpu_target))
    add = kit.only_prim_func(kit.fuse(kit.build([x], lambda bb, x: kit.R.nn.silu(x)), cpu_target))
    assert kit.apply_rule(Reduction(), matmul, cpu_target) is None
    assert kit.apply_rule(Reduction(), add, cpu_target) is None
