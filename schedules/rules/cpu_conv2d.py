"""CPU convolution rule: a 2-D convolution in NHWC with an HWIO weight (what ConvertConvLayout
gives every convolution), with its padding prologue and its element-wise epilogue (bias,
activation, residual add), symbolic batch.

Matches a PrimFunc whose only reduction block is a ``dense`` channels-last window block
(``conv_analysis.py``): ``out[n, h, w, c] += data[n, h*s + kh*d, w*s + kw*d, ic] * weight[kh, kw, ic, c]``.

How it schedules (a direct convolution, no im2col buffer):
1. Register tile: ``R`` output pixels of a row times ``V`` vectors of output channels, which LLVM
   keeps in registers with the ``V`` weight vectors and a broadcast (``conv_analysis.tile_vectors``
   and ``pixel_tile`` size it for the vector registers there are): 7 x 2 x 16 lanes with AVX-512's 32
   registers (14 accumulators); with AVX2's 16, 2 x 4 x 8 lanes (8 accumulators, 4 weight vectors)
   on even rows, and a 7-pixel row, whose divisors leave 1-pixel tiles, as two tiles of 4 and 3 pixels
   x 2 vectors (``conv_analysis.row_split``: the pixel loop partitioned, each part a copy of the block
   with its own reduction). Per step of the reduction the tile loads ``V`` weight vectors (contiguous:
   output channels are the weight's innermost axis) and broadcasts ``R`` input values, for ``R x V``
   vector FMAs.
2. Loops: ``[tiles] (parallel) > kh > kw > ic > R (unrolled) > V (unrolled) > L (vector)``. Where
   the weight is larger than one image's input (deep layers), or the input has few channels (the
   stem), the tiles are ordered output channels outermost: each thread keeps its slice of the
   weight in cache while it walks every pixel, and the padded input is made once, whole, before
   the convolution. Otherwise each thread takes pixel tiles and computes all their output
   channels, and the padded input rows a pixel tile reads are copied once for all its channel
   tiles. A convolution with at least a vector of input channels reads its padding in place
   instead: TOPI's ``pad_temp`` inlined, a bounds check per broadcast input value (3x3 64 @ 56
   20 % faster than with the copied rows, the other 3x3 layers of ResNet-50 equal to 9 % faster);
   only few input channels (a stem) keep the copy where each input value feeds many FMAs (ResNet-50's
   7x7 x 64: 17 % faster there), not where it feeds few (MobileNetV3's 3x3 x 16: 1.5x faster in place).
   A convolution without padding reads its input in place.
3. The epilogue is inlined into the tile's write-back, vectorised over channels.

Its hand-made choices are decisions (`decisions.py`), so the rules' design space (`schedules/space.py`)
can revisit them per kernel: ``units``, output-channel vectors per tile (structural, 1-4); ``rows``,
output pixels per tile (numeric: a split factor, the divisors of the row width whose tile stays on the stack);
``row_split``, a row as two tiles or as tiles that divide it (structural, where ``row_split`` offers one; ``rows``
is not asked for a split row);
``by_weights``, the tile order above (structural); ``pad_in_place``, the padding read in place or copied
(structural, where there is padding); ``ic_unroll``, input channels per unrolled step of the reduction
(structural; 8 with AVX-512, whose in-place bounds checks would keep the loop from unrolling, so it copies the
padding there, `conv_analysis.pads_in_place`; 1 with AVX2). ``sketch`` schedules a static kernel with a
decider's choices, ``apply(..., decide=Given(values))`` a kernel at any batch with a record's; with the
defaults both are the rule. The names ``rows`` / ``units`` and the noted extents (``extent_i`` pixels, ``extent_j``
output channels, ``extent_k`` the reduction) are the matmul's, so the cost model's derived features
(accumulators per tile, loads per FMA, tasks per thread) read a convolution as the GEMM it is.

Figures (single-thread times against ONNX Runtime's NCHWc kernels, the loop orders' trade-offs):
``docs/results.md``, CPU convolutional nets.
"""

