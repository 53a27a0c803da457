"""What the convolution and window rules share (not a rule): recognising a channels-last
sliding-window reduction block, and placing its input and output stages around a tile.

A *channels-last window block* writes ``out[n, h, w, c]`` (four spatial block iterators, the channel
``c`` innermost) and reduces over window iterators that index the height and width of its data
read ``data[n, h * s + kh * d, w * s + kw * d, ...]``:

* ``dense``: ``data[.., ic] * weight[kh, kw, ic, c]``, a convolution (``ic`` a reduction over the
  input channels; ``c`` does not index the data), or with the weight in blocks of output channels
  ``weight[c // T, kh, kw, ic, c % T]`` (``relax_passes/block_conv_weights.py``);
* ``channelwise``: ``data[.., c] (* weight[kh, kw, 0, c])``: a depthwise convolution, a max / sum
  pool, a mean over the image (the window is then the whole height and width).

Layouts are TOPI's ``NHWC`` (weights ``HWIO``), what ``relax_passes/conv_layout.py`` gives every
convolution, pooling and reduction between them. Extents may be symbolic in ``n`` only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis.common_analysis import get_sblockrealize
from tvm.tirx.analysis import undefined_vars

from . import _utils as U

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WindowBlock:
    """The analysed block: ``kinds`` names each block iterator (n, h, w, c: the output axes;
    kh, kw: window; ic: input channels; u: a unit reduction), ``data`` / ``weight`` index its
    reads (``weight`` None for a pool)."""

    kind: str  # "dense" or "channelwise"
    kinds: tuple[str, ...]
    data: int
    weight: int | None


def _vars(expr) -> set:
    return {v for v in undefined_vars(expr)}


def _single_var(region) -> list | None:
    """The region's point indices when each is exactly one variable (a write ``out[n, h, w, c]``)."""
    out = []
    for rng in region:
        if not (isinstance(rng.extent, tirx.IntImm) and int(rng.extent) == 1) or not isinstance(rng.min, tirx.Var):
            return None
        out.append(rng.min)
    return out


