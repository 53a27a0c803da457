"""Modules whose weights stay quantized: `QuantLinear` (a projection) and `QuantEmbedding` (the token
embedding, and the tied output projection over the same blocks), each one kernel that dequantizes the
weight as it reads it (`relaxtune/kernels/quant_tir.py`); and `weight_format`, which picks each weight's
format from the source and `--quantize`.

A module's parameters are its weight's parts (`kernels/quant_formats.py`: ``qweight``, ``scale``,
``min``) and its `sources` map each part to a `Blocks` recipe, which `weights.load_params` reads.
"""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ..config import QuantizeConfig
from ..errors import UserError
from ..kernels import quant_tir
from ..kernels.quant_formats import GGUF, WeightFormat, own_format
from .weights import Blocks


def _parameters(module: nn.Module, fmt: WeightFormat, rows: int, cols: int, sources: tuple[str, ...]) -> None:
    for part, (shape, dtype) in fmt.shapes(rows, cols).items():
        setattr(module, part, nn.Parameter(shape, dtype))
    module.sources = {part: Blocks(sources, fmt, part) for part in fmt.part_names}


def _parts(module: nn.Module) -> list[nn.Tensor]:
    return [getattr(module, part) for part in module.fmt.part_names]


class QuantLinear(nn.Module):
    """``y = x W^T (+ b)`` with W (out, in) in `fmt`, rows concatenated from the file's tensors `sources`."""

    def __init__(self, in_features: int, out_features: int, sources: tuple[str, ...], fmt: WeightFormat, bias=False):
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        _parameters(self, fmt, out_features, in_features, tuple(f"{s}.weight" for s in sources))
        self.bias = nn.Parameter((out_features,), "float32") if bias else None
        if bias:
            self.sources["bias"] = tuple(f"{s}.bias" for s in sources)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        fmt, count = self.fmt, len(self.fmt.part_names)

        def compute(x, *rest):
            bias = rest[count] if len(rest) > count else None
            return quant_tir.linear(fmt, x, dict(zip(fmt.part_names, rest[:count])), bias)

        args = [x, *_parts(self)] + ([self.bias] if self.bias is not None else [])
        return op.tensor_expr_op(compute, f"dequantize_linear_{fmt.name}", args)


class QuantEmbedding(nn.Module):
    """A (vocab, hidden) table in `fmt`: `forward` looks rows up, `project` is the tied output projection."""

    def __init__(self, vocab: int, hidden: int, source: str, fmt: WeightFormat, dtype: str = "float32"):
        self.vocab, self.hidden, self.fmt, self.dtype = vocab, hidden, fmt, dtype
        _parameters(self, fmt, vocab, hidden, (source,))

    def forward(self, ids: nn.Tensor) -> nn.Tensor:
        fmt, hidden, dtype = self.fmt, self.hidden, self.dtype

        def compute(ids, *parts):
            return quant_tir.take_rows(fmt, ids, dict(zip(fmt.part_names, parts)), hidden, dtype)

        return op.tensor_expr_op(compute, f"dequantize_take_{fmt.name}", [ids, *_parts(self)])

    def project(self, x: nn.Tensor) -> nn.Tensor:
        fmt = self.fmt

        def compute(x, *parts):
            return quant_tir.linear(fmt, x, dict(zip(fmt.part_names, parts)))

        return op.tensor_expr_op(compute, f"dequantize_linear_{fmt.name}", [x, *_parts(self)])


def weight_format(source, tensors: tuple[str, ...], quantize: QuantizeConfig) -> WeightFormat | None:
    """The format the weight made of `tensors` (rows concatenated) is kept in; None: the model's float type.

    ``auto`` keeps a GGUF file's own block format (all the tensors must share it; F32 stays float32) and
    leaves other sources in float32; ``f32`` / ``f16`` dequantize everything; the own modes quantize every
    weight."""
    if quantize.mode in ("f32", "f16"):
        return None
    if quantize.bits is not None:
        return own_format(quantize.bits, quantize.group_size)
    kind_of = getattr(source, "quant_type", None)
    if kind_of is None:
        return None
    kinds = {name: kind_of(name) for name in tensors}
    found = sorted(set(kinds.values()))
    if found == ["F32"]:
        return None
    unsupported = [k for k in found if k not in GGUF]
    if unsupported:
        name = next(n for n, k in kinds.items() if k == unsupported[0])
        raise UserError(
            f"tensor {name} is stored as {unsupported[0]}: the kernels read {', '.join(GGUF)} as they are "
            "(--quantize f32 dequantizes it, q4f32 / q8f32 requantize it)"
        )
    if len(found) > 1:
        raise UserError(
            f"tensors {', '.join(tensors)} form one projection but are stored as {' and '.join(found)}: "
            "one format is needed (--quantize f32, q4f32 or q8f32 stores them alike)"
        )
    return GGUF[found[0]]