from __future__ import annotations

import logging

from tvm import DataType, s_tir, tirx
from tvm.target import Target

from . import _utils as U
from . import conv_analysis as W
from . import fast_math
from .decisions import Defaults
from .tiling import STACK_LIMIT

logger = logging.getLogger(__name__)

MAX_VECTORS = 4  # the most output-channel vectors per tile (the search's and, with 16 registers, the rule's)
# a convolution with few input channels reads its padding in place where each input value feeds at most this many
# FMAs (kh * kw * output channels): MobileNetV3's stem (3x3, 16: 144) 0.088 -> 0.059 ms; ResNet-50's (7x7, 64:
# 3136) keeps the padded copy, 1.08 against 1.25 ms in place (docs/results.md)
IN_PLACE_FMAS = 256
MAX_UNROLL = 8  # input channels per unrolled step of the reduction (`conv_analysis.reduction_unroll`)


class Conv2d(fast_math.FastMathRule):
    """Direct NHWC convolution, register-tiled, vectorised over output channels (module docstring)."""

    def apply(
        self, func: tirx.PrimFunc, target: Target, _tunable: bool, decide: Defaults | None = None
    ) -> s_tir.Schedule | None:
        """The rule's schedule of `func` with `decide`'s choices (default: the rule's own); None where the
        rule does not apply."""
        decide = decide or Defaults()

        def schedule(sch, block, info, tgt):
            if not _static_window(sch, block, info):
                raise ValueError("only the batch may be symbolic")
            _schedule(sch, block, info, tgt, decide)

        return W.schedule_window(self, func, target, "dense", schedule)

    def sketch(self, sch: s_tir.Schedule, target: Target, decide: Defaults) -> bool:
        """Schedule the static kernel held by `sch` in place with `decide`'s choices (no fast-math rewrite:
        the build applies it); False where this rule does not apply (nothing is changed then)."""
        found = W.find(sch, "dense") if self.is_target_available(target) else None
        if found is None or not _static_window(sch, *found):
            return False
        _schedule(sch, *found, target, decide)
        return True


def _static_window(sch: s_tir.Schedule, block, info: W.WindowBlock) -> bool:
    """Whether every extent but the batch is static (what the rule schedules)."""
    try:
        loops = W.loops_by_kind(sch, block, info.kinds)
    except ValueError:  # an iterator not bound to one loop: not a kernel the rule knows
        return False
    return all(U.static(U.extent(sch, lp)) is not None for k, lp in loops.items() if k != "n")


