"""decisions: the rules' hand-made choices as named decisions; the defaults are the rules."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from relaxtune.schedules.rules import apply_cpu_rules, decisions
from relaxtune.schedules.rules.cpu_gemv import Gemv
from relaxtune.schedules.rules.cpu_matmul import Matmul

K, F = 64, 96


def _dense_gelu(kit, rows):
    x, w, bias = kit.tensor("x", rows + (K,)), kit.tensor("w", (K, F)), kit.tensor("bias", (F,))
    return kit.build([x, w, bias], lambda bb, x, w, bias: kit.R.nn.gelu(kit.R.add(kit.R.matmul(x, w), bias)))


def _static_kernel(kit, target, rows=(1, 512)):
    return kit.only_prim_func(kit.fuse(_dense_gelu(kit, rows), target), "matmul")


def test_defaults_and_empty_given_are_the_rule(kit, cpu_target):
    func = kit.only_prim_func(kit.fuse(_dense_gelu(kit, (kit.B, kit.N)), cpu_target), "matmul")
    with cpu_target:
        plain = Matmul().apply(func, cpu_target, False).mod["main"]
        for decide in (decisions.Defaults(), decisions.Given({})):
            tvm.ir.assert_structural_equal(Matmul().apply(func, cpu_target, False, decide=decide).mod["main"], plain)


def test_probe_lists_the_choices_with_the_rules_values(kit, cpu_target):
    probe = decisions.Probe()
    sch = tvm.s_tir.Schedule(_static_kernel(kit, cpu_target))
    assert Matmul().sketch(sch, cpu_target, probe)
    by_name = {c.name: c for c in probe.choices}
    assert list(by_name) == ["rows", "units", "pack_b", "k_unroll"]
    assert all(by_name[n].structural for n in ("rows", "units", "pack_b")) and not by_name["k_unroll"].structural
    assert by_name["pack_b"].candidates == (0, 1) and by_name["pack_b"].default == 0  # B contiguous along J
    assert all(c.default in c.candidates for c in probe.choices)
    assert set(by_name["rows"].candidates) == {3, 4, 5, 6, 8}  # 1 or 2 rows only where there are fewer than 3
    small = decisions.Probe()
    assert Matmul().sketch(tvm.s_tir.Schedule(_static_kernel(kit, cpu_target, (1, 16))), cpu_target, small)
    assert {c.name: c for c in small.choices}["pack_b"].candidates == (0,)  # too few row tiles to pay for packing


def test_sampled_decisions_are_read_back_from_the_trace(kit, cpu_target):
    want = {"rows": 5, "units": 1, "pack_b": 1, "k_unroll": 4}
    sch = tvm.s_tir.Schedule(_static_kernel(kit, cpu_target))
    assert Matmul().sketch(sch, cpu_target, decisions.Sampled(dict(want)))
    assert decisions.read(sch.trace) == ("Matmul", want)
    kinds = [inst.kind.name for inst in sch.trace.insts]
    assert (
        kinds.count("SampleCategorical") == 1
    )  # k_unroll; rows, units (it sets the epilogue) and pack_b are structural
    assert decisions.read(tvm.s_tir.Schedule(_static_kernel(kit, cpu_target)).trace) is None


def test_a_value_that_is_not_a_candidate_becomes_the_nearest():
    assert decisions.nearest(7, (3, 4, 5, 6, 8)) == 6
    assert decisions.nearest(7, (6, 8)) == 6  # a tie takes the smaller
    assert decisions.Given({"rows": 9}).choose(None, "rows", [3, 4, 8], 4) == 8


@pytest.mark.parametrize("values", [{"rows": 5, "units": 1, "pack_b": 1, "k_unroll": 4}, {"rows": 8, "units": 2}])
def test_given_decisions_on_symbolic_rows_match_numpy(kit, cpu_target, values):
    """A record's decisions re-applied to the symbolic kernel (rows padded to the chosen tile inside it)."""
    fused = kit.fuse(_dense_gelu(kit, (kit.B, kit.N)), cpu_target)
    gv = next(gv for gv, f in fused.functions_items() if "matmul" in gv.name_hint)
    with cpu_target:
        sch = Matmul().apply(fused[gv], cpu_target, False, decide=decisions.Given(values))
    assert sch is not None
    assert kit.block_predicates(sch.mod["main"])["matmul_update"] == "T.bool(True)"
    fused[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    run = kit.Runner(apply_cpu_rules(fused, cpu_target), cpu_target)
    rng = np.random.default_rng(0)
    w, bias = kit.rand(rng, K, F, scale=0.2), kit.rand(rng, F)
    for b, n in [(1, 1), (2, 37), (1, 128), (3, 5)]:
        x = kit.rand(rng, b, n, K)
        kit.assert_close(run(x, w, bias), kit.np_gelu(x.astype("float64") @ w + bias))


def test_gemv_decisions_match_numpy(kit, cpu_target):
    x, wt = kit.tensor("x", (2, 1, K)), kit.tensor("wt", (F, K))
    mod = kit.build([x, wt], lambda bb, x, wt: kit.R.matmul(x, kit.R.permute_dims(wt)))
    with cpu_target:
        mod = relax.transform.FuseTransposeMatmul()(mod)
    fused = kit.fuse(mod, cpu_target)
    gv = next(gv for gv, f in fused.functions_items() if "NT_matmul" in gv.name_hint)
    probe = decisions.Probe()
    assert Gemv().sketch(tvm.s_tir.Schedule(fused[gv]), cpu_target, probe)
    assert [c.name for c in probe.choices] == ["k_lanes", "cols"]
    lanes = max(probe.choices[0].candidates)
    with cpu_target:
        sch = Gemv().apply(fused[gv], cpu_target, False, decide=decisions.Given({"k_lanes": lanes, "cols": 2}))
    fused[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    rng = np.random.default_rng(1)
    xv, wv = kit.rand(rng, 2, 1, K), kit.rand(rng, F, K)
    kit.assert_close(kit.run(apply_cpu_rules(fused, cpu_target), cpu_target, [xv, wv]), xv.astype("float64") @ wv.T)
