"""UnmergeLeadingDims: torch's (b * n, d) flattening around matmul + bias is removed, and only that."""

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from relaxtune.relax_passes.unmerge_leading_dims import UnmergeLeadingDims


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor(("b", "n", 64), "float32"), w: R.Tensor((64, 8), "float32"), bias: R.Tensor((8,), "float32")):
        b, n = T.int64(), T.int64()
        with R.dataflow():
            flat = R.reshape(x, R.shape([b * n, 64]))
            y = R.add(bias, R.matmul(flat, w))
            out = R.reshape(y, R.shape([b, n, 8]))
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor(("b", "n", 64), "float32"), w: R.Tensor((64, 8), "float32"), bias: R.Tensor((8,), "float32")):
        b, n = T.int64(), T.int64()
        with R.dataflow():
            lv = R.matmul(x, w)
            out = R.add(lv, bias)
            R.output(out)
        return out


@I.ir_module
class SplitsTheLastDim:
    """(b, n, 64) → (b * n * 2, 32): the last dim is split too, so the matmul is not a broadcast one."""

    @R.function
    def main(x: R.Tensor(("b", "n", 64), "float32"), w: R.Tensor((32, 8), "float32"), bias: R.Tensor((8,), "float32")):
        b, n = T.int64(), T.int64()
        with R.dataflow():
            flat = R.reshape(x, R.shape([b * n * 2, 32]))
            y = R.add(bias, R.matmul(flat, w))
            out = R.reshape(y, R.shape([b, n, 16]))
            R.output(out)
        return out


def test_structure():
    tvm.ir.assert_structural_equal(UnmergeLeadingDims()(Before), Expected)


def test_does_not_fire_when_the_last_dim_is_split():
    tvm.ir.assert_structural_equal(UnmergeLeadingDims()(SplitsTheLastDim), SplitsTheLastDim)


def test_numerics():
    ex = tvm.compile(UnmergeLeadingDims()(Before), target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(0)
    w, bias = rng.standard_normal((64, 8)).astype("float32"), np.arange(8, dtype="float32")
    for b, n in [(1, 1), (2, 17), (3, 128)]:
        x = rng.standard_normal((b, n, 64)).astype("float32")
        out = vm["main"](*(tvm.runtime.tensor(v) for v in (x, w, bias))).numpy()
        np.testing.assert_allclose(out, x @ w + bias, rtol=1e-5, atol=1e-5)
