"""BlockConvWeights: an NHWC convolution's HWIO weight stored in blocks of output channels.

    conv2d(x, w: (KH, KW, IC, OC), NHWC / HWIO)
        -> conv2d(x, layout_transform(w): (OC / T, KH, KW, IC, T), NHWC / OHWI{T}o)

``T`` output channels are two vectors (``conv_analysis.channel_tile``), what the CPU convolution rule
(``schedules/rules/cpu_conv2d.py``) computes per register tile with AVX-512; its AVX2 tile of four
8-lane vectors reads two blocks side by side (blocks of four vectors measured no faster there,
``docs/results.md``). In HWIO a tile's weights are
``T`` floats out of every ``OC``-long row: 128 bytes every 8 KiB for a 2048-channel layer, a new
page each row. Blocked, they are one contiguous stream, which the hardware prefetches. The
``layout_transform`` reads the weight only, so LiftTransformParams moves it to load time.

Output channels that are not a multiple of the vector width (MobileNetV3's 24, 40, 72, 120, 200)
would leave the rule half-width vectors, one per tile. Their weight is padded with zero output
channels to a multiple of the vector width (of two vectors where that adds at most 15 %: 112 -> 128,
200 -> 224), and the padded convolution is followed by a ``strided_slice`` back to ``OC``, which FuseOps
fuses into the convolution's kernel (the epilogue writes the real channels only):

    conv2d(x, w: (KH, KW, IC, OC)) -> strided_slice(conv2d(x, pad(w): (OCp / T, KH, KW, IC, T)), OC, axis 3)

(1x1 convolutions of MobileNetV3 1.7-2.1x faster, one thread, ``docs/results.md``).

TOPI's conv2d takes no blocked weight layout: ``LEGALIZE`` (give it to LegalizeOps as
``customize_legalize_map``) legalizes such a convolution into a TE compute of its own, written as
TOPI writes its NHWC convolution (a ``pad_temp`` stage, then one reduction block over kh, kw, ic),
into which FuseOps fuses the epilogue as into TOPI's; every other convolution goes to TOPI.
Convolutions that are not NHWC / HWIO with one group, or with too few output channels for a block
of two (3), are left as they are.

Runs after ConvertConvLayout, before LiftTransformParams (and so before BucketDispatch: each
bucket's copy is legalized on its own, later); needs the target in scope (the vector width sets
``T``).
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax, te, topi
from tvm.relax.expr_functor import PyExprMutator, mutator

from .fusion_utils import is_op, rewrite_functions, static_int

logger = logging.getLogger(__name__)


PAD_TO_TWO_VECTORS = 1.15  # pad to a multiple of two vectors where that makes at most this many channels more


def block_size(channels: int, target) -> tuple[int, int]:
    """(output channels padded, channels per block): the convolution rule's channel tile on ``target``
    of the channels padded to a multiple of the vector width (module docstring)."""
    from ..schedules.rules import _utils as U
    from ..schedules.rules.conv_analysis import channel_tile

    lanes = U.lanes(target, "float32")
    padded = -(-channels // lanes) * lanes
    two = -(-channels // (2 * lanes)) * 2 * lanes
    if two <= PAD_TO_TWO_VECTORS * padded:
        padded = two
    if 2 * padded > 3 * channels:  # half the vector or more would be padding: keep the channels
        padded = channels
    vectors, width = channel_tile(padded, lanes, 2)
    return padded, vectors * width


def conv2d_nhwc_blocked(data, weight, strides, padding, dilation, out_dtype: str):
    """TE: ``out[n, h, w, c] = sum data_padded[n, h*s + kh*d, w*s + kw*d, ic] * weight[c // T, kh, kw, ic, c % T]``."""
    _, height, width, _ = data.shape
    blocks, kh, kw, in_channels, block = weight.shape
    top, left, bottom, right = padding
    pad = topi.nn.pad(data, [0, top, left, 0], [0, bottom, right, 0], name="pad_temp")
    out_h = (height + top + bottom - dilation[0] * (kh - 1) - 1) // strides[0] + 1
    out_w = (width + left + right - dilation[1] * (kw - 1) - 1) // strides[1] + 1
    ry = te.reduce_axis((0, kh), name="ry")
    rx = te.reduce_axis((0, kw), name="rx")
    rc = te.reduce_axis((0, in_channels), name="rc")
    return te.compute(
        (data.shape[0], out_h, out_w, blocks * block),
        lambda n, y, x, c: te.sum(
            pad[n, y * strides[0] + ry * dilation[0], x * strides[1] + rx * dilation[1], rc].astype(out_dtype)
            * weight[c // block, ry, rx, rc, c % block].astype(out_dtype),
            axis=[ry, rx, rc],
        ),
        name="conv2d_nhwc",
    )


@mutator
class _Blocker(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, target):
        super().__init__(mod)
        self.target = target
        self.count = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not is_op(call, "relax.nn.conv2d"):
            return call
        attrs = call.attrs
        layouts = (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout or attrs.data_layout))
        weight = call.args[1]
        shape = [static_int(d) for d in weight.ty.shape.values] if weight.ty.shape is not None else [None]
        if layouts != ("NHWC", "HWIO", "NHWC") or int(attrs.groups) != 1 or None in shape:
            return call
        channels = shape[3]
        padded, block = block_size(channels, self.target)
        if block < 2 or padded % block:
            return call
        blocked = relax.op.layout_transform(
            weight,
            index_map=lambda kh, kw, ic, oc: (oc // block, kh, kw, ic, oc % block),
            pad_value=0.0 if padded != channels else None,
        )
        self.count += 1
        conv = relax.op.nn.conv2d(
            call.args[0],
            self.builder_.emit(blocked),
            attrs.strides,
            attrs.padding,
            attrs.dilation,
            1,
            "NHWC",
            f"OHWI{block}o",
            "NHWC",
            attrs.out_dtype,
        )
        if padded == channels:
            return conv
        return relax.op.strided_slice(self.builder_.emit(conv), axes=[3], begin=[0], end=[channels])


def _blocked(kernel_layout: str) -> int | None:
    """T of an ``OHWI{T}o`` kernel layout, else None."""
    middle = kernel_layout[4:-1]
    return (
        int(middle) if kernel_layout.startswith("OHWI") and kernel_layout.endswith("o") and middle.isdigit() else None
    )


def legalize_conv2d(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """LegalizeOps' conv2d: the blocked-weight NHWC convolution as the TE compute above, any other
    convolution as TOPI's (TVM's own legalization)."""
    attrs = call.attrs
    if str(attrs.data_layout) != "NHWC" or _blocked(str(attrs.kernel_layout)) is None:
        return _DEFAULT(bb, call)
    out_dtype = (
        str(attrs.out_dtype)
        if attrs.out_dtype is not None and str(attrs.out_dtype) not in ("", "void")
        else str(call.ty.dtype)
    )
    return bb.call_te(
        conv2d_nhwc_blocked,
        call.args[0],
        call.args[1],
        strides=[int(s) for s in attrs.strides],
        padding=[int(p) for p in attrs.padding],
        dilation=[int(d) for d in attrs.dilation],
        out_dtype=out_dtype,
        primfunc_name_hint="conv2d",
    )


_DEFAULT = tvm.ir.Op.get("relax.nn.conv2d").get_attr("FLegalize")
LEGALIZE = {"relax.nn.conv2d": legalize_conv2d}  # LegalizeOps(customize_legalize_map=LEGALIZE)


@tvm.transform.module_pass(opt_level=0, name="BlockConvWeights")
class BlockConvWeights:
    """NHWC / HWIO convolutions reading their weight in blocks of output channels (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        if target is None or target.kind.name != "llvm":
            return mod
        blocker = _Blocker(mod, target)
        out = rewrite_functions(mod, blocker)
        if blocker.count:
            logger.debug("BlockConvWeights: %d convolutions read blocked weights", blocker.count)
        return out if blocker.count else mod
