"""Property: for random small Relax modules over relaxtune's supported operators, with a symbolic row
count `n` in [0, upper], relaxtune's build (buckets, fusion, rules, memory plan) computes what stock
TVM's build of the same module computes, at n = 0, 1, the upper bound and values between.

A fixed budget (derandomized, so CI runs the same examples); `RELAXTUNE_PROPERTY_EXAMPLES=N` runs more.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tvm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tvm import relax, tirx

from relaxtune import api, targets
from relaxtune.config import CompileConfig, JobConfig
from relaxtune.measure.vm import VMRunner
from relaxtune.workloads.user import workload_from_mod

EXAMPLES = int(os.environ.get("RELAXTUNE_PROPERTY_EXAMPLES", "8"))
UNARY = ("relu", "gelu", "silu", "exp_scaled", "softmax", "rms_norm", "layer_norm", "neg_abs")
BINARY = ("add", "multiply", "subtract")
SHAPED = ("matmul", "sum", "concat_rows", "transpose2", "empty_slice", "self_attention", "column_mean", "row_max")


@st.composite
def modules(draw):
    """(the IRModule, its upper bound of n, a description): a chain of ops on (n, C) tensors."""
    upper = draw(st.sampled_from([1, 5, 16, 33, 64]))
    width = draw(st.sampled_from([1, 3, 8, 16, 24]))
    steps = draw(
        st.lists(
            st.sampled_from(UNARY + BINARY + SHAPED),
            min_size=1,
            max_size=5,
        )
    )
    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, width), "float32"))
    y_in = relax.Var("y", relax.TensorType((n, width), "float32"))
    params, weights = [x, y_in], []
    with bb.function("main"):
        with bb.dataflow():
            cur, cols, rows = x, width, n
            for i, step in enumerate(steps):
                if step in ("relu", "gelu", "silu"):
                    cur = bb.emit(getattr(relax.op.nn, step)(cur))
                elif step == "exp_scaled":
                    cur = bb.emit(relax.op.exp(relax.op.multiply(cur, relax.const(0.1, "float32"))))
                elif step == "softmax":
                    cur = bb.emit(relax.op.nn.softmax(cur, axis=-1))
                elif step == "neg_abs":
                    cur = bb.emit(relax.op.negative(relax.op.abs(cur)))
                elif step in ("rms_norm", "layer_norm"):
                    gamma = relax.Var(f"g{i}", relax.TensorType((cols,), "float32"))
                    weights.append(gamma)
                    if step == "rms_norm":
                        cur = bb.emit(relax.op.nn.rms_norm(cur, gamma, axes=[-1]))
                    else:
                        beta = relax.Var(f"b{i}", relax.TensorType((cols,), "float32"))
                        weights.append(beta)
                        cur = bb.emit(relax.op.nn.layer_norm(cur, gamma, beta, axes=[-1]))
                elif step in BINARY:
                    other = y_in if rows is n and cols == width else cur
                    cur = bb.emit(getattr(relax.op, step)(cur, other))
                elif step == "matmul":
                    out = draw(st.sampled_from([1, 4, 16, 40]))
                    w = relax.Var(f"w{i}", relax.TensorType((cols, out), "float32"))
                    weights.append(w)
                    cur, cols = bb.emit(relax.op.matmul(cur, w)), out
                elif step == "sum":
                    cur = bb.emit(relax.op.sum(cur, axis=[-1], keepdims=True))
                    cols = 1
                elif step == "concat_rows":
                    cur = bb.emit(relax.op.concat([cur, cur], axis=0))
                    rows = None  # 2n rows: binary ops with y no longer line up
                elif step == "empty_slice":  # a zero-width slice concatenated (a full-width partial RoPE)
                    empty = relax.op.strided_slice(cur, axes=[1], begin=[cols], end=[cols])
                    cur = bb.emit(relax.op.concat([cur, empty], axis=1))
                elif step == "self_attention":  # (rows, rows) scores over a symbolic axis, softmax, back to cols
                    scores = relax.op.matmul(cur, relax.op.permute_dims(cur))
                    cur = bb.emit(relax.op.matmul(relax.op.nn.softmax(scores, axis=-1), cur))
                elif step == "column_mean":  # a reduction over the symbolic axis, broadcast back
                    cur = bb.emit(relax.op.subtract(cur, relax.op.mean(cur, axis=[0], keepdims=True)))
                elif step == "row_max":
                    cur = bb.emit(relax.op.max(cur, axis=[-1], keepdims=True))
                    cols = 1
                elif step == "transpose2":
                    cur = bb.emit(relax.op.permute_dims(relax.op.permute_dims(cur)))
            out = bb.emit_output(cur)
        bb.emit_func_output(out, params=params + weights)
    mod = bb.get()
    mod["main"] = mod["main"].with_attr("tir_var_upper_bound", {"n": upper})
    return mod, upper, f"upper={upper} width={width} steps={steps}"


@pytest.mark.integration
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=modules(), picks=st.lists(st.integers(0, 10**6), min_size=2, max_size=2))
def test_relaxtune_matches_stock_tvm(case, picks):
    mod, upper, description = case
    workload = workload_from_mod(mod, "random")
    target = targets.resolve("cpu")
    ours, _, _ = api.build(workload, target, JobConfig(compile=CompileConfig(use_cache=False)))
    stock = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target("llvm")), tvm.cpu())
    runner = VMRunner.for_workload(ours, tvm.cpu(), workload)
    for n in sorted({0, 1, upper, *(p % (upper + 1) for p in picks)}):
        inputs = workload.random_inputs({"n": n})
        want = stock["main"](*[tvm.runtime.tensor(inputs[t.name]) for t in workload.inputs]).numpy()
        got = runner.outputs(inputs)
        assert got.shape == want.shape, (description, n)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"{description} at n={n}")
