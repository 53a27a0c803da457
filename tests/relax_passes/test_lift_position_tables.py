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
            t = bb.emit_te(
                lambda: te.compute((n, 4), lambda i, j: row(i, j, n), name="table"), primfunc_name_hint="table"
            )
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


@pytest.mark.parametrize(
    "mod",
    [
        table_module(row=lambda i, j, n: (i * 2 + j).astype("float32") / n.astype("float32")),  # rows depend on n
        table_module(bound=None),  # no upper bound to compute up to
    ],
    ids=["rows-depend-on-n", "no-bound"],
)
def test_does_not_fire(mod):
    tvm.ir.assert_structural_equal(LiftPositionTables()(mod), mod)


def test_matches_numpy():
    target = tvm.target.Target(TARGET)
    with target:
        mod = tvm.transform.Sequential(
            [LiftPositionTables(), relax.transform.LegalizeOps(), relax.transform.FoldConstant()]
        )(table_module())
    assert "call_tir(cls.table" not in mod["main"].script()  # folded: computed at compile time
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    for n in (1, 23, 64):
        x = np.random.default_rng(n).standard_normal((n, 4)).astype("float32")
        expected = x + (np.arange(n)[:, None] * 2 + np.arange(4)[None, :])
        np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), expected, rtol=1e-6)


# --- tables written as Relax operators (Hugging Face RoPE through torch.export) ----------------------

D = 8
INV_FREQ = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype("float32").reshape(1, 1, D // 2)


def _hf_tables(bb, rows, inv_freq, positions=None, between=lambda cos: cos):
    """HF's rotary tables, as torch.export writes them: f = float(positions[None, :, None]) * inv_freq,
    emb = cat(f, f), cos(emb) * 1.0 and sin(emb) * 1.0 expanded to (1, 1, rows, d); positions
    arange(0, rows) (+ 0) unless given. `between(cos)` runs after the cos table is emitted."""
    if positions is None:
        positions = bb.emit(relax.op.add(bb.emit(relax.op.arange(0, rows, 1, "int64")), relax.const(0, "int64")))
    at = bb.emit(relax.op.expand_dims(bb.emit(relax.op.expand_dims(positions, 0)), 2))
    f = bb.emit(relax.op.multiply(bb.emit(relax.op.astype(at, "float32")), inv_freq))
    emb = bb.emit(relax.op.concat([f, f], axis=-1))
    one = relax.const(1.0, "float32")
    cos = between(bb.emit(relax.op.expand_dims(bb.emit(relax.op.multiply(bb.emit(relax.op.cos(emb)), one)), 1)))
    sin = bb.emit(relax.op.expand_dims(bb.emit(relax.op.multiply(bb.emit(relax.op.sin(emb)), one)), 1))
    return cos, sin


def hf_module(positions: str = "arange", inv_freq: str = "constant", bound: int | None = 64) -> tvm.IRModule:
    """main(x (b, 2, n, d)) = x * cos + x * sin with HF's tables; positions "input": position_ids (1, n)
    is an input; inv_freq "weight": a parameter (as the ONNX import keeps it)."""
    b, n = tirx.Var("b", "int64"), tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((b, 2, n, D), "float32"))
    params = [x]
    ids = relax.Var("position_ids", relax.TensorType((1, n), "int64"))
    freq = relax.Var("inv_freq", relax.TensorType((1, 1, D // 2), "float32"))
    params += [ids] if positions == "input" else []
    params += [freq] if inv_freq == "weight" else []
    bb = relax.BlockBuilder()
    with bb.function("main", params, {"tir_var_upper_bound": {"n": bound}} if bound else None):
        with bb.dataflow():
            pos = None if positions == "arange" else bb.emit(relax.op.squeeze(ids, [0]))
            cos, sin = _hf_tables(bb, n, freq if inv_freq == "weight" else relax.const(INV_FREQ), pos)
            o = bb.emit_output(relax.op.add(bb.emit(relax.op.multiply(x, cos)), bb.emit(relax.op.multiply(x, sin))))
        bb.emit_func_output(o)
    return bb.get()


def test_hf_tables_are_computed_up_to_the_bound_and_sliced():
    before = hf_module()
    x = before["main"].params[0]
    n = x.ty.shape.values[2]
    bb = relax.BlockBuilder()
    with bb.function("main", [x], {"tir_var_upper_bound": {"n": 64}}):
        with bb.dataflow():

            def sliced(table):
                return bb.emit(relax.op.strided_slice(table, [2], [0], [n], assume_inbound=True))

            cos, sin = _hf_tables(bb, 64, relax.const(INV_FREQ), between=sliced)
            sin = sliced(sin)
            o = bb.emit_output(relax.op.add(bb.emit(relax.op.multiply(x, cos)), bb.emit(relax.op.multiply(x, sin))))
        bb.emit_func_output(o)
    tvm.ir.assert_structural_equal(LiftPositionTables()(before), bb.get())


def two_axes_module() -> tvm.IRModule:
    """main(x (n, n)) = x + cos(float(i - j)): a table of positions along two axes."""
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, n), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x], {"tir_var_upper_bound": {"n": 64}}):
        with bb.dataflow():
            pos = bb.emit(relax.op.arange(0, n, 1, "int64"))
            rows, cols = bb.emit(relax.op.expand_dims(pos, 1)), bb.emit(relax.op.expand_dims(pos, 0))
            table = bb.emit(relax.op.cos(bb.emit(relax.op.astype(bb.emit(relax.op.subtract(rows, cols)), "float32"))))
            o = bb.emit_output(relax.op.add(x, table))
        bb.emit_func_output(o)
    return bb.get()


@pytest.mark.parametrize(
    "mod",
    [
        hf_module(positions="input"),  # position_ids is an input: not constant
        hf_module(inv_freq="weight"),  # inv_freq a weight (the ONNX import): not constant
        hf_module(bound=None),  # no upper bound to compute up to
        two_axes_module(),  # n on two axes: row i depends on n
    ],
    ids=["position-ids-input", "inv-freq-weight", "no-bound", "two-axes"],
)
def test_hf_tables_not_lifted(mod):
    tvm.ir.assert_structural_equal(LiftPositionTables()(mod), mod)


def test_hf_tables_match_numpy():
    target = tvm.target.Target(TARGET)
    with target:
        mod = tvm.transform.Sequential(
            [LiftPositionTables(), relax.transform.LegalizeOps(), relax.transform.FoldConstant()]
        )(hf_module())
    assert "arange" not in mod["main"].script()  # folded: computed at compile time
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    for n in (1, 23, 64):
        x = np.random.default_rng(n).standard_normal((2, 2, n, D)).astype("float32")
        emb = np.concatenate([np.arange(n)[:, None] * INV_FREQ[0]] * 2, axis=-1).astype("float32")
        expected = x * np.cos(emb) + x * np.sin(emb)
        np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), expected, rtol=1e-5, atol=1e-6)
