"""FoldBatchNorm: structure, where it must not fire, numerics against the unfolded module."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relaxtune.relax_passes.fold_batch_norm import FoldBatchNorm


@I.ir_module
class Before:
    @R.function
    def main(
        x: R.Tensor(("b", 4, 8, 8), "float32"),
        w: R.Tensor((6, 4, 3, 3), "float32"),
        gamma: R.Tensor((6,), "float32"),
        beta: R.Tensor((6,), "float32"),
        mean: R.Tensor((6,), "float32"),
        var: R.Tensor((6,), "float32"),
    ) -> R.Tensor(("b", 6, 8, 8), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            y = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])
            bn = R.nn.batch_norm(y, gamma, beta, mean, var, axis=1, epsilon=1e-5, training=False)
            out = bn[0]
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def main(
        x: R.Tensor(("b", 4, 8, 8), "float32"),
        w: R.Tensor((6, 4, 3, 3), "float32"),
        gamma: R.Tensor((6,), "float32"),
        beta: R.Tensor((6,), "float32"),
        mean: R.Tensor((6,), "float32"),
        var: R.Tensor((6,), "float32"),
    ) -> R.Tensor(("b", 6, 8, 8), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            std = R.add(var, R.const(1e-5, "float32"))
            inv = R.rsqrt(std)
            scale = R.multiply(gamma, inv)
            per_out = R.reshape(scale, R.shape([6, 1, 1, 1]))
            w_folded = R.multiply(w, per_out)  # weights only: LiftTransformParams moves it to load time
            y = R.nn.conv2d(x, w_folded, padding=[1, 1, 1, 1])
            shifted = R.multiply(mean, scale)
            negated = R.negative(shifted)
            bias = R.add(beta, negated)
            per_channel = R.reshape(bias, R.shape([1, 6, 1, 1]))
            out = R.add(y, per_channel)
            R.output(out)
        return out


def test_batch_norm_after_conv_becomes_weight_scale_and_bias():
    tvm.ir.assert_structural_equal(FoldBatchNorm()(Before), Expected)


@I.ir_module
class Training:
    @R.function
    def main(
        x: R.Tensor((1, 4, 8, 8), "float32"),
        w: R.Tensor((6, 4, 3, 3), "float32"),
        gamma: R.Tensor((6,), "float32"),
        beta: R.Tensor((6,), "float32"),
        mean: R.Tensor((6,), "float32"),
        var: R.Tensor((6,), "float32"),
    ) -> R.Tensor((1, 6, 8, 8), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            y = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])
            bn = R.nn.batch_norm(y, gamma, beta, mean, var, axis=1, training=True)  # batch statistics: not foldable
            out = bn[0]
            R.output(out)
        return out


@I.ir_module
class StatsFromActivations:
    @R.function
    def main(
        x: R.Tensor((1, 4, 8, 8), "float32"),
        mean: R.Tensor((6,), "float32"),
        w: R.Tensor((6, 4, 3, 3), "float32"),
        gamma: R.Tensor((6,), "float32"),
        beta: R.Tensor((6,), "float32"),
        var: R.Tensor((6,), "float32"),
    ) -> R.Tensor((1, 6, 8, 8), "float32"):
        R.func_attr({"num_input": 2})  # mean is an input, not a weight
        with R.dataflow():
            y = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])
            bn = R.nn.batch_norm(y, gamma, beta, mean, var, axis=1, training=False)
            out = bn[0]
            R.output(out)
        return out


def test_leaves_training_mode_and_input_statistics():
    tvm.ir.assert_structural_equal(FoldBatchNorm()(Training), Training)
    tvm.ir.assert_structural_equal(FoldBatchNorm()(StatsFromActivations), StatsFromActivations)


def test_numerics_match_the_unfolded_module():
    rng = np.random.default_rng(0)
    args = [
        rng.standard_normal((2, 4, 8, 8)),
        rng.standard_normal((6, 4, 3, 3)),
        1 + 0.1 * rng.standard_normal(6),
        0.1 * rng.standard_normal(6),
        0.1 * rng.standard_normal(6),
        rng.uniform(0.5, 1.5, 6),
    ]
    args = [tvm.runtime.tensor(a.astype("float32")) for a in args]
    target = tvm.target.Target("llvm")
    outs = [
        relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())["main"](*args).numpy()
        for mod in (Before, FoldBatchNorm()(Before))
    ]
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
