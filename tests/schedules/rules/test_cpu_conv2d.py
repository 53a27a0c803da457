"""cpu_conv2d.Conv2d: NHWC convolutions (HWIO or blocked weights) with padding, strides, epilogues,
a symbolic batch; what it declines."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from relaxtune.relax_passes.block_conv_weights import LEGALIZE
from relaxtune.schedules.rules import apply_cpu_rules
from relaxtune.schedules.rules.cpu_conv2d import Conv2d

AVX512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})
AVX2 = {cpu: tvm.target.Target({"kind": "llvm", "mcpu": cpu, "num-cores": 2}) for cpu in ("znver1", "haswell")}


def _conv_module(kit, ic, oc, size, kernel, stride, blocked=0, residual=False):
    """relu(conv(x, w) + bias [+ r]) in NHWC; the weight HWIO, or (OC/T, KH, KW, IC, T) when ``blocked`` = T."""
    pad = kernel // 2
    out = (size + 2 * pad - kernel) // stride + 1
    x = kit.tensor("x", (kit.B, size, size, ic))
    w = kit.tensor("w", (oc // blocked, kernel, kernel, ic, blocked) if blocked else (kernel, kernel, ic, oc))
    bias = kit.tensor("bias", (1, 1, 1, oc))
    params = [x, w, bias]
    if residual:
        params.append(kit.tensor("r", (kit.B, out, out, oc)))

    def body(bb, x, w, bias, *rest):
        layout = f"OHWI{blocked}o" if blocked else "HWIO"
        y = kit.R.add(kit.R.nn.conv2d(x, w, stride, pad, data_layout="NHWC", kernel_layout=layout), bias)
        return kit.R.nn.relu(kit.R.add(y, rest[0]) if rest else y)

    return kit.build(params, body)


def _fuse(mod, target):
    seq = tvm.transform.Sequential(
        [
            relax.transform.LegalizeOps(LEGALIZE),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
        ]
    )
    with target:
        return seq(mod)


def _reference(x, w_hwio, bias, stride, residual=None):
    pad = w_hwio.shape[0] // 2
    out = (
        torch.nn.functional.conv2d(
            torch.from_numpy(x).permute(0, 3, 1, 2),
            torch.from_numpy(w_hwio).permute(3, 2, 0, 1),
            stride=stride,
            padding=pad,
        )
        .permute(0, 2, 3, 1)
        .numpy()
        + bias
    )
    return np.maximum(out + (residual if residual is not None else 0), 0)


@pytest.mark.parametrize("avx512", [False, True])
def test_fires_vectorised_over_output_channels_register_tiled_parallel(kit, avx512):
    """16 input channels: with AVX2 the padding read in place and the reduction a plain loop; with AVX-512 the
    padding copied and 8 input channels per unrolled step (no bounds check in the unrolled FMAs)."""
    target = AVX512 if avx512 else AVX2["znver1"]
    func = kit.only_prim_func(_fuse(_conv_module(kit, 16, 64, 14, 3, 1), target), "conv2d")
    sch = kit.apply_rule(Conv2d(), func, target)
    assert sch is not None
    script = sch.mod["main"].script()
    assert "T.parallel" in script and "T.vectorized" in script and "T.unroll" in script
    assert kit.block_predicates(sch.mod["main"])["conv2d_nhwc_update"] == "T.bool(True)"
    update = script[script.index('T.sblock("conv2d_nhwc_update")') :]
    assert ("if_then_else" in update.split("T.sblock(")[1]) == (not avx512)
    assert ('T.sblock("pad_temp")' in script) == avx512
    unrolled = [sch.get(lp) for lp in sch.get_loops(sch.get_sblock("conv2d_nhwc_update"))]
    unrolled = [int(lp.extent) for lp in unrolled if lp.kind == tvm.tirx.ForKind.UNROLLED]
    assert unrolled == ([8, 7, 2] if avx512 else [2, 4])


def test_stem_pads_its_input_in_a_stage(kit, cpu_target):
    """3 input channels (a stem): the input padded once, whole; no bounds check in the FMA loop."""
    func = kit.only_prim_func(_fuse(_conv_module(kit, 3, 32, 16, 7, 2), cpu_target), "conv2d")
    script = kit.apply_rule(Conv2d(), func, cpu_target).mod["main"].script()
    assert 'T.sblock("pad_temp")' in script
    update = script[script.index('T.sblock("conv2d_nhwc_update")') :]
    assert "if_then_else" not in update.split("T.sblock(")[1]


def test_small_stem_reads_its_padding_in_place(kit, cpu_target):
    """3 input channels but few FMAs per input value (3x3 x 16 output channels, MobileNetV3's stem): in place."""
    func = kit.only_prim_func(_fuse(_conv_module(kit, 3, 16, 16, 3, 2, 16), cpu_target), "conv2d")
    script = kit.apply_rule(Conv2d(), func, cpu_target).mod["main"].script()
    assert 'T.sblock("pad_temp")' not in script
    update = script[script.index('T.sblock("conv2d_nhwc_update")') :]
    assert "if_then_else" in update.split("T.sblock(")[1]


@pytest.mark.parametrize(
    ("ic", "oc", "size", "kernel", "stride", "blocked"),
    [
        (3, 16, 16, 3, 2, 16),  # a small stem: padding read in place
        (16, 64, 14, 3, 1, 0),  # 3x3, padded
        (16, 64, 14, 3, 1, 32),  # the same, blocked weight
        (24, 48, 9, 3, 2, 16),  # stride 2, odd size, blocked
        (32, 64, 7, 1, 1, 32),  # 1x1, no padding: read in place
        (3, 32, 16, 7, 2, 32),  # a stem: 3 input channels, 7x7 stride 2
        (40, 24, 7, 1, 1, 0),  # channels that are not a multiple of the vector width
        (32, 64, 7, 3, 1, 16),  # a 7-pixel row: with 16 registers two tiles, 4 + 3 pixels
    ],
)
def test_numerics_symbolic_batch(kit, cpu_target, ic, oc, size, kernel, stride, blocked):
    mod = _fuse(_conv_module(kit, ic, oc, size, kernel, stride, blocked), cpu_target)
    func = kit.only_prim_func(mod, "conv2d")
    assert kit.apply_rule(Conv2d(), func, cpu_target) is not None
    scheduled = apply_cpu_rules(mod, cpu_target)
    run = kit.Runner(scheduled, cpu_target)
    rng = np.random.default_rng(0)
    w = kit.rand(rng, kernel, kernel, ic, oc, scale=0.2)
    packed = w.reshape(kernel, kernel, ic, oc // blocked, blocked).transpose(3, 0, 1, 2, 4).copy() if blocked else w
    bias = kit.rand(rng, 1, 1, 1, oc)
    for b in (1, 3, 16):
        x = kit.rand(rng, b, size, size, ic)
        kit.assert_close(run(x, packed, bias), _reference(x, w, bias, stride))


def test_residual_add_epilogue_in_the_same_kernel(kit, cpu_target):
    mod = _fuse(_conv_module(kit, 16, 32, 8, 3, 1, 16, residual=True), cpu_target)
    assert len(kit.prim_funcs(mod)) == 1  # conv + bias + residual + relu: one kernel
    run = kit.Runner(apply_cpu_rules(mod, cpu_target), cpu_target)
    rng = np.random.default_rng(1)
    w, bias = kit.rand(rng, 3, 3, 16, 32, scale=0.2), kit.rand(rng, 1, 1, 1, 32)
    packed = w.reshape(3, 3, 16, 2, 16).transpose(3, 0, 1, 2, 4).copy()
    x, r = kit.rand(rng, 2, 8, 8, 16), kit.rand(rng, 2, 8, 8, 32)
    kit.assert_close(run(x, packed, bias, r), _reference(x, w, bias, 1, r))


def test_declines_nchw_and_grouped(kit, cpu_target):
    x, w = kit.tensor("x", (1, 16, 8, 8)), kit.tensor("w", (32, 16, 3, 3))
    nchw = kit.build([x, w], lambda bb, x, w: kit.R.nn.conv2d(x, w, 1, 1))
    assert kit.apply_rule(Conv2d(), kit.only_prim_func(_fuse(nchw, cpu_target)), cpu_target) is None
    x, w = kit.tensor("x", (1, 8, 8, 16)), kit.tensor("w", (3, 3, 1, 16))
    depthwise = kit.build(
        [x, w], lambda bb, x, w: kit.R.nn.conv2d(x, w, 1, 1, groups=16, data_layout="NHWC", kernel_layout="HWIO")
    )
    assert kit.apply_rule(Conv2d(), kit.only_prim_func(_fuse(depthwise, cpu_target)), cpu_target) is None


@pytest.mark.parametrize("channels", [12, 40, 120])
def test_padded_output_channels_one_kernel_matches_torch(kit, cpu_target, channels):
    """The padded, sliced convolution fused with its bias and activation into one kernel, scheduled by
    the convolution rule, against torch at batch 1, 3 and 16 (the bounds of b)."""
    from relaxtune.relax_passes.block_conv_weights import BlockConvWeights, block_size

    x, w, bias = (
        kit.tensor("x", (kit.B, 10, 10, 16)),
        kit.tensor("w", (3, 3, 16, channels)),
        kit.tensor("bias", (1, 1, 1, channels)),
    )
    mod = kit.build(
        [x, w, bias],
        lambda bb, x, w, bias: kit.R.nn.relu(
            kit.R.add(kit.R.nn.conv2d(x, w, 1, 1, data_layout="NHWC", kernel_layout="HWIO"), bias)
        ),
    )
    with cpu_target:
        padded = block_size(channels, cpu_target)[0]
        mod = _fuse(BlockConvWeights()(mod), cpu_target)
    assert padded > channels or channels == 40  # 40 is whole 8-lane vectors
    (name,) = [n for n in kit.prim_funcs(mod) if "conv2d" in n]
    assert ("strided_slice" in name) == (padded > channels), name  # the slice in the convolution's kernel
    fused = kit.prim_funcs(mod)[name]
    assert kit.apply_rule(Conv2d(), fused, cpu_target) is not None
    run = kit.Runner(apply_cpu_rules(mod, cpu_target), cpu_target)
    rng = np.random.default_rng(channels)
    wv, bv = kit.rand(rng, 3, 3, 16, channels, scale=0.2), kit.rand(rng, 1, 1, 1, channels)
    for b in (1, 3, 16):
        xv = kit.rand(rng, b, 10, 10, 16)
        ref = (
            torch.nn.functional.conv2d(
                torch.from_numpy(xv).permute(0, 3, 1, 2), torch.from_numpy(wv).permute(3, 2, 0, 1), padding=1
            )
            .permute(0, 2, 3, 1)
            .numpy()
        )
        kit.assert_close(run(xv, wv, bv), np.maximum(ref + bv, 0))


def _conv_kernel(kit, target):
    """relu(conv 3x3 16 -> 64 @14 + bias), the weight in blocks of 32, symbolic batch: (module, kernel)."""
    mod = _fuse(_conv_module(kit, 16, 64, 14, 3, 1, 32), target)
    return mod, kit.only_prim_func(mod, "conv2d")


@pytest.mark.parametrize("avx512", [False, True])
def test_probe_lists_the_decisions_with_the_rules_values(kit, avx512):
    """The rule's hand-made choices as decisions (units, by_weights, pad_in_place, ic_unroll structural; rows,
    the pixels per tile, sampled), each default the rule's value, every pixel count a divisor of the row that fits;
    the padding read in place and a plain reduction loop with AVX2, copied and unrolled by 8 with AVX-512."""
    from relaxtune.schedules.rules import _utils as U
    from relaxtune.schedules.rules import decisions
    from relaxtune.schedules.rules.conv_analysis import pixel_tile, tile_vectors

    target = AVX512 if avx512 else AVX2["znver1"]
    _, func = _conv_kernel(kit, target)
    probe = decisions.Probe()
    with target:
        sch = Conv2d().apply(func, target, False, decide=probe)
        plain = Conv2d().apply(func, target, False)
    tvm.ir.assert_structural_equal(sch.mod["main"], plain.mod["main"])  # the defaults are the rule
    by_name = {c.name: c for c in probe.choices}
    assert list(by_name) == ["units", "by_weights", "pad_in_place", "ic_unroll", "rows"]
    assert [by_name[n].structural for n in by_name] == [True, True, True, True, False]
    assert all(c.default in c.candidates for c in probe.choices)
    assert by_name["pad_in_place"].default == int(not avx512) and by_name["pad_in_place"].candidates == (0, 1)
    assert by_name["ic_unroll"].default == (8 if avx512 else 1) and by_name["ic_unroll"].candidates == (1, 8)
    bits, lanes = U.vector_bits(target), U.lanes(target, "float32")
    assert by_name["units"].candidates == (1, 2, 4)  # 64 channels
    assert by_name["units"].default == tile_vectors(14, 64 // lanes, bits, 4)
    assert by_name["rows"].default == pixel_tile(14, by_name["units"].default, bits)
    tile = by_name["units"].default * lanes * 4  # divisors of 14 whose tile stays under 1 KiB: the stack
    fitting = {d for d in (2, 7, 14) if d * tile < 1024}
    assert set(by_name["rows"].candidates) == fitting | {by_name["rows"].default}


@pytest.mark.parametrize(
    ("target", "size", "units", "rows"),
    [
        # 32 vector registers: 7 pixels x 2 vectors of 16 lanes, 14 accumulators, at every row width
        (AVX512, 56, 2, 7),
        (AVX512, 14, 2, 7),
        (AVX512, 7, 2, 7),
        # 16: 2 pixels x 4 vectors of 8 lanes on even rows (8 accumulators, 4 weight vectors, a broadcast) ...
        (AVX2["znver1"], 56, 4, 2),
        (AVX2["haswell"], 28, 4, 2),
        (AVX2["znver1"], 14, 4, 2),
        # ... and rows of 7 as two tiles of 4 + 3 pixels x 2 vectors, where tiles that divide the row have 1 pixel
        (AVX2["znver1"], 7, 2, (4, 3)),
        (AVX2["haswell"], 7, 2, (4, 3)),
    ],
)
def test_register_tile_by_vector_registers(kit, target, size, units, rows):
    """The rule's tile (vectors of output channels x pixels of a row) for the registers the target has: the
    AVX-512 tile as it always was, the AVX2 one sized for 16 registers; the tile is what the schedule unrolls."""
    from relaxtune.schedules.rules import _utils as U
    from relaxtune.schedules.rules import decisions

    lanes = U.lanes(target, "float32")
    mod = _fuse(_conv_module(kit, 64, 128, size, 3, 1, 2 * lanes), target)
    probe = decisions.Probe()
    with target:
        sch = Conv2d().apply(kit.only_prim_func(mod, "conv2d"), target, False, decide=probe)
    by_name = {c.name: c for c in probe.choices}
    assert by_name["units"].default == units and units in by_name["units"].candidates
    updates = re.findall(r'T\.sblock\("(conv2d_nhwc\w*_update)"\)', sch.mod["main"].script())
    if isinstance(rows, tuple):  # a split row: no `rows` asked, each part its own block and unrolled tile
        assert "rows" not in by_name and by_name["row_split"].default == rows[0]
    else:
        assert "row_split" not in by_name and by_name["rows"].default == rows and rows in by_name["rows"].candidates
        rows = (rows,)
    tiles = [sch.get_sblock(name) for name in updates]
    assert len(tiles) == len(rows)
    for pixels, tile in zip(rows, tiles):
        loops = [sch.get(lp) for lp in sch.get_loops(tile)]
        unroll = [8] if U.vector_bits(target) >= 512 else []  # AVX-512: 8 input channels per step, unrolled
        assert [int(lp.extent) for lp in loops if lp.kind == tvm.tirx.ForKind.UNROLLED] == [*unroll, pixels, units]


def test_avx2_tile_on_7_pixel_rows_stays_in_registers(kit):
    """3x3 64 -> 64 @7 on AVX2, the tiles compiled and read back: 4 + 3 pixels x 2 vectors keep their 8 and 6
    accumulators, the weight vectors and a broadcast in ymm registers (no spill)."""
    target = AVX2["znver1"]
    mod = _fuse(_conv_module(kit, 64, 64, 7, 3, 1, 16), target)
    func = kit.only_prim_func(mod, "conv2d")
    with target:
        sch = Conv2d().apply(func, target, False)
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=target)
    asm = lib.mod.inspect_source("asm")
    fmas = [line for line in asm.splitlines() if "vfmadd231ps" in line and "ymm" in line]
    assert len(fmas) >= 14 and not any("zmm" in line for line in asm.splitlines())
    blocks = re.split(r"\n(?=\.LBB|\S+:)", asm)  # basic blocks: no stack access where the FMAs are (a spill)
    assert not [block for block in blocks if "vfmadd231ps" in block and "(%rsp)" in block]


@pytest.mark.parametrize(
    "values",
    [
        {"units": 1, "rows": 2, "by_weights": 1, "pad_in_place": 0},  # padded whole, channel tiles outermost
        {"units": 4, "rows": 2, "by_weights": 0, "pad_in_place": 0},  # rows copied per pixel tile
        {"units": 1, "rows": 14, "by_weights": 1, "pad_in_place": 1},
        {"units": 2, "rows": 7, "by_weights": 1, "pad_in_place": 0, "ic_unroll": 8},  # the AVX-512 rule
        {"units": 4, "rows": 2, "by_weights": 0, "pad_in_place": 1, "ic_unroll": 4},  # unrolled, bounds checked
    ],
)
def test_given_decisions_match_torch_symbolic_batch(kit, cpu_target, values):
    """A record's decisions re-applied to the kernel with its symbolic batch: torch's result at b = 1, 3, 16."""
    from relaxtune.schedules.rules import decisions

    mod, func = _conv_kernel(kit, cpu_target)
    gv = next(gv for gv, f in mod.functions_items() if "conv2d" in gv.name_hint)
    with cpu_target:
        sch = Conv2d().apply(func, cpu_target, False, decide=decisions.Given(values))
    assert sch is not None
    script = sch.mod["main"].script()
    assert ('T.sblock("pad_temp")' in script) == (not values["pad_in_place"])
    mod[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    run = kit.Runner(apply_cpu_rules(mod, cpu_target), cpu_target)
    rng = np.random.default_rng(2)
    w, bias = kit.rand(rng, 3, 3, 16, 64, scale=0.2), kit.rand(rng, 1, 1, 1, 64)
    packed = w.reshape(3, 3, 16, 2, 32).transpose(3, 0, 1, 2, 4).copy()
    for b in (1, 3, 16):
        x = kit.rand(rng, b, 14, 14, 16)
        kit.assert_close(run(x, packed, bias), _reference(x, w, bias, 1))


@pytest.mark.parametrize(
    "values",
    [
        {"row_split": 4, "by_weights": 1, "pad_in_place": 1},  # the AVX2 rule on 7-pixel rows
        {"row_split": 4, "by_weights": 0, "pad_in_place": 0},  # pixel tiles outermost, the rows copied per tile
        {"row_split": 4, "by_weights": 1, "pad_in_place": 0},  # the input padded whole
        {"row_split": 0, "units": 2, "by_weights": 1, "pad_in_place": 1},  # tiles that divide the row: 1 pixel
    ],
)
def test_split_row_matches_torch_symbolic_batch(kit, values):
    """A 7-pixel row as two register tiles (4 + 3 pixels x 2 vectors, AVX2) with each tile order and padding:
    torch's result at b = 1, 3, 16 (compiled for haswell, which this x86 host runs)."""
    from relaxtune.schedules.rules import decisions

    target = AVX2["haswell"]
    mod = _fuse(_conv_module(kit, 16, 64, 7, 3, 1, 16), target)
    gv = next(gv for gv, f in mod.functions_items() if "conv2d" in gv.name_hint)
    with target:
        sch = Conv2d().apply(mod[gv], target, False, decide=decisions.Given(values))
    script = sch.mod["main"].script()
    assert len(re.findall(r'T\.sblock\("conv2d_nhwc\w*_update"\)', script)) == (2 if values["row_split"] else 1)
    mod[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    run = kit.Runner(apply_cpu_rules(mod, target), target)
    rng = np.random.default_rng(3)
    w, bias = kit.rand(rng, 3, 3, 16, 64, scale=0.2), kit.rand(rng, 1, 1, 1, 64)
    packed = w.reshape(3, 3, 16, 4, 16).transpose(3, 0, 1, 2, 4).copy()
    for b in (1, 3, 16):
        x = kit.rand(rng, b, 7, 7, 16)
        kit.assert_close(run(x, packed, bias), _reference(x, w, bias, 1))


@pytest.mark.parametrize("channels", [32, 120])
def test_excitation_scale_times_the_map_is_its_own_parallel_nest(kit, cpu_target, channels):
    """A squeeze-and-excitation's 1x1 convolution on the pooled (b, 1, 1, C) vector, hard-sigmoid, times the
    (b, 14, 14, C) map, in one kernel: the multiply is not under the convolution's tiles (which would walk the
    whole map once per tile of channels) but a nest of its own, parallel over the map's pixels and vectorised
    over its channels; against torch at b = 1, 3 and 16 (the padded 120 channels included)."""
    from relaxtune.relax_passes.block_conv_weights import BlockConvWeights

    s, w, x = (
        kit.tensor("s", (kit.B, 1, 1, 16)),
        kit.tensor("w", (1, 1, 16, channels)),
        kit.tensor("x", (kit.B, 14, 14, channels)),
    )

    def body(bb, s, w, x):
        scale = kit.R.nn.conv2d(s, w, 1, 0, data_layout="NHWC", kernel_layout="HWIO")
        return kit.R.multiply(
            kit.R.divide(
                kit.R.clip(kit.R.add(scale, relax.const(3.0, "float32")), 0.0, 6.0), relax.const(6.0, "float32")
            ),
            x,
        )

    with cpu_target:
        mod = _fuse(BlockConvWeights()(kit.build([s, w, x], body)), cpu_target)
    (name,) = [n for n in kit.prim_funcs(mod) if "conv2d" in n]
    assert "multiply" in name
    sch = kit.apply_rule(Conv2d(), kit.prim_funcs(mod)[name], cpu_target)
    multiply = sch.get_sblock("T_multiply")
    loops = [sch.get(lp) for lp in sch.get_loops(multiply)]
    assert loops[0].kind == tvm.tirx.ForKind.PARALLEL and loops[-1].kind == tvm.tirx.ForKind.VECTORIZED
    conv_tile = sch.get(sch.get_loops(sch.get_sblock("conv2d_nhwc_update"))[0])
    assert not any(lp.same_as(conv_tile) for lp in loops)  # not under the convolution's tiles
    run = kit.Runner(apply_cpu_rules(mod, cpu_target), cpu_target)
    rng = np.random.default_rng(channels)
    wv = kit.rand(rng, 1, 1, 16, channels)
    for b in (1, 3, 16):
        sv, xv = kit.rand(rng, b, 1, 1, 16), kit.rand(rng, b, 14, 14, channels)
        ref = np.clip(sv.astype("float64") @ wv[0, 0] + 3.0, 0.0, 6.0) / 6.0 * xv
        kit.assert_close(run(sv, wv, xv), ref)
