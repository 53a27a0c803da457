"""CPU window rule: per-channel sliding-window reductions in NHWC, vectorised over channels:
depthwise convolutions, max / average pooling, the mean over the image (global average pool),
with their padding prologue and element-wise epilogue, symbolic batch.

Matches a PrimFunc whose only reduction block is a ``channelwise`` channels-last window block
(``conv_analysis.py``): ``out[n, h, w, c] = reduce over (kh, kw) of data[n, h*s + kh, w*s + kw, c]
(* weight[kh, kw, 0, c])``.

How it schedules:
1. Register tile: ``R`` output pixels of a row times ``V`` (1 or 2) vectors of channels
   (``conv_analysis.tile_vectors`` and ``pixel_tile``: 7 x 2 with AVX-512; with AVX2 4 x 2 on rows of 56
   and 28, 7 x 1 on rows of 14 and 7, where two vectors would leave 2 and 1 pixels), accumulated in
   registers; per window tap it loads ``V`` weight vectors and ``R x V`` input vectors (channels are
   innermost in both).
2. Loops: ``[n, h, w tiles, channel tiles] (parallel) > kh > kw > R (unrolled) > V (unrolled) >
   L (vector)``; for a mean over the whole image (output 1 x 1) the window is the image.
3. The padding is read in place: the input stage (TOPI's ``pad_temp``) is inlined into the window
   block, so each tap loads the input where it lies and the border taps read the padding value
   (a bounds check per loaded vector, uniform over its lanes). Copying the padded input per tile
   or per row band, as the convolution rule does, costs a copy for every few FMAs here (one FMA
   per loaded vector, no reduction over input channels to amortise it over): 1.0-2.0x slower
   (``docs/results.md``). Where the stage cannot be inlined it is copied per tile.
4. The epilogue (bias, activation, the average pool's division) is inlined into the tile's
   write-back, vectorised over channels.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from . import _utils as U
from . import conv_analysis as W
from . import fast_math


class Window(fast_math.FastMathRule):
    """Depthwise convolution, pooling and image means, vectorised over channels (module docstring)."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        return W.schedule_window(self, func, target, "channelwise", self._schedule)

    @staticmethod
    def _schedule(sch: s_tir.Schedule, block, info: W.WindowBlock, target: Target) -> None:
        loops = W.loops_by_kind(sch, block, info.kinds)
        ext = {k: U.static(U.extent(sch, lp)) for k, lp in loops.items()}
        if any(ext[k] is None for k in ext if k != "n"):
            raise ValueError("only the batch may be symbolic")
        dtype = sch.get(block).writes[0].source.dtype
        lanes = U.lanes(target, dtype)
        width = W.channel_tile(ext["c"], lanes, 1)[1]
        vectors = W.tile_vectors(ext["w"], ext["c"] // width, U.vector_bits(target), 2, split_rows=False)
        pixels = W.pixel_tile(ext["w"], vectors, U.vector_bits(target))
        w_o, w_i = sch.split(loops["w"], [None, pixels])
        c_o, c_u, c_l = sch.split(loops["c"], [None, vectors, width])
        window = [loops[k] for k in ("kh", "kw") if k in loops] + [lp for k, lp in loops.items() if k == "u"]
        sch.reorder(loops["n"], loops["h"], w_o, c_o, *window, w_i, c_u, c_l)
        tile = sch.fuse(loops["n"], loops["h"], w_o, c_o)
        sch.parallel(tile)
        stage = W.input_stage(sch, block, info.data)
        if stage is not None:
            try:
                sch.compute_inline(stage)
            except Exception:  # pylint: disable=broad-except  # keep it, copied per tile
                sch.compute_at(stage, tile, preserve_unit_loops=True)
                U.vectorize_inner(sch, sch.get_loops(stage)[-1], lanes)
        W.output_tile(sch, block, tile, lanes)
        sch.vectorize(c_l)
        sch.unroll(c_u)
        sch.unroll(w_i)
        sch.decompose_reduction(block, window[0])
