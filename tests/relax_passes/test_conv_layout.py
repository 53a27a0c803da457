"""ConvertConvLayout: NHWC convolutions with the layout carried through element-wise ops, pooling,
padding, concatenation and the final mean, transforms left only at the edges; numerics."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from relaxtune.relax_passes.conv_layout import ConvertConvLayout


@I.ir_module
class Before:
    @R.function
    def main(
        x: R.Tensor(("b", 4, 8, 8), "float32"),
        w1: R.Tensor((8, 4, 3, 3), "float32"),
        bias: R.Tensor((1, 8, 1, 1), "float32"),
        w2: R.Tensor((8, 8, 1, 1), "float32"),
        w3: R.Tensor((8, 8, 3, 3), "float32"),
    ) -> R.Tensor(("b", 16), "float32"):
        R.func_attr({"num_input": 1})
        b = T.int64()
        with R.dataflow():
            y = R.add(R.nn.conv2d(x, w1, padding=[1, 1, 1, 1]), bias)
            z = R.nn.relu(y)
            p = R.nn.max_pool2d(z, pool_size=[3, 3], strides=[2, 2], padding=[1, 1, 1, 1])
            c = R.add(R.nn.conv2d(p, w2), p)  # 1x1 conv + residual
            h = R.clip(c, R.prim_value(T.float32(0)), R.prim_value(T.float32(6)))  # no layout rule in TVM
            q = R.nn.pad(h, [0, 0, 0, 0, 1, 1, 1, 1])  # no layout rule in TVM
            d = R.nn.conv2d(q, w3)
            cat = R.concat([d, c], axis=1)
            m = R.mean(cat, axis=[2, 3], keepdims=True)
            out = R.reshape(m, R.shape([b, 16]))
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def main(
        x: R.Tensor(("b", 4, 8, 8), "float32"),
        w1: R.Tensor((8, 4, 3, 3), "float32"),
        bias: R.Tensor((1, 8, 1, 1), "float32"),
        w2: R.Tensor((8, 8, 1, 1), "float32"),
        w3: R.Tensor((8, 8, 3, 3), "float32"),
    ) -> R.Tensor(("b", 16), "float32"):
        R.func_attr({"num_input": 1})
        b = T.int64()
        with R.dataflow():
            xt = R.permute_dims(x, axes=[0, 2, 3, 1])  # the input edge: NCHW -> NHWC
            w1t = R.permute_dims(w1, axes=[2, 3, 1, 0])  # weights: HWIO, at load time once lifted
            conv1 = R.nn.conv2d(
                xt, w1t, padding=[1, 1, 1, 1], data_layout="NHWC", kernel_layout="HWIO", out_layout="NHWC"
            )
            bias_t = R.reshape(bias, R.shape([1, 1, 1, 8]))  # only size-1 axes move: a view
            y = R.add(conv1, bias_t)
            z = R.nn.relu(y)
            p = R.nn.max_pool2d(
                z, pool_size=[3, 3], strides=[2, 2], padding=[1, 1, 1, 1], layout="NHWC", out_layout="NHWC"
            )
            w2t = R.permute_dims(w2, axes=[2, 3, 1, 0])
            conv2 = R.nn.conv2d(p, w2t, data_layout="NHWC", kernel_layout="HWIO", out_layout="NHWC")
            c = R.add(conv2, p)
            h = R.clip(c, R.prim_value(T.float32(0)), R.prim_value(T.float32(6)))
            q = R.nn.pad(h, [0, 0, 1, 1, 1, 1, 0, 0])  # pad widths follow the axes
            w3t = R.permute_dims(w3, axes=[2, 3, 1, 0])
            d = R.nn.conv2d(q, w3t, data_layout="NHWC", kernel_layout="HWIO", out_layout="NHWC")
            cat = R.concat([d, c], axis=3)
            m = R.mean(cat, axis=[1, 2], keepdims=True)
            mt = R.reshape(m, R.shape([b, 16, 1, 1]))  # (b, 1, 1, C) -> (b, C, 1, 1): a view
            out = R.reshape(mt, R.shape([b, 16]))
            R.output(out)
        return out


def test_nhwc_everywhere_transforms_at_the_edges():
    tvm.ir.assert_structural_equal(ConvertConvLayout()(Before), Expected)


def transposes_between_convolutions(func: relax.Function) -> list[str]:
    """Layout transforms of activations with a convolution before and after them."""
    var2val = relax.analysis.get_var2val(func)
    readers: dict = {}
    for var, value in var2val.items():
        for used in relax.analysis.free_vars(value):
            readers.setdefault(used, []).append(var)

    def is_conv(value):
        return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.nn.conv2d"

    def conv_before(var):
        value = var2val.get(var)
        return value is not None and (is_conv(value) or any(conv_before(v) for v in relax.analysis.free_vars(value)))

    def conv_after(var):
        return any(is_conv(var2val[r]) or conv_after(r) for r in readers.get(var, []))

    found = []
    for var, value in var2val.items():
        transform = (
            isinstance(value, relax.Call)
            and isinstance(value.op, tvm.ir.Op)
            and value.op.name
            in (
                "relax.permute_dims",
                "relax.layout_transform",
            )
        )
        if transform and conv_before(value.args[0]) and conv_after(var):
            found.append(var.name)
    return found


@I.ir_module
class SqueezeExcite:
    """MobileNetV3's block: depthwise conv, hard-swish, squeeze-excitation (mean, two 1x1 convs,
    hard-sigmoid, a broadcast multiply), projection; relu6 as clip."""

    @R.function
    def main(
        x: R.Tensor(("b", 8, 6, 6), "float32"),
        dw: R.Tensor((8, 1, 3, 3), "float32"),
        f1: R.Tensor((4, 8, 1, 1), "float32"),
        f2: R.Tensor((8, 4, 1, 1), "float32"),
        proj: R.Tensor((8, 8, 1, 1), "float32"),
    ) -> R.Tensor(("b", 8, 6, 6), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            d = R.nn.conv2d(x, dw, padding=[1, 1, 1, 1], groups=8)
            hs = R.divide(
                R.multiply(
                    d, R.clip(R.add(d, R.const(3, "float32")), R.prim_value(T.float32(0)), R.prim_value(T.float32(6)))
                ),
                R.const(6, "float32"),
            )
            s = R.mean(hs, axis=[-1, -2], keepdims=True)
            s1 = R.nn.relu(R.nn.conv2d(s, f1))
            s2 = R.nn.conv2d(s1, f2)
            gate = R.divide(
                R.clip(R.add(s2, R.const(3, "float32")), R.prim_value(T.float32(0)), R.prim_value(T.float32(6))),
                R.const(6, "float32"),
            )
            scaled = R.multiply(hs, gate)
            out = R.add(R.nn.conv2d(scaled, proj), x)
            R.output(out)
        return out


def test_no_transpose_between_convolutions_of_the_same_layout():
    for mod in (Before, SqueezeExcite):
        main = ConvertConvLayout()(mod)["main"]
        convs = _calls(main, "relax.nn.conv2d")
        assert len(convs) >= 3 and all(str(c.attrs.data_layout) == "NHWC" for c in convs)
        assert transposes_between_convolutions(main) == []
        assert transposes_between_convolutions(mod["main"]) == []  # (the check itself: nothing to find in NCHW either)
    mixed = ConvertConvLayout(lambda call: None if int(call.args[1].ty.shape[2]) == 1 else ("NHWC", "HWIO"))(Before)[
        "main"
    ]
    assert transposes_between_convolutions(mixed)  # different layouts: the transposes between them are found


def _calls(func, name):
    found = []
    relax.analysis.post_order_visit(
        func.body,
        lambda e: (
            found.append(e) if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == name else None
        ),
    )
    return found


def test_choice_per_convolution_and_untouched_modules():
    keep_1x1 = ConvertConvLayout(lambda call: None if int(call.args[1].ty.shape[2]) == 1 else ("NHWC", "HWIO"))
    main = keep_1x1(Before)["main"]
    assert sorted(str(c.attrs.data_layout) for c in _calls(main, "relax.nn.conv2d")) == ["NCHW", "NHWC", "NHWC"]

    @I.ir_module
    class Plain:
        @R.function
        def main(x: R.Tensor((2, 8), "float32")) -> R.Tensor((2, 8), "float32"):
            with R.dataflow():
                out = R.nn.relu(R.permute_dims(R.permute_dims(x)))
                R.output(out)
            return out

    assert ConvertConvLayout()(Plain).same_as(Plain)


def test_numerics_match_the_nchw_module():
    rng = np.random.default_rng(0)
    target = tvm.target.Target("llvm")
    for mod, shapes in (
        (Before, [(3, 4, 8, 8), (8, 4, 3, 3), (1, 8, 1, 1), (8, 8, 1, 1), (8, 8, 3, 3)]),
        (SqueezeExcite, [(2, 8, 6, 6), (8, 1, 3, 3), (4, 8, 1, 1), (8, 4, 1, 1), (8, 8, 1, 1)]),
    ):
        args = [tvm.runtime.tensor((rng.standard_normal(s) * 0.5).astype("float32")) for s in shapes]
        outs = [
            relax.VirtualMachine(tvm.compile(m, target=target), tvm.cpu())["main"](*args).numpy()
            for m in (mod, ConvertConvLayout()(mod))
        ]
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
