"""FuseNormIntoGemv + the NormGemv rule: a LayerNorm and the projection reading it (with its bias and
activation) become one kernel at decode-sized buckets (structure: Before/Expected, where it must not
fire; the rule's schedule; numerics at n = 1 with b = 1 and 4, in the 3..4 bucket, and at the bound)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from relaxtune.relax_passes.fuse_norm_gemv import MAX_ROWS, FuseNormIntoGemv
from relaxtune.schedules.rules import NormGemv, apply_cpu_rules

TARGET = {"kind": "llvm", "num-cores": 2}
K, N = 64, 96


def _params(n, norm_size=K):
    b = tirx.Var("b", "int64")
    x = relax.Var("x", relax.TensorType((b, n, K), "float32"))
    gamma, beta = (relax.Var(name, relax.TensorType((norm_size,), "float32")) for name in ("gamma", "beta"))
    w = relax.Var("w", relax.TensorType((K, N), "float32"))
    bias = relax.Var("bias", relax.TensorType((N,), "float32"))
    return [x, gamma, beta, w, bias]


def before(n=1, bound=None, axis=-1, other_use=False) -> tvm.IRModule:
    """main: gelu_tanh(layer_norm(x) @ w + bias) [+ the normalized x returned too]; n constant or bounded."""
    params = _params(n, K if axis == -1 else n)
    x, gamma, beta, w, bias = params
    bb = relax.BlockBuilder()
    with bb.function("main", params, {"tir_var_upper_bound": {"b": 4, **({"n": bound} if bound else {})}}):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.layer_norm(x, gamma, beta, axes=[axis]))
            z = bb.emit(relax.op.add(bb.emit(relax.op.matmul(y, w)), bias))
            out = bb.emit_output(
                relax.Tuple([bb.emit(relax.op.nn.gelu_tanh(z)), y]) if other_use else relax.op.nn.gelu_tanh(z)
            )
        bb.emit_func_output(out)
    return bb.get()


def expected() -> tvm.IRModule:
    params = _params(1)
    inner = [relax.Var(f"p{i}", p.ty) for i, p in enumerate(params)]
    bb = relax.BlockBuilder()
    with bb.function("fused_norm_gemv", inner, {"Primitive": True}, private=True):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.layer_norm(inner[0], inner[1], inner[2], axes=[-1]))
            z = bb.emit(relax.op.add(bb.emit(relax.op.matmul(y, inner[3])), inner[4]))
            out = bb.emit_output(relax.op.nn.gelu_tanh(z))
        bb.emit_func_output(out)
    gv = bb.get().get_global_var("fused_norm_gemv")
    with bb.function("main", params, {"tir_var_upper_bound": {"b": 4}}):
        with bb.dataflow():
            out = bb.emit_output(relax.Call(gv, params))
        bb.emit_func_output(out)
    return bb.get()


def test_norm_projection_and_epilogue_become_one_function():
    after = FuseNormIntoGemv()(before())
    tvm.ir.assert_structural_equal(after, expected(), map_free_vars=True)


@pytest.mark.parametrize("case", ["rows_above_max", "unbounded_rows", "other_axis", "normalized_rows_read_twice"])
def test_does_not_fire(case):
    n = tirx.Var("n", "int64")
    mod = {
        "rows_above_max": lambda: before(n, bound=MAX_ROWS // 4 + 1),
        "unbounded_rows": lambda: before(n),
        "other_axis": lambda: before(tirx.IntImm("int64", 4), axis=1),  # over the n axis (4 x 4 rows: few enough)
        "normalized_rows_read_twice": lambda: before(other_use=True),
    }[case]()
    tvm.ir.assert_structural_equal(FuseNormIntoGemv()(mod), mod)


def _legalized(mod):
    seq = [
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]
    with tvm.target.Target(TARGET):
        return tvm.transform.Sequential(seq)(FuseNormIntoGemv()(mod))


def test_one_kernel_scheduled_by_the_rule():
    mod = _legalized(before())
    (kernel,) = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    sch = NormGemv().apply(kernel, tvm.target.Target(TARGET), False)
    assert sch is not None
    script = sch.mod["main"].script()
    # the rows' pass (vector partial sums) before the branch on rows == 1, each branch one parallel GEMV
    assert script.count("T.parallel") == 2 and script.index("_rf") < script.index("if b == T.int64(1)") < script.index(
        "T.parallel"
    )


@pytest.mark.parametrize("n,bound", [(1, None), (3, 4)])
def test_matches_numpy(n, bound):
    mod = before(tirx.IntImm("int64", 1) if bound is None else tirx.Var("n", "int64"), bound=bound)
    mod = apply_cpu_rules(_legalized(mod), TARGET)
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(TARGET)), tvm.cpu())
    rng = np.random.default_rng(n)
    gamma, beta, bias = (rng.standard_normal(s).astype("float32") for s in (K, K, N))
    w = rng.standard_normal((K, N)).astype("float32") * 0.3
    for b in (1, 2, 4):
        x = (rng.standard_normal((b, n, K)) * 3 + 5).astype("float32")  # a mean far from 0: the centring matters
        out = vm["main"](*[tvm.runtime.tensor(a) for a in (x, gamma, beta, w, bias)]).numpy()
        x64 = x.astype(np.float64)
        y = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5) * gamma + beta
        z = y @ w + bias
        ref = 0.5 * z * (1 + np.tanh(0.7978845608028654 * (z + 0.044715 * z**3)))
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(), err_msg=f"b={b} n={n}")
