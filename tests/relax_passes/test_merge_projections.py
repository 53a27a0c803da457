"""MergeProjections: structure (head-reshaped and plain projections), where it must not fire, numerics."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from relaxtune.relax_passes.merge_projections import MergeProjections
from relaxtune.schedules.rules import apply_cpu_rules


@I.ir_module
class Before:
    @R.function
    def main(
        x: R.Tensor(("n", 16), "float32"),
        wq: R.Tensor((8, 16), "float32"),
        wk: R.Tensor((4, 16), "float32"),
        wv: R.Tensor((4, 16), "float32"),
    ) -> R.Tuple(R.Tensor(("n", 2, 4), "float32"), R.Tensor(("n", 1, 4), "float32"), R.Tensor(("n", 1, 4), "float32")):
        n = T.int64()
        R.func_attr({"num_input": 1})
        with R.dataflow():
            q = R.matmul(x, R.permute_dims(wq))
            k = R.matmul(x, R.permute_dims(wk))
            v = R.matmul(x, R.permute_dims(wv))
            q4 = R.reshape(q, R.shape([n, 2, 4]))
            k4 = R.reshape(k, R.shape([n, 1, 4]))
            v4 = R.reshape(v, R.shape([n, 1, 4]))
            out = (R.negative(q4), R.negative(k4), R.negative(v4))
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def main(
        x: R.Tensor(("n", 16), "float32"),
        wq: R.Tensor((8, 16), "float32"),
        wk: R.Tensor((4, 16), "float32"),
        wv: R.Tensor((4, 16), "float32"),
    ) -> R.Tuple(R.Tensor(("n", 2, 4), "float32"), R.Tensor(("n", 1, 4), "float32"), R.Tensor(("n", 1, 4), "float32")):
        n = T.int64()
        R.func_attr({"num_input": 1})
        with R.dataflow():
            tq = R.permute_dims(wq)
            tk = R.permute_dims(wk)
            tv = R.permute_dims(wv)
            w = R.concat((tq, tk, tv), axis=1)  # weight-only: lifted to load time
            y = R.matmul(x, w)
            heads = R.reshape(y, R.shape([n, 4, 4]))  # one view; the slices fuse into their consumers
            q4 = R.strided_slice(heads, (1,), (0,), (2,), assume_inbound=True)
            k4 = R.strided_slice(heads, (1,), (2,), (3,), assume_inbound=True)
            v4 = R.strided_slice(heads, (1,), (3,), (4,), assume_inbound=True)
            out = (R.negative(q4), R.negative(k4), R.negative(v4))
            R.output(out)
        return out


def test_qkv_become_one_matmul_sliced_on_heads():
    tvm.ir.assert_structural_equal(MergeProjections()(Before), Expected)


@I.ir_module
class Plain:
    @R.function
    def main(
        x: R.Tensor(("n", 16), "float32"), w1: R.Tensor((16, 8), "float32"), w2: R.Tensor((16, 4), "float32")
    ) -> R.Tensor(("n", 8), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            a = R.matmul(x, w1)
            b = R.matmul(x, w2)
            y = R.add(a, R.tile(b, (1, 2)))
            R.output(y)
        return y


@I.ir_module
class PlainExpected:
    @R.function
    def main(
        x: R.Tensor(("n", 16), "float32"), w1: R.Tensor((16, 8), "float32"), w2: R.Tensor((16, 4), "float32")
    ) -> R.Tensor(("n", 8), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            w = R.concat((w1, w2), axis=1)
            y = R.matmul(x, w)
            a = R.strided_slice(y, (1,), (0,), (8,), assume_inbound=True)
            b = R.strided_slice(y, (1,), (8,), (12,), assume_inbound=True)
            out = R.add(a, R.tile(b, (1, 2)))
            R.output(out)
        return out


def test_projections_without_head_reshape_are_sliced_on_columns():
    tvm.ir.assert_structural_equal(MergeProjections()(Plain), PlainExpected)


@I.ir_module
class WeightIsAnInput:
    @R.function
    def main(
        x: R.Tensor(("n", 16), "float32"), w1: R.Tensor((16, 8), "float32"), w2: R.Tensor((16, 8), "float32")
    ) -> R.Tensor(("n", 8), "float32"):
        R.func_attr({"num_input": 2})  # w1 is an activation: concatenating it would run per call
        with R.dataflow():
            y = R.add(R.matmul(x, w1), R.matmul(x, w2))
            R.output(y)
        return y


@I.ir_module
class DifferentInputs:
    @R.function
    def main(
        x: R.Tensor(("n", 16), "float32"),
        z: R.Tensor(("n", 16), "float32"),
        w1: R.Tensor((16, 8), "float32"),
        w2: R.Tensor((16, 8), "float32"),
    ) -> R.Tensor(("n", 8), "float32"):
        R.func_attr({"num_input": 2})
        with R.dataflow():
            y = R.add(R.matmul(x, w1), R.matmul(z, w2))
            R.output(y)
        return y


@I.ir_module
class OneProjection:
    @R.function
    def main(x: R.Tensor(("n", 16), "float32"), w1: R.Tensor((16, 8), "float32")) -> R.Tensor(("n", 8), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            y = R.nn.gelu(R.matmul(x, w1))
            R.output(y)
        return y


@I.ir_module
class ReadByAttention:
    @R.function
    def main(
        x: R.Tensor((1, "n", 16), "float32"),
        wq: R.Tensor((16, 8), "float32"),
        wk: R.Tensor((16, 8), "float32"),
        wv: R.Tensor((16, 8), "float32"),
    ) -> R.Tensor((1, "n", 2, 4), "float32"):
        n = T.int64()
        R.func_attr({"num_input": 1})
        with R.dataflow():
            q = R.reshape(R.matmul(x, wq), R.shape([1, n, 2, 4]))
            k = R.reshape(R.matmul(x, wk), R.shape([1, n, 2, 4]))
            v = R.reshape(R.matmul(x, wv), R.shape([1, n, 2, 4]))
            out = R.nn.attention(q, k, v)  # a slice read by attention would be a kernel of its own
            R.output(out)
        return out


@pytest.mark.parametrize(
    "mod", [WeightIsAnInput, DifferentInputs, OneProjection, ReadByAttention], ids=lambda m: m.__name__
)
def test_does_not_fire(mod):
    tvm.ir.assert_structural_equal(MergeProjections()(mod), mod)


def _attention_inputs(hidden: int, heads: int, kv_heads: int, bound: int) -> tvm.IRModule:
    """q/k/v projections reshaped to heads, each post-processed so the slices fuse into consumers."""
    bb = relax.BlockBuilder()
    b, n = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("n", "int64")
    d = hidden // heads
    x = relax.Var("x", relax.TensorType((b, n, hidden), "float32"))
    ws = [
        relax.Var(f"w{i}", relax.TensorType((h * d, hidden), "float32"))
        for i, h in enumerate((heads, kv_heads, kv_heads))
    ]
    with bb.function("main", [x, *ws], attrs={"num_input": 1, "tir_var_upper_bound": {"n": bound, "b": 2}}):
        with bb.dataflow():
            outs = []
            for w, h in zip(ws, (heads, kv_heads, kv_heads)):
                y = bb.emit(relax.op.reshape(relax.op.matmul(x, relax.op.permute_dims(w)), (b, n, h, d)))
                outs.append(
                    bb.emit(relax.op.permute_dims(relax.op.multiply(y, relax.const(2.0, "float32")), [0, 2, 1, 3]))
                )
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


@pytest.fixture(scope="module")
def compiled(target):
    mod = relax.transform.LiftTransformParams()(MergeProjections()(_attention_inputs(64, 4, 2, 96)))
    with target.target:
        mod = tvm.transform.Sequential(
            [
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
                relax.transform.DeadCodeElimination(),
            ]
        )(mod)
    kernels = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    return tvm.compile(apply_cpu_rules(mod, target.target), target=target.target), kernels


def test_one_matmul_and_no_slice_kernel(compiled):
    _, kernels = compiled
    assert sum("matmul" in k for k in kernels) == 1, kernels
    sliced = [k for k in kernels if "strided_slice" in k]
    assert len(sliced) == 3 and all("multiply" in k and "transpose" in k for k in sliced), (
        kernels
    )  # fused into consumers


@pytest.mark.parametrize("b,n", [(1, 1), (2, 37), (2, 96)])  # n: 1, a middle value, the upper bound
def test_matches_numpy(compiled, b, n):
    ex, _ = compiled
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(n)
    ws = [rng.standard_normal((rows, 64)).astype("float32") * 0.2 for rows in (64, 32, 32)]
    x = rng.standard_normal((b, n, 64)).astype("float32")
    weights = vm["main_transform_params"]([tvm.runtime.tensor(w) for w in ws])
    outs = vm["main"](tvm.runtime.tensor(x), *weights)
    for out, w, h in zip(outs, ws, (4, 2, 2)):
        ref = (2.0 * (x @ w.T)).reshape(b, n, h, 16).transpose(0, 2, 1, 3)
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-4)
