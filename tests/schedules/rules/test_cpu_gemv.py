"""cpu_gemv.Gemv: few-row matmuls with a K-contiguous weight (x @ W^T, as FuseTransposeMatmul makes)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax

from relaxtune.schedules.rules import apply_cpu_rules
from relaxtune.schedules.rules.cpu_gemv import Gemv
from relaxtune.schedules.rules.cpu_matmul import Matmul

K, F = 64, 48


def _fuse_nt(kit, mod, target):
    with target:
        mod = relax.transform.FuseTransposeMatmul()(mod)
    return kit.fuse(mod, target)


def _linear_gelu(kit, rows):
    x, wt, bias = kit.tensor("x", rows + (K,)), kit.tensor("wt", (F, K)), kit.tensor("bias", (F,))
    R = kit.R
    return kit.build([x, wt, bias], lambda bb, x, wt, bias: R.nn.gelu(R.add(R.matmul(x, R.permute_dims(wt)), bias)))


@pytest.mark.parametrize("rows", [(1, 1), (2, 1), (1, 3)])
def test_fires_on_static_decode_rows_and_matches_numpy(kit, cpu_target, rows):
    fused = _fuse_nt(kit, _linear_gelu(kit, rows), cpu_target)
    func = kit.only_prim_func(fused, "NT_matmul")
    sch = kit.apply_rule(Gemv(), func, cpu_target)
    assert sch is not None
    script = sch.mod["main"].script()
    assert "T.parallel" in script and "T.vectorized" in script and "_rf" in script
    rng = np.random.default_rng(0)
    x, wt, bias = kit.rand(rng, *rows, K), kit.rand(rng, F, K), kit.rand(rng, F)
    got = kit.run(apply_cpu_rules(fused, cpu_target), cpu_target, [x, wt, bias])
    kit.assert_close(got, kit.np_gelu(x.astype("float64") @ wt.T + bias))


def test_symbolic_rows_use_dot_products_up_to_16_rows(kit, cpu_target):
    """With symbolic b, n the Matmul rule owns the kernel and branches: dot products while b*n <= 16, one task per
    tile of weight rows walking the rows (columns outermost in the parallel loop); the packed, padded matmul
    beyond. Numerics on both sides of the branch, at 0 rows too."""
    x, wt = kit.tensor("x", (kit.B, kit.N, K)), kit.tensor("wt", (F, K))
    fused = _fuse_nt(kit, kit.build([x, wt], lambda bb, x, wt: kit.R.matmul(x, kit.R.permute_dims(wt))), cpu_target)
    func = kit.only_prim_func(fused, "NT_matmul")
    assert kit.apply_rule(Gemv(), func, cpu_target) is None
    script = kit.apply_rule(Matmul(), func, cpu_target).mod["main"].script()
    assert "if b * n <= T.int64(16):" in script and "_rf" in script and "_pad" in script
    dot = script[: script.index("else:")]
    assert re.search(r"for ax0_ax2_0_ax1_0_fused in T\.parallel\(b \* n \* T\.int64\(\d+\)\)", dot)  # j, then i
    run = kit.Runner(apply_cpu_rules(fused, cpu_target), cpu_target)
    rng = np.random.default_rng(1)
    wv = kit.rand(rng, F, K)
    for b, n in [(1, 0), (1, 1), (2, 1), (2, 8), (1, 16), (1, 17), (2, 37), (1, 128)]:
        xv = kit.rand(rng, b, n, K)
        got = run(xv, wv)
        assert got.shape == (b, n, F)
        if got.size:
            kit.assert_close(got, xv.astype("float64") @ wv.T)


def test_rows_a_multiple_of_more_than_16_keep_the_packed_matmul(kit, cpu_target):
    """Rows b * 32: a branch for b * 32 <= 16 would hold only b = 0 (a loop over 0 rows, divided by), so the
    rule keeps its one-row branch and the packed matmul, which build and match numpy at b = 1 and 2."""
    x, wt = kit.tensor("x", (kit.B, 32, K)), kit.tensor("wt", (F, K))
    fused = _fuse_nt(kit, kit.build([x, wt], lambda bb, x, wt: kit.R.matmul(x, kit.R.permute_dims(wt))), cpu_target)
    script = kit.apply_rule(Matmul(), kit.only_prim_func(fused, "NT_matmul"), cpu_target).mod["main"].script()
    assert "if b * T.int64(32) == T.int64(1):" in script
    run = kit.Runner(apply_cpu_rules(fused, cpu_target), cpu_target)
    rng = np.random.default_rng(2)
    wv = kit.rand(rng, F, K)
    for b in (1, 2):
        xv = kit.rand(rng, b, 32, K)
        kit.assert_close(run(xv, wv), xv.astype("float64") @ wv.T)


def test_does_not_fire_on_row_major_weight_or_many_rows(kit, cpu_target):
    x, w = kit.tensor("x", (1, 1, K)), kit.tensor("w", (K, F))
    dense = kit.only_prim_func(kit.fuse(kit.build([x, w], lambda bb, x, w: kit.R.matmul(x, w)), cpu_target))
    assert kit.apply_rule(Gemv(), dense, cpu_target) is None  # W(K, N): the matmul rule's case
    many = kit.only_prim_func(_fuse_nt(kit, _linear_gelu(kit, (1, 16)), cpu_target), "NT_matmul")
    assert kit.apply_rule(Gemv(), many, cpu_target) is None
    assert kit.apply_rule(Gemv(), dense, tvm.target.Target({"kind": "cuda", "arch": "sm_90"})) is None