def _schedule(sch: s_tir.Schedule, block, info: W.WindowBlock, target: Target, decide: Defaults) -> None:
    loops = W.loops_by_kind(sch, block, info.kinds)
    ext = {k: U.static(U.extent(sch, lp)) for k, lp in loops.items()}
    stmt = sch.get(block)
    lanes = U.lanes(target, stmt.writes[0].source.dtype)
    width = W.channel_tile(ext["c"], lanes, 1)[1]
    # The lanes split first, before `decide` annotates the root block: in TVM 0.27 a schedule whose first change
    # replaces the root block then edits the loops under it in place, in the module it was made from too (the
    # rules' space makes every sketch from one module); a first change below the root copies the path instead.
    c_b, c_l = sch.split(loops["c"], [None, width])
    decide.begin(sch, "Conv2d")
    bits = U.vector_bits(target)
    blocks = ext["c"] // width
    vector_options = [v for v in range(1, MAX_VECTORS + 1) if blocks % v == 0]
    vectors = W.tile_vectors(ext["w"], blocks, bits, MAX_VECTORS)
    vectors = decide.choose(sch, "units", vector_options, vectors, structural=True)
    pixels = W.pixel_tile(ext["w"], vectors, bits)
    # tiles that stay on the stack (in registers): a larger one is a workspace, 2.6-3.8x slower (docs/results.md)
    tile_bytes = vectors * width * DataType(stmt.writes[0].source.dtype).bits // 8
    pixel_options = [d for d in range(2, ext["w"] + 1) if ext["w"] % d == 0 and d * tile_bytes < STACK_LIMIT]
    data_bytes = W.elements(stmt.reads[info.data].source.shape[1:], symbolic=1)
    weight_bytes = W.elements(stmt.reads[info.weight].source.shape, symbolic=1)
    by_weights = int(weight_bytes > data_bytes or ext["ic"] < lanes // 2)
    by_weights = decide.choose(sch, "by_weights", (0, 1), by_weights, structural=True)
    for name, value in (
        ("extent_i", ext["n"] * ext["h"] * ext["w"] if ext["n"] is not None else None),
        ("extent_j", ext["c"]),
        ("extent_k", ext["kh"] * ext["kw"] * ext["ic"]),
        ("lanes", width),
    ):
        decide.note(sch, name, value)

    stage = W.input_stage(sch, block, info.data)
    # read the padding in place (module docstring), or with few input channels where each loaded value feeds few FMAs
    few_fmas = ext["kh"] * ext["kw"] * ext["c"] <= IN_PLACE_FMAS
    in_place = int(stage is not None and W.pads_in_place(ext["ic"], lanes, few_fmas, bits))
    in_place = decide.choose(sch, "pad_in_place", (0, 1) if stage is not None else (), in_place, structural=True)
    unroll_options = tuple(sorted({1, W.divisor_at_most(ext["ic"], MAX_UNROLL)}))  # a plain loop, or unrolled
    unroll = decide.choose(
        sch, "ic_unroll", unroll_options, W.reduction_unroll(ext["ic"], bits, MAX_UNROLL), structural=True
    )
    split = W.row_split(ext["w"], vectors, bits)
    if split:  # a row as two tiles (first `split` pixels, then the rest), or tiles that divide it
        split = decide.choose(sch, "row_split", (0, split), split, structural=True)
    if not split:
        pixels = decide.choose(sch, "rows", pixel_options, pixels)  # last: the only sampled (numeric) choice

    w_o, w_i = sch.split(loops["w"], [1, None]) if split else sch.split(loops["w"], [None, pixels])
    c_o, c_u = sch.split(c_b, [None, vectors])
    ic_loops = sch.split(loops["ic"], [None, unroll]) if unroll > 1 else [loops["ic"]]
    reduce = [loops["kh"], loops["kw"], *ic_loops] + [lp for k, lp in loops.items() if k == "u"]
    # the tile's pixels inside the reduction; a split row's outside it, until the row is partitioned (below)
    around, within = ([w_i], []) if split else ([], [w_i])
    if by_weights:  # each thread keeps a slice of the weight in cache and walks every pixel with it
        sch.reorder(c_o, loops["n"], loops["h"], w_o, *around, *reduce, *within, c_u, c_l)
        tile = outer = sch.fuse(c_o, loops["n"], loops["h"], w_o)
    else:  # each thread takes pixel tiles and computes every output channel of them
        sch.reorder(loops["n"], loops["h"], w_o, c_o, *around, *reduce, *within, c_u, c_l)
        outer, tile = sch.fuse(loops["n"], loops["h"], w_o), c_o
    sch.parallel(outer)

    if stage is not None and in_place:
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
    if unroll > 1:
        sch.unroll(ic_loops[1])
    if not split:
        sch.vectorize(c_l)
        sch.unroll(c_u)
        sch.unroll(w_i)
        sch.decompose_reduction(block, reduce[0])
        return
    # the row's two tiles: the pixel loop partitioned into a copy of the block each, moved inside the reduction
    for part in sch.loop_partition(w_i, [split, None]):
        (copy,) = sch.get_child_blocks(part)
        nest = sch.get_loops(copy)[-(len(reduce) + 3) :]  # pixels, the reduction, vectors, lanes
        sch.reorder(*nest[1:-2], nest[0])
        sch.vectorize(nest[-1])
        sch.unroll(nest[-2])
        sch.unroll(nest[0])
        sch.decompose_reduction(copy, nest[1])
