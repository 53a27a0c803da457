"""CPU convolution rule: a 2-D convolution in NHWC with an HWIO weight (what ConvertConvLayout
gives every convolution), with its padding prologue and its element-wise epilogue (bias,
activation, residual add), symbolic batch.

Matches a PrimFunc whose only reduction block is a ``dense`` channels-last window block
(``conv_analysis.py``): ``out[n, h, w, c] += data[n, h*s + kh*d, w*s + kw*d, ic] * weight[kh, kw, ic, c]``.

How it schedules (a direct convolution, no im2col buffer):
1. Register tile: ``R`` output pixels of a row times ``V`` vectors of output channels
   (7 x 2 x 16 with AVX-512: 14 vector accumulators, which LLVM keeps in registers; ``R`` as
   ``conv_analysis.pixel_tile`` sizes it for the vector registers there are). Per step of the
   reduction the tile loads ``V`` weight vectors (contiguous: output channels are the weight's
   innermost axis) and broadcasts ``R`` input values, for ``R x V`` vector FMAs.
2. Loops: ``[tiles] (parallel) > kh > kw > ic > R (unrolled) > V (unrolled) > L (vector)``. Where
   the weight is larger than one image's input (deep layers), or the input has few channels (the
   stem), the tiles are ordered output channels outermost: each thread keeps its slice of the
   weight in cache while it walks every pixel, and the padded input is made once, whole, before
   the convolution. Otherwise each thread takes pixel tiles and computes all their output
   channels, and the padded input rows a pixel tile reads are copied once for all its channel
   tiles. A convolution with at least a vector of input channels reads its padding in place
   instead: TOPI's ``pad_temp`` inlined, a bounds check per broadcast input value (3x3 64 @ 56
   20 % faster than with the copied rows, the other 3x3 layers of ResNet-50 equal to 9 % faster);
   only few input channels (the stem), where each loaded value feeds few FMAs, keep the copy
   (17 % faster there). A convolution without padding reads its input in place.
3. The epilogue is inlined into the tile's write-back, vectorised over channels.

Single-thread times against ONNX Runtime's NCHWc kernels and the loop orders' trade-offs are in
the README (Convolutional networks).
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.target import Target

from . import _utils as U
from . import conv_analysis as W
from . import fast_math

logger = logging.getLogger(__name__)

VECTORS = 2  # output-channel vectors per register tile


class Conv2d(fast_math.FastMathRule):
    """Direct NHWC convolution, register-tiled, vectorised over output channels (module docstring)."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        return W.schedule_window(self, func, target, "dense", self._schedule)

    @staticmethod
    def _schedule(sch: s_tir.Schedule, block, info: W.WindowBlock, target: Target) -> None:
        loops = W.loops_by_kind(sch, block, info.kinds)
        ext = {k: U.static(U.extent(sch, lp)) for k, lp in loops.items()}
        if any(ext[k] is None for k in ("h", "w", "c", "kh", "kw", "ic")):
            raise ValueError("only the batch may be symbolic")
        stmt = sch.get(block)
        lanes = U.lanes(target, stmt.writes[0].source.dtype)
        vectors, width = W.channel_tile(ext["c"], lanes, VECTORS)
        pixels = W.pixel_tile(ext["w"], vectors, U.vector_bits(target))
        data_bytes = _product(stmt.reads[info.data].source.shape[1:])
        weight_bytes = _product(stmt.reads[info.weight].source.shape)
        by_weights = weight_bytes > data_bytes or ext["ic"] < lanes // 2

        w_o, w_i = sch.split(loops["w"], [None, pixels])
        c_o, c_u, c_l = sch.split(loops["c"], [None, vectors, width])
        reduce = [loops[k] for k in ("kh", "kw", "ic")] + [lp for k, lp in loops.items() if k == "u"]
        if by_weights:  # each thread keeps a slice of the weight in cache and walks every pixel with it
            sch.reorder(c_o, loops["n"], loops["h"], w_o, *reduce, w_i, c_u, c_l)
            tile = outer = sch.fuse(c_o, loops["n"], loops["h"], w_o)
        else:  # each thread takes pixel tiles and computes every output channel of them
            sch.reorder(loops["n"], loops["h"], w_o, c_o, *reduce, w_i, c_u, c_l)
            outer, tile = sch.fuse(loops["n"], loops["h"], w_o), c_o
        sch.parallel(outer)

        stage = W.input_stage(sch, block, info.data)
        if stage is not None and ext["ic"] >= lanes:  # read the padding in place (module docstring)
            try:
                sch.compute_inline(stage)
                stage = None
            except Exception:  # pylint: disable=broad-except  # keep it as a copy
                logger.debug("cpu Conv2d rule: the padding stays a stage")
        if stage is not None and by_weights:  # padded once, whole, before the convolution
            stage_loops = sch.get_loops(stage)
            sch.parallel(sch.fuse(*stage_loops[:2]))
            U.vectorize_inner(sch, stage_loops[-1], lanes)
        elif stage is not None:  # the input rows of a pixel tile, padded once for all its channel tiles
            sch.compute_at(stage, outer, preserve_unit_loops=True)
            U.vectorize_inner(sch, sch.get_loops(stage)[-1], lanes)
        W.output_tile(sch, block, tile, lanes)
        sch.vectorize(c_l)
        sch.unroll(c_u)
        sch.unroll(w_i)
        sch.decompose_reduction(block, reduce[0])


def _product(shape) -> int:
    out = 1
    for dim in shape:
        out *= U.static(dim) or 1
    return out