def analyze(block) -> WindowBlock | None:
    """The block as a channels-last window reduction, or None (see module docstring)."""
    if len(block.writes) != 1 or len(block.writes[0].region) != 4 or not 1 <= len(block.reads) <= 3:
        return None
    out = _single_var(block.writes[0].region)
    iters = [iv.var for iv in block.iter_vars]
    if out is None or len(set(out)) != 4 or not all(any(o.same_as(v) for v in iters) for o in out):
        return None
    n, h, w, c = out
    reads = [r for r in block.reads if not r.source.same_as(block.writes[0].source)]
    if any(
        len(r.region) not in (4, 5)
        or any(not (isinstance(x.extent, tirx.IntImm) and int(x.extent) == 1) for x in r.region)
        for r in reads
    ):
        return None
    reduce = [iv for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    spatial = [iv for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    if len(spatial) != 4 or len(reduce) + 4 != len(iters) or not reduce:
        return None
    data = next(
        (i for i, r in enumerate(block.reads) if r in reads and len(r.region) == 4 and _vars(r.region[0].min) == {n}),
        None,
    )
    if data is None:
        return None
    index = [r.min for r in block.reads[data].region]
    rows, cols, chan = _vars(index[1]), _vars(index[2]), _vars(index[3])
    unit = {iv.var for iv in block.iter_vars if isinstance(iv.dom.extent, tirx.IntImm) and int(iv.dom.extent) == 1}
    if (h not in rows and h not in unit) or (w not in cols and w not in unit) or rows & cols or n in rows | cols:
        return None
    kinds = {}
    for iv in reduce:
        var, unit = iv.var, isinstance(iv.dom.extent, tirx.IntImm) and int(iv.dom.extent) == 1
        if var in rows:
            kinds[var] = "kh"
        elif var in cols:
            kinds[var] = "kw"
        elif var in chan:
            kinds[var] = "u" if unit else "ic"
        else:
            return None
    weights = [i for i, r in enumerate(block.reads) if r in reads and i != data]
    if len(weights) > 1:
        return None
    weight = weights[0] if weights else None
    if weight is not None:  # HWIO [kh, kw, ic, c], or blocked [c // T, kh, kw, ic, c % T] (BlockConvWeights)
        windex = [r.min for r in block.reads[weight].region]
        used = set().union(*(_vars(x) for x in windex))
        if c not in _vars(windex[-1]) or used - {c} - {iv.var for iv in reduce}:
            return None
    if c in chan:
        if "ic" in kinds.values() or (chan - {c}) - {v for v, k in kinds.items() if k == "u"}:
            return None
        kind = "channelwise"
    else:
        if weight is None or "ic" not in kinds.values() or chan != {v for v, k in kinds.items() if k == "ic"}:
            return None
        kind = "dense"
    names = {n: "n", h: "h", w: "w", c: "c"}
    return WindowBlock(kind, tuple(names.get(v) or kinds[v] for v in iters), data, weight)


def loops_by_kind(sch: s_tir.Schedule, block, kinds: tuple[str, ...]) -> dict[str, object]:
    """The loop each block iterator is bound to, by its kind (n, h, w, c, kh, kw, ic, u)."""
    loops = {sch.get(lp).loop_var: lp for lp in sch.get_loops(block)}
    out = {}
    for kind, value in zip(kinds, get_sblockrealize(sch, block).iter_values):
        if not isinstance(value, tirx.Var) or value not in loops:
            raise ValueError(f"block iterator {kind} is not bound to one loop")
        out[kind] = loops[value]
    return out


def find(sch: s_tir.Schedule, kind: str):
    """(block rv, analysis) of the function's only reduction block when it is a window block of
    ``kind``, every other block spatial; else None."""
    blocks = U.root_children(sch)
    if not blocks:
        return None
    reductions = [b for b in blocks if any(iv.iter_type != tirx.IterVar.DataPar for iv in sch.get(b).iter_vars)]
    if len(reductions) != 1:
        return None
    found = analyze(sch.get(reductions[0]))
    if found is None or found.kind != kind:
        return None
    return reductions[0], found


def schedule_window(rule, func: tirx.PrimFunc, target, kind: str, schedule) -> s_tir.Schedule | None:
    """`rule`'s schedule of `func` when its one reduction is a window block of `kind`: ``schedule(sch,
    block, info, target)`` applied to it; None where there is no such block or a primitive refuses (then
    the next rule is tried)."""
    sch = rule.schedule_of(func, target)
    if sch is None:
        return None
    found = find(sch, kind)
    if found is None:
        return None
    block, info = found
    try:
        schedule(sch, block, info, target)
    except Exception as err:  # pylint: disable=broad-except  # a primitive refused: not ours
        logger.debug("cpu %s rule gave up on %s: %s", type(rule).__name__, func.attrs.get("global_symbol", "?"), err)
        return None
    return sch


def input_stage(sch: s_tir.Schedule, block, data: int):
    """The block producing the window's data (TOPI's ``pad_temp``), its own producers inlined into
    it; None when the data is a function parameter. An identity copy (a convolution without
    padding) is inlined into the block itself and None returned."""
    source = sch.get(block).reads[data].source
    producer = next((p for p in sch.get_producers(block) if sch.get(p).writes[0].source.same_as(source)), None)
    if producer is None:
        return None
    U.inline_producers(sch, producer)
    stmt = sch.get(producer)
    if isinstance(stmt.body, tirx.BufferStore) and _is_copy(stmt):
        try:
            sch.compute_inline(producer)
            return None
        except Exception:  # pylint: disable=broad-except  # keep it as a stage
            pass
    return producer


def _is_copy(stmt) -> bool:
    value = stmt.body.value
    from tvm.ir.expr import TensorLoad  # TVM 0.27: tirx.BufferLoad is a factory function

    return isinstance(value, TensorLoad) and len(stmt.reads) == 1


def output_tile(sch: s_tir.Schedule, block, tile, vec: int):
    """Accumulate ``block`` in a tile-sized buffer written back after each ``tile`` iteration.

    The element-wise epilogue (bias, activation, residual add) is inlined into the write-back,
    which is computed per tile and vectorised; the block's own output becomes a buffer of the
    tile's size (a stack array under 1 KiB, else a workspace; LLVM keeps a tile of a few vector
    registers in registers across the reduction either way).

    An epilogue that broadcasts the output over a larger tensor (a squeeze-and-excitation's scale times the
    feature map: a 1 x 1 output, ``out[n, 0, 0, c] * x[n, h, w, c]``) is not computed per tile, where each
    tile would walk the whole map in slices of its channels: it is a loop nest of its own after the
    convolution, parallel over the map's pixels and vectorised over its contiguous channels.
    """
    consumers = U.collect_consumers(sch, block)
    if not consumers:  # the block writes the function's output: accumulate in a cache of it
        consumers = [sch.cache_write(block, 0, "global")]
    for blk in consumers:
        if not U.writes_param(sch, blk):
            try:
                sch.compute_inline(blk)
            except Exception:  # pylint: disable=broad-except  # keep it as its own stage
                pass
    size = elements(sch.get(block).writes[0].source.shape[1:])
    for blk in U.collect_consumers(sch, block):
        if size is not None and (elements(sch.get(blk).writes[0].source.shape[1:]) or 0) > size:
            loops = sch.get_loops(blk)
            sch.parallel(sch.fuse(*loops[:-1]))
            U.vectorize_inner(sch, loops[-1], vec)
            continue
        sch.reverse_compute_at(blk, tile, preserve_unit_loops=True)
        U.vectorize_inner(sch, sch.get_loops(blk)[-1], vec)
    sch.set_scope(block, 0, "global")


def elements(shape, symbolic: int | None = None) -> int | None:
    """Elements of ``shape``, a symbolic extent counted as ``symbolic`` (None: the count is None)."""
    out = 1
    for dim in shape:
        value = U.static(dim)
        if value is None and symbolic is None:
            return None
        out *= symbolic if value is None else value
    return out


def divisor_at_most(extent: int, limit: int) -> int:
    """The largest divisor of ``extent`` that is <= ``limit`` (at least 1)."""
    return next(d for d in range(max(1, min(limit, extent)), 0, -1) if extent % d == 0)


# independent accumulators that keep the FMA unit busy: its latency (4-5 cycles) times the FMAs it starts a cycle
MIN_ACCUMULATORS = 6


def vector_registers(vector_bits: int) -> int:
    """The vector registers of an x86 target: 32 with AVX-512, else 16."""
    return 32 if vector_bits >= 512 else 16


def pixel_tile(width: int, vectors: int, vector_bits: int) -> int:
    """Output pixels per register tile: 7 where the row width allows it (the widths of ImageNet
    models: 112, 56, 28, 14, 7), else the largest divisor of the width that leaves the tile, its
    ``vectors`` weight vectors and a broadcast in the vector registers (`vector_registers`)."""
    budget = max(1, (vector_registers(vector_bits) - vectors - 2) // vectors)
    return 7 if width % 7 == 0 and budget >= 7 else divisor_at_most(width, budget)


def reduction_unroll(channels: int, vector_bits: int, limit: int) -> int:
    """Input channels per step of a convolution's reduction loop, unrolled (a divisor of ``channels``): with 32
    vector registers (AVX-512), up to ``limit``, so that the tile's FMAs of several input channels are in flight between
    two loop branches; with 16, 1 (its tiles keep the loop as it is)."""
    return divisor_at_most(channels, limit) if vector_registers(vector_bits) >= 32 else 1


def pads_in_place(channels: int, lanes: int, few_fmas: bool, vector_bits: int) -> bool:
    """Whether a convolution reads its padding in place (a bounds check per broadcast) rather than from a padded
    copy. With 16 vector registers: where it has at least a vector of input channels, or where each input value
    feeds few FMAs (``few_fmas``). With 32, only there: a bounds check inside the unrolled reduction
    (`reduction_unroll`) keeps it from being unrolled, and the copy is cheaper (``docs/results.md``)."""
    if vector_registers(vector_bits) >= 32:
        return few_fmas
    return channels >= lanes or few_fmas


def row_split(width: int, vectors: int, vector_bits: int) -> int:
    """Pixels of the first of two register tiles a row of ``width`` pixels is computed in (the rest the
    second), or 0 where tiles of `pixel_tile` pixels divide the row. With 16 vector registers, where no
    divisor of the row from 2 pixels up fits ``vectors`` vectors, the row's first half (rounded up) when it
    fits: a 7-pixel row as 4 + 3 pixels of two vectors (8 and 6 accumulators) instead of 7 tiles of 1
    pixel. With 32 registers: 0 (7 x 2 fits)."""
    registers = vector_registers(vector_bits)
    budget = (registers - vectors - 2) // vectors
    if registers >= 32 or width <= budget or any(width % d == 0 for d in range(2, budget + 1)):
        return 0
    first = -(-width // 2)
    return first if first <= budget else 0


def tile_vectors(width: int, blocks: int, vector_bits: int, max_vectors: int, split_rows: bool = True) -> int:
    """Output-channel vectors per register tile of a convolution with ``width``-pixel rows and ``blocks``
    vectors of output channels (a divisor of ``blocks``).

    With 32 vector registers (AVX-512): two, for 7 x 2 accumulators. With 16 (AVX2) the count, up to
    ``max_vectors``, whose tiles (`pixel_tile` pixels R, or the two of `row_split`; V vectors) do the most
    FMAs per value they load (R x V FMAs for R broadcasts and V weight vectors), scaled down where a tile
    has fewer than `MIN_ACCUMULATORS` (then each FMA waits for the last one into its accumulator); on a tie
    the more vectors (fewer broadcasts). 2 pixels x 4 vectors on even rows, 4 + 3 pixels x 2 vectors on
    7-pixel rows (``docs/results.md``, CPU convolutional nets). ``split_rows`` False: for a schedule without
    `row_split`'s two tiles (7 x 1 on 7-pixel rows)."""
    if vector_registers(vector_bits) >= 32:
        return divisor_at_most(blocks, 2)

    def score(vectors: int) -> tuple[float, int]:
        split = row_split(width, vectors, vector_bits) if split_rows else 0
        tiles = (split, width - split) if split else (pixel_tile(width, vectors, vector_bits),)
        loads = [min(1.0, p * vectors / MIN_ACCUMULATORS) * p * vectors / (p + vectors) for p in tiles]
        return sum(p * x for p, x in zip(tiles, loads)) / sum(tiles), vectors

    return max((v for v in range(1, max_vectors + 1) if blocks % v == 0), key=score)


def channel_tile(channels: int, lanes: int, max_vectors: int) -> tuple[int, int]:
    """(vectors, lanes per vector) for ``channels``: the widest power-of-two vector dividing it,
    then as many vectors (dividing what is left) as allowed."""
    width = U.largest_pow2_divisor(channels, lanes)
    return divisor_at_most(channels // width, max_vectors), width
