"""LiftPositionTables: a table of positions computed once up to the bound and sliced per call
(structure, where it must not fire, numerics at several n)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, te, tirx

from relaxtune.relax_passes.lift_position_tables import LiftPositionTables

TARGET = {"kind": "llvm", "num-cores": 2}


def table_module(row=lambda i, j, n: (i * 2 + j).astype("float32"), bound: int | None = 64) -> tvm.IRModule:
    """main(x (n, 4)) = x + table, the table a no-input call_tir of a TE compute `row(i, j, n)`."""
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x], {"tir_var_upper_bound": {"n": bound}} if bound else None):
        with bb.dataflow():
            t = bb.emit_te(lambda: te.compute((n, 4), lambda i, j: row(i, j, n), name="table"), primfunc_name_hint="table")
            o = bb.emit_output(relax.op.add(x, t))
        bb.emit_func_output(o)
    return bb.get()


def test_table_is_computed_up_to_the_bound_and_sliced():
    before = table_module()
    x = before["main"].params[0]
    n = x.ty.shape.values[0]
    bb = relax.BlockBuilder()
    with bb.function("main", [x], {"tir_var_upper_bound": {"n": 64}}):
        with bb.dataflow():
            gv = bb.add_func(before["table"], "table")
            full = bb.emit(relax.call_tir(gv, [], relax.TensorType((64, 4), "float32")))
            t = bb.emit(relax.op.strided_slice(full, [0], [0], [n], assume_inbound=True))
            o = bb.emit_output(relax.op.add(x, t))
        bb.emit_func_output(o)
    tvm.ir.assert_structural_equal(LiftPositionTables()(before), bb.get())


@pytest.mark.parametrize("mod", [
    table_module(row=lambda i, j, n: (i * 2 + j).astype("float32") / n.astype("float32")),  # rows depend on n
    table_module(bound=None),  # no upper bound to compute up to
], ids=["rows-depend-on-n", "no-bound"])
def test_does_not_fire(mod):
    tvm.ir.assert_structural_equal(LiftPositionTables()(mod), mod)


def test_matches_numpy():
    target = tvm.target.Target(TARGET)
    with target:
        mod = tvm.transform.Sequential([LiftPositionTables(), relax.transform.LegalizeOps(), relax.transform.FoldConstant()])(table_module())
    assert "call_tir(cls.table" not in mod["main"].script()  # folded: computed at compile time
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    for n in (1, 23, 64):
        x = np.random.default_rng(n).standard_normal((n, 4)).astype("float32")
        expected = x + (np.arange(n)[:, None] * 2 + np.arange(4)[None, :])
        np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), expected, rtol=1e-6)
