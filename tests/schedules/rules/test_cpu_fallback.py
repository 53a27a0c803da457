"""cpu_fallback.Fallback: whatever the specific rules decline (here: a reduction over a non-trailing
axis, and a row-wise reduction followed by a transpose whose blocks share no row loop)."""

from __future__ import annotations

import numpy as np
import tvm

from relaxtune.schedules.rules import apply_cpu_rules, cpu_rules
from relaxtune.schedules.rules.cpu_elementwise import Elementwise
from relaxtune.schedules.rules.cpu_fallback import Fallback
from relaxtune.schedules.rules.cpu_matmul import Matmul
from relaxtune.schedules.rules.cpu_reduction import Reduction


def _column_sum(kit):
    x = kit.tensor("x", (kit.B, kit.N, 48))
    return kit.build([x], lambda bb, x: kit.R.sum(x, axis=1))  # reduces the symbolic middle axis


def _first_rule(kit, func, target):
    for rule in cpu_rules():
        if kit.apply_rule(rule, func, target) is not None:
            return type(rule).__name__
    return None


def test_fires_on_column_sum_that_specific_rules_decline(kit, cpu_target):
    func = kit.only_prim_func(kit.fuse(_column_sum(kit), cpu_target))
    for rule in (Matmul(), Reduction(), Elementwise()):
        assert kit.apply_rule(rule, func, cpu_target) is None, type(rule).__name__
    assert _first_rule(kit, func, cpu_target) == "Fallback"
    script = kit.apply_rule(Fallback(), func, cpu_target).mod["main"].script()
    assert "T.parallel" in script  # over b and the 48 output columns, never over the reduced n


def test_column_sum_numerics(kit, cpu_target):
    mod = apply_cpu_rules(kit.fuse(_column_sum(kit), cpu_target), cpu_target)
    assert all(kit.is_scheduled(f) for f in kit.prim_funcs(mod).values())
    run = kit.Runner(mod, cpu_target)
    rng = np.random.default_rng(0)
    for b, n in [(1, 1), (2, 37), (1, 128)]:
        x = kit.rand(rng, b, n, 48)
        kit.assert_close(run(x), x.astype("float64").sum(axis=1), rtol=1e-6)


def test_vectorizes_static_inner_loop_of_injective_block(kit, cpu_target):
    """Called directly on an element-wise kernel it parallelizes and vectorizes like the rule it backs."""
    x = kit.tensor("x", (kit.N, 64))
    func = kit.only_prim_func(kit.fuse(kit.build([x], lambda bb, x: kit.R.multiply(x, x)), cpu_target))
    script = kit.apply_rule(Fallback(), func, cpu_target).mod["main"].script()
    assert "T.parallel" in script and "T.vectorized" in script


def test_does_not_fire_for_non_cpu_targets(kit, cpu_target):
    func = kit.only_prim_func(kit.fuse(_column_sum(kit), cpu_target))
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    assert kit.apply_rule(Fallback(), func, cuda) is None
    assert Fallback().apply("not a PrimFunc", cpu_target, False) is None
