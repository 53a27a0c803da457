"""cpu_window.Window: depthwise convolutions, max / average pooling and image means in NHWC,
vectorised over channels, symbolic batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm

from relaxtune.schedules.rules import apply_cpu_rules
from relaxtune.schedules.rules.cpu_window import Window

C = 48  # three AVX-512 vectors, six AVX2 ones


def _nchw(x):
    return torch.from_numpy(x).permute(0, 3, 1, 2)


def _nhwc(t):
    return t.permute(0, 2, 3, 1).numpy()


def _check(kit, cpu_target, mod, args_of, reference, sizes=(1, 3)):
    fused = kit.fuse(mod, cpu_target)
    func = next(f for f in kit.prim_funcs(fused).values())
    sch = kit.apply_rule(Window(), func, cpu_target)
    assert sch is not None
    script = sch.mod["main"].script()
    assert "T.parallel" in script and "T.vectorized" in script
    run = kit.Runner(apply_cpu_rules(fused, cpu_target), cpu_target)
    rng = np.random.default_rng(0)
    for b in sizes:
        args = args_of(rng, b)
        kit.assert_close(run(*args), reference(*args))


@pytest.mark.parametrize(("kernel", "stride", "size"), [(3, 1, 14), (5, 2, 9), (3, 2, 16), (5, 1, 7)])
def test_depthwise_with_bias_and_clip(kit, cpu_target, kernel, stride, size):
    pad = kernel // 2
    x, w, bias = (
        kit.tensor("x", (kit.B, size, size, C)),
        kit.tensor("w", (kernel, kernel, 1, C)),
        kit.tensor("bias", (1, 1, 1, C)),
    )
    mod = kit.build(
        [x, w, bias],
        lambda bb, x, w, bias: kit.R.clip(
            kit.R.add(kit.R.nn.conv2d(x, w, stride, pad, groups=C, data_layout="NHWC", kernel_layout="HWIO"), bias),
            0,
            6,
        ),
    )

    def args_of(rng, b):
        return [kit.rand(rng, b, size, size, C), kit.rand(rng, kernel, kernel, 1, C), kit.rand(rng, 1, 1, 1, C)]

    def reference(x, w, bias):
        out = torch.nn.functional.conv2d(
            _nchw(x), torch.from_numpy(w).permute(3, 2, 0, 1), stride=stride, padding=pad, groups=C
        )
        return np.clip(_nhwc(out) + bias, 0, 6)

    _check(kit, cpu_target, mod, args_of, reference, sizes=(1, 3, 16))


def test_depthwise_reads_its_padding_in_place(kit, cpu_target):
    """No padded copy of the input: the window block loads the input where it lies, the border taps
    the padding value (copying it per tile cost 1.0-2.0x the kernel's time)."""
    x, w = kit.tensor("x", (kit.B, 14, 14, C)), kit.tensor("w", (3, 3, 1, C))
    mod = kit.build(
        [x, w], lambda bb, x, w: kit.R.nn.conv2d(x, w, 2, 1, groups=C, data_layout="NHWC", kernel_layout="HWIO")
    )
    func = next(iter(kit.prim_funcs(kit.fuse(mod, cpu_target)).values()))
    assert "pad_temp" in func.script()  # TOPI's padding stage, before the rule
    script = kit.apply_rule(Window(), func, cpu_target).mod["main"].script()
    assert 'T.sblock("pad_temp")' not in script and "sblock_alloc_buffer((T.int64(1), T.int64(16)" not in script
    update = script[script.index('_update")') :]
    assert "T.if_then_else" in update  # the bounds check in the window block itself


@pytest.mark.parametrize(
    ("mcpu", "size", "vectors", "pixels"),
    [
        ("skylake-avx512", 28, 2, 7),  # 32 registers: 7 pixels x 2 vectors of 16 lanes on every row
        ("skylake-avx512", 7, 2, 7),
        ("znver1", 28, 2, 4),  # 16: 4 x 2 vectors of 8 lanes ...
        ("haswell", 14, 1, 7),  # ... and 7 x 1 on rows of 14 and 7, where two vectors would leave 2 and 1 pixels
        ("znver1", 7, 1, 7),
    ],
)
def test_register_tile_by_vector_registers(kit, mcpu, size, vectors, pixels):
    """The depthwise tile (pixels of a row x vectors of channels, both unrolled) for the registers the target has."""
    from tvm import tirx

    from relaxtune.schedules.rules.conv_analysis import find

    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    x, w = kit.tensor("x", (kit.B, size, size, 64)), kit.tensor("w", (3, 3, 1, 64))
    mod = kit.build(
        [x, w], lambda bb, x, w: kit.R.nn.conv2d(x, w, 1, 1, groups=64, data_layout="NHWC", kernel_layout="HWIO")
    )
    sch = kit.apply_rule(Window(), next(iter(kit.prim_funcs(kit.fuse(mod, target)).values())), target)
    block, _ = find(sch, "channelwise")
    loops = [sch.get(lp) for lp in sch.get_loops(block)]
    assert [int(lp.extent) for lp in loops if lp.kind == tirx.ForKind.UNROLLED] == [pixels, vectors]


def test_max_pool(kit, cpu_target):
    x = kit.tensor("x", (kit.B, 16, 16, C))
    mod = kit.build([x], lambda bb, x: kit.R.nn.max_pool2d(x, 3, 2, 1, layout="NHWC"))
    _check(
        kit,
        cpu_target,
        mod,
        lambda rng, b: [kit.rand(rng, b, 16, 16, C)],
        lambda x: _nhwc(torch.nn.functional.max_pool2d(_nchw(x), 3, 2, 1)),
    )


def test_average_pool(kit, cpu_target):
    x = kit.tensor("x", (kit.B, 12, 12, C))
    mod = kit.build([x], lambda bb, x: kit.R.nn.avg_pool2d(x, 3, 1, 1, layout="NHWC"))
    _check(
        kit,
        cpu_target,
        mod,
        lambda rng, b: [kit.rand(rng, b, 12, 12, C)],
        lambda x: _nhwc(torch.nn.functional.avg_pool2d(_nchw(x), 3, 1, 1, count_include_pad=False)),
    )


def test_image_mean(kit, cpu_target):
    """The global average pool of a channels-last network: the window is the whole image."""
    x = kit.tensor("x", (kit.B, 7, 7, 2 * C))
    mod = kit.build([x], lambda bb, x: kit.R.mean(x, axis=[1, 2], keepdims=True))
    _check(
        kit,
        cpu_target,
        mod,
        lambda rng, b: [kit.rand(rng, b, 7, 7, 2 * C)],
        lambda x: x.mean(axis=(1, 2), keepdims=True),
    )


def test_declines_dense_convolution_and_nchw_pool(kit, cpu_target):
    x, w = kit.tensor("x", (1, 8, 8, 16)), kit.tensor("w", (3, 3, 16, 32))
    dense = kit.build([x, w], lambda bb, x, w: kit.R.nn.conv2d(x, w, 1, 1, data_layout="NHWC", kernel_layout="HWIO"))
    assert kit.apply_rule(Window(), kit.only_prim_func(kit.fuse(dense, cpu_target)), cpu_target) is None
    x = kit.tensor("x", (1, 16, 8, 8))
    nchw = kit.build([x], lambda bb, x: kit.R.nn.max_pool2d(x, 3, 1, 1))
    assert kit.apply_rule(Window(), kit.only_prim_func(kit.fuse(nchw, cpu_target)), cpu_target) is None
