"""SplitToSlices: structure, where it must not fire, the split kernel gone after FuseOps, numerics."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from relaxtune.relax_passes.split_to_slices import SplitToSlices
from relaxtune.schedules.rules import apply_cpu_rules


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor(("n", 12), "float32")) -> R.Tuple(
        R.Tensor((2, "n", 2), "float32"), R.Tensor((2, "n", 2), "float32"), R.Tensor((2, "n", 2), "float32")
    ):
        n = T.int64()
        with R.dataflow():
            parts = R.split(x, 3, axis=-1)
            q = R.reshape(parts[0], R.shape([n, 2, 2]))
            k = R.reshape(parts[1], R.shape([n, 2, 2]))
            v = R.reshape(parts[2], R.shape([n, 2, 2]))
            out = (R.permute_dims(q, [1, 0, 2]), R.permute_dims(k, [1, 0, 2]), R.permute_dims(v, [1, 0, 2]))
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor(("n", 12), "float32")) -> R.Tuple(
        R.Tensor((2, "n", 2), "float32"), R.Tensor((2, "n", 2), "float32"), R.Tensor((2, "n", 2), "float32")
    ):
        n = T.int64()
        with R.dataflow():
            heads = R.reshape(x, R.shape([n, 6, 2]))  # a view
            q = R.strided_slice(heads, (1,), (0,), (2,), assume_inbound=True)  # fuse into the transposes
            k = R.strided_slice(heads, (1,), (2,), (4,), assume_inbound=True)
            v = R.strided_slice(heads, (1,), (4,), (6,), assume_inbound=True)
            out = (R.permute_dims(q, [1, 0, 2]), R.permute_dims(k, [1, 0, 2]), R.permute_dims(v, [1, 0, 2]))
            R.output(out)
        return out


def test_split_into_heads_becomes_view_and_slices():
    tvm.ir.assert_structural_equal(SplitToSlices()(Before), Expected)


@I.ir_module
class PartUsedTwice:
    @R.function
    def main(x: R.Tensor(("n", 12), "float32")) -> R.Tuple(
        R.Tensor(("n", 2, 2), "float32"), R.Tensor(("n", 2, 2), "float32"), R.Tensor(("n", 4), "float32")
    ):
        n = T.int64()
        with R.dataflow():
            parts = R.split(x, 3, axis=-1)
            q = R.reshape(parts[0], R.shape([n, 2, 2]))
            k = R.reshape(parts[1], R.shape([n, 2, 2]))
            v = parts[2]  # not reshaped to heads
            out = (q, k, v)
            R.output(out)
        return out


@I.ir_module
class SplitOnRows:
    @R.function
    def main(x: R.Tensor((6, 4), "float32")) -> R.Tuple(R.Tensor((1, 3, 4), "float32"), R.Tensor((1, 3, 4), "float32")):
        with R.dataflow():
            parts = R.split(x, 2, axis=0)  # not the last axis
            a = R.reshape(parts[0], R.shape([1, 3, 4]))
            b = R.reshape(parts[1], R.shape([1, 3, 4]))
            out = (a, b)
            R.output(out)
        return out


@I.ir_module
class ReadByAttention:
    @R.function
    def main(x: R.Tensor((1, "n", 12), "float32")) -> R.Tensor((1, "n", 2, 2), "float32"):
        n = T.int64()
        with R.dataflow():
            parts = R.split(x, 3, axis=-1)
            q = R.reshape(parts[0], R.shape([1, n, 2, 2]))
            k = R.reshape(parts[1], R.shape([1, n, 2, 2]))
            v = R.reshape(parts[2], R.shape([1, n, 2, 2]))
            out = R.nn.attention(q, k, v, causal_mask="TopLeft")  # slices would be kernels of their own
            R.output(out)
        return out


@pytest.mark.parametrize("mod", [PartUsedTwice, SplitOnRows, ReadByAttention], ids=lambda m: m.__name__)
def test_does_not_fire(mod):
    tvm.ir.assert_structural_equal(SplitToSlices()(mod), mod)


def _gpt2_qkv(hidden: int, heads: int, bound: int) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    b, n = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("n", "int64")
    d = hidden // heads
    x = relax.Var("x", relax.TensorType((b, n, hidden), "float32"))
    w = relax.Var("w", relax.TensorType((hidden, 3 * hidden), "float32"))
    with bb.function("main", [x, w], attrs={"num_input": 1, "tir_var_upper_bound": {"n": bound, "b": 2}}):
        with bb.dataflow():
            qkv = bb.emit(relax.op.matmul(x, w))
            parts = bb.emit(relax.op.split(qkv, 3, axis=-1))
            outs = []
            for i in range(3):
                part = bb.emit(relax.TupleGetItem(parts, i))
                heads4 = bb.emit(relax.op.reshape(part, (b, n, heads, d)))
                outs.append(bb.emit(relax.op.permute_dims(heads4, [0, 2, 1, 3])))
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


@pytest.fixture(scope="module")
def compiled(target):
    with target.target:
        mod = tvm.transform.Sequential(
            [
                SplitToSlices(),
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
                relax.transform.DeadCodeElimination(),
            ]
        )(_gpt2_qkv(32, 4, 80))
    kernels = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    return tvm.compile(apply_cpu_rules(mod, target.target), target=target.target), kernels


def test_no_split_kernel_remains(compiled):
    _, kernels = compiled
    assert not any("split" in k for k in kernels), kernels
    assert sum("strided_slice" in k and "transpose" in k for k in kernels) == 3, kernels


@pytest.mark.parametrize("b,n", [(1, 1), (2, 33), (2, 80)])  # n: 1, a middle value, the upper bound
def test_matches_numpy(compiled, b, n):
    ex, _ = compiled
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(n)
    x = rng.standard_normal((b, n, 32)).astype("float32")
    w = rng.standard_normal((32, 96)).astype("float32") * 0.2
    outs = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w))
    y = x @ w
    for i, out in enumerate(outs):
        ref = y[..., 32 * i : 32 * (i + 1)].reshape(b, n, 4, 8).transpose(0, 2, 1, 3)
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-4)
