"""Shared analysis of the quantized kernels' rules: which contraction reads a weight through a
``dequantize`` block (`relaxtune/kernels/quant_tir.py`), and that weight's format.

A kernel qualifies when it has one contraction (`analysis.main_contraction`) whose weight operand, the
one indexed by the output column, is produced by a block annotated ``ir_attrs.DEQUANTIZE_ATTR``; the
annotation names the format (`kernels/quant_formats.py`), which says how the integers are packed
along the reduction axis. Rules import this module, never each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir

from ...ir_attrs import DEQUANTIZE_ATTR
from ...kernels.quant_formats import CHUNK, WeightFormat, format_named
from .analysis import detect, main_contraction


@dataclass(frozen=True)
class QuantContraction:
    """The contraction block `main` of a kernel, its dequantize block and the weight's format."""

    main: object  # SBlockRV
    dequantize: object  # SBlockRV
    fmt: WeightFormat

    @property
    def chunk(self) -> int:
        """Weights along K that one load of packed integers serves: a 4-bit chunk is 32 (two halves of
        16 in one 16-byte load), any other format 1."""
        return CHUNK if self.fmt.bits == 4 else 1


def dequantize_format(sch: s_tir.Schedule, block) -> WeightFormat | None:
    """The weight format a block is annotated with, or None for any other block."""
    name = sch.get(block).annotations.get(DEQUANTIZE_ATTR)
    if name is None:
        return None
    try:
        return format_named(str(name))
    except ValueError:  # a format this version does not know: not ours to schedule
        return None


def quant_contraction(sch: s_tir.Schedule) -> QuantContraction | None:
    """The kernel's quantized contraction (see the module docstring), or None."""
    main = main_contraction(sch)
    if main is None:
        return None
    kinds, _, bi = detect(sch.get(main))
    weight = sch.get(main).reads[bi].source
    for prod in sch.get_producers(main):
        fmt = dequantize_format(sch, prod)
        if fmt is not None and sch.get(prod).writes[0].source.same_as(weight):
            return QuantContraction(main, prod, fmt)
    return None
