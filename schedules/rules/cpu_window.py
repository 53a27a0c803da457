"""CPU window rule: per-channel sliding-window reductions in NHWC, vectorised over channels:
depthwise convolutions, max / average pooling, the mean over the image (global average pool),
with their padding prologue and element-wise epilogue, symbolic batch.

Matches a PrimFunc whose only reduction block is a ``channelwise`` channels-last window block
(``conv_analysis.py``): ``out[n, h, w, c] = reduce over (kh, kw) of data[n, h*s + kh, w*s + kw, c]
(* weight[kh, kw, 0, c])``.

How it schedules:
1. Register tile: ``R`` output pixels of a row times ``V`` (1 or 2) vectors of channels
   (``conv_analysis.pixel_tile``), accumulated in registers; per window tap it loads ``V`` weight
   vectors and ``R x V`` input vectors (channels are innermost in both).
2. Loops: ``[n, h, w tiles, channel tiles] (parallel) > kh > kw > R (unrolled) > V (unrolled) >
   L (vector)``; for a mean over the whole image (output 1 x 1) the window is the image.
3. The padded input is copied, vectorised, so no bounds check is left in the inner loops: the
   rows one output row reads, once per row (then only ``[n, h]`` is parallel), where they fit in
   ``ROW_BAND`` bytes (few channels: MobileNet's first layers), else the part a tile reads.
4. The epilogue (bias, activation, the average pool's division) is inlined into the tile's
   write-back, vectorised over channels.
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.target import Target

from . import _utils as U
from . import conv_analysis as W
from . import fast_math

logger = logging.getLogger(__name__)

ROW_BAND = 32 << 10  # a padded input band up to this many bytes is copied once per output row, a larger one per tile


class Window(fast_math.FastMathRule):
    """Depthwise convolution, pooling and image means, vectorised over channels (module docstring)."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        sch = self.schedule_of(func, target)
        if sch is None:
            return None
        found = W.find(sch, "channelwise")
        if found is None:
            return None
        block, info = found
        try:
            self._schedule(sch, block, info, target)
        except Exception as err:  # pylint: disable=broad-except  # a primitive refused: not ours
            logger.debug("cpu Window rule gave up on %s: %s", func.attrs.get("global_symbol", "?"), err)
            return None
        return sch

    @staticmethod
    def _schedule(sch: s_tir.Schedule, block, info: W.WindowBlock, target: Target) -> None:
        loops = W.loops_by_kind(sch, block, info.kinds)
        ext = {k: U.static(U.extent(sch, lp)) for k, lp in loops.items()}
        if any(ext[k] is None for k in ext if k != "n"):
            raise ValueError("only the batch may be symbolic")
        dtype = sch.get(block).writes[0].source.dtype
        lanes = U.lanes(target, dtype)
        vectors, width = W.channel_tile(ext["c"], lanes, 2)
        pixels = W.pixel_tile(ext["w"], vectors, U.vector_bits(target))
        w_o, w_i = sch.split(loops["w"], [None, pixels])
        c_o, c_u, c_l = sch.split(loops["c"], [None, vectors, width])
        window = [loops[k] for k in ("kh", "kw") if k in loops] + [lp for k, lp in loops.items() if k == "u"]
        sch.reorder(loops["n"], loops["h"], w_o, c_o, *window, w_i, c_u, c_l)
        stage = W.input_stage(sch, block, info.data)
        data = sch.get(block).reads[info.data].source
        band = (
            ext.get("kh", 1) * (U.static(data.shape[2]) or 0) * ext["c"] * 4
        )  # bytes of the rows one output row reads
        if stage is not None and band <= ROW_BAND:  # copy each row band once, walk its tiles
            tile = row = sch.fuse(loops["n"], loops["h"])
            tile = sch.fuse(w_o, c_o)
        else:
            tile = row = sch.fuse(loops["n"], loops["h"], w_o, c_o)
        sch.parallel(row)
        if stage is not None:
            sch.compute_at(stage, row, preserve_unit_loops=True)
            U.vectorize_inner(sch, sch.get_loops(stage)[-1], lanes)
        W.output_tile(sch, block, tile, lanes)
        sch.vectorize(c_l)
        sch.unroll(c_u)
        sch.unroll(w_i)
        sch.decompose_reduction(block, window[0])
