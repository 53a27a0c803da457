"""SliceAfterReshape (relax_passes/slice_after_reshape.py): the first n rows of a static table,
reshaped, become the first n rows of the reshaped table, and the slice then fuses into its consumer."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx

from relaxtune.relax_passes.slice_after_reshape import SliceAfterReshape

I64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731


def _module(through_tuple: bool = False, shape=None):
    """k (1, n, 2, 8) * reshape(table[:n], (1, n, 1, 8)) with a constant (16, 8) table."""
    table = np.arange(16 * 8, dtype="float32").reshape(16, 8)
    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    k = relax.Var("k", relax.TensorType((1, n, 2, 8), "float32"))
    with bb.function("main", [k], attrs={"tir_var_upper_bound": {"n": 16}}):
        with bb.dataflow():
            sliced = bb.emit(relax.op.strided_slice(relax.const(table), [0], [0], [n], assume_inbound=True))
            if through_tuple:
                pair = bb.emit(relax.Tuple([sliced, sliced]))
                sliced = bb.emit(relax.TupleGetItem(pair, 1))
            rows = bb.emit(relax.op.reshape(sliced, shape or (1, n, 1, 8)))
            out = bb.emit_output(relax.op.multiply(k, rows))
        bb.emit_func_output(out)
    return bb.get(), table


def _ops(mod) -> list[str]:
    found = []
    relax.analysis.post_order_visit(
        mod["main"].body,
        lambda e: isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and found.append(e.op.name),
    )
    return found


def test_the_reshape_moves_before_the_slice():
    for through_tuple in (False, True):
        mod, _table = _module(through_tuple)
        ops = _ops(SliceAfterReshape()(mod))
        # reshape of the whole (16, 8) table, then the slice on its axis 1
        assert (
            ops.index("relax.reshape") < ops.index("relax.strided_slice") and ops.count("relax.strided_slice") == 1
        ), ops
        script = SliceAfterReshape()(mod)["main"].script()
        assert (
            "R.reshape(metadata" in script
            and "R.strided_slice(lv, (1,), (0,), (n,)" in script
            and "R.shape([1, 16, 1, 8])" in script
        ), script


def test_the_slice_fuses_into_its_consumer_and_the_numbers_hold():
    mod, table = _module()
    target = tvm.target.Target("llvm")
    seq = tvm.transform.Sequential(
        [
            SliceAfterReshape(),
            relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
            relax.transform.DeadCodeElimination(),
        ]
    )
    fused = seq(mod)
    kernels = [gv.name_hint for gv, f in fused.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert len(kernels) == 1 and "strided_slice" in kernels[0] and "multiply" in kernels[0], kernels
    ex = tvm.compile(SliceAfterReshape()(mod), target=target)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    k = np.random.default_rng(0).standard_normal((1, 5, 2, 8)).astype("float32")
    out = vm["main"](tvm.runtime.tensor(k)).numpy()
    np.testing.assert_allclose(out, k * table[:5].reshape(1, 5, 1, 8), rtol=1e-6)


def test_does_not_apply_to_a_reshape_that_mixes_axes():
    n = tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            sliced = bb.emit(
                relax.op.strided_slice(relax.const(np.zeros((16, 8), "float32")), [0], [0], [n], assume_inbound=True)
            )
            flat = bb.emit(relax.op.reshape(sliced, (n * 8,)))  # rows and columns merged
            out = bb.emit_output(relax.op.sum(flat))
        bb.emit_func_output(out)
    mod = bb.get()
    tvm.ir.assert_structural_equal(SliceAfterReshape()(mod), mod)
