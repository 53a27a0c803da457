"""BlockConvWeights: the weight in blocks of output channels, legalized into its own TE kernel
(one reduction block, the epilogue fused); what it leaves; numerics against TOPI's NHWC conv."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from relaxtune.relax_passes.block_conv_weights import LEGALIZE, BlockConvWeights, block_size

AVX512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})  # 16 lanes: blocks of 2 vectors, 32 channels
AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "znver1"})  # 8 lanes: blocks of 2 vectors, 16 channels


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor(("b", 8, 8, 16), "float32"), w: R.Tensor((3, 3, 16, 64), "float32")) -> R.Tensor(
        ("b", 8, 8, 64), "float32"
    ):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            out = R.nn.relu(
                R.nn.conv2d(x, w, padding=[1, 1, 1, 1], data_layout="NHWC", kernel_layout="HWIO", out_layout="NHWC")
            )
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor(("b", 8, 8, 16), "float32"), w: R.Tensor((3, 3, 16, 64), "float32")) -> R.Tensor(
        ("b", 8, 8, 64), "float32"
    ):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            blocked = R.layout_transform(
                w, index_map=T.index_map(lambda kh, kw, ic, oc: (oc // 32, kh, kw, ic, oc % 32))
            )
            y = R.nn.conv2d(
                x, blocked, padding=[1, 1, 1, 1], data_layout="NHWC", kernel_layout="OHWI32o", out_layout="NHWC"
            )
            out = R.nn.relu(y)
            R.output(out)
        return out


def test_weight_in_blocks_of_the_rule_tile():
    with AVX512:
        tvm.ir.assert_structural_equal(BlockConvWeights()(Before), Expected)


@I.ir_module
class Left:
    @R.function
    def main(
        x: R.Tensor((1, 8, 8, 16), "float32"),
        dw: R.Tensor((3, 3, 1, 16), "float32"),
        w: R.Tensor((16, 16, 3, 3), "float32"),
        odd: R.Tensor((1, 1, 16, 3), "float32"),
    ) -> R.Tuple(
        R.Tensor((1, 8, 8, 16), "float32"), R.Tensor((1, 16, 6, 6), "float32"), R.Tensor((1, 8, 8, 3), "float32")
    ):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            depthwise = R.nn.conv2d(
                x, dw, padding=[1, 1, 1, 1], groups=16, data_layout="NHWC", kernel_layout="HWIO", out_layout="NHWC"
            )
            nchw = R.nn.conv2d(R.permute_dims(x, [0, 3, 1, 2]), w)
            three = R.nn.conv2d(
                x, odd, data_layout="NHWC", kernel_layout="HWIO", out_layout="NHWC"
            )  # 3 output channels: no block
            out = (depthwise, nchw, three)
            R.output(out)
        return out


def test_leaves_grouped_nchw_and_unblockable_convolutions():
    with AVX512:
        tvm.ir.assert_structural_equal(BlockConvWeights()(Left), Left)
    tvm.ir.assert_structural_equal(
        BlockConvWeights()(Before), Before
    )  # no target in scope: nothing to size the blocks by


def test_legalized_kernel_fuses_its_epilogue_and_matches_topi():
    with AVX512:
        blocked = BlockConvWeights()(Before)
        fused = tvm.transform.Sequential(
            [
                relax.transform.LegalizeOps(LEGALIZE),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
            ]
        )(blocked)
    kernels = [gv.name_hint for gv, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert any(k.startswith("fused_conv2d") and k.endswith("relu") for k in kernels), kernels
    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(s).astype("float32") for s in ((2, 8, 8, 16), (3, 3, 16, 64)))
    target = tvm.target.Target("llvm")
    outs = [
        relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())["main"](
            tvm.runtime.tensor(x), tvm.runtime.tensor(w)
        ).numpy()
        for mod in (Before, fused)
    ]
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@I.ir_module
class Padded:
    @R.function
    def main(x: R.Tensor(("b", 8, 8, 16), "float32"), w: R.Tensor((1, 1, 16, 40), "float32")) -> R.Tensor(
        ("b", 8, 8, 40), "float32"
    ):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            out = R.nn.relu(R.nn.conv2d(x, w, data_layout="NHWC", kernel_layout="HWIO", out_layout="NHWC"))
            R.output(out)
        return out


@I.ir_module
class PaddedExpected:
    @R.function
    def main(x: R.Tensor(("b", 8, 8, 16), "float32"), w: R.Tensor((1, 1, 16, 40), "float32")) -> R.Tensor(
        ("b", 8, 8, 40), "float32"
    ):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            blocked = R.layout_transform(
                w, index_map=T.index_map(lambda kh, kw, ic, oc: (oc // 16, kh, kw, ic, oc % 16)), pad_value=0.0
            )
            y = R.nn.conv2d(x, blocked, data_layout="NHWC", kernel_layout="OHWI16o", out_layout="NHWC")
            sliced = R.strided_slice(y, axes=[3], begin=[0], end=[40])
            out = R.nn.relu(sliced)
            R.output(out)
        return out


def test_output_channels_padded_to_whole_vectors_then_sliced():
    """40 output channels: 48 with zero weights (three 16-lane blocks), the convolution sliced back to 40."""
    with AVX512:
        tvm.ir.assert_structural_equal(BlockConvWeights()(Padded), PaddedExpected)


@pytest.mark.parametrize(
    ("channels", "expected"),
    [(3, (3, 1)), (8, (8, 8)), (24, (32, 32)), (40, (48, 16)), (72, (80, 16)), (112, (128, 32)), (200, (224, 32))],
)
def test_block_size_pads_to_vectors(channels, expected):
    """(padded channels, block) with 16 lanes: two vectors where that pads at most 15 % more, else one;
    no padding where half a vector or more would be padding."""
    assert block_size(channels, AVX512) == expected


@pytest.mark.parametrize(
    ("channels", "expected"),
    [(3, (3, 1)), (12, (16, 16)), (24, (24, 8)), (40, (40, 8)), (64, (64, 16)), (120, (128, 16)), (200, (208, 16))],
)
def test_block_size_pads_to_vectors_avx2(channels, expected):
    """The same with AVX2's 8 lanes: 24 and 40 channels are whole vectors (no padding), blocks of two vectors
    (16 channels) where the channels are a multiple of them."""
    assert block_size(channels, AVX2) == expected
