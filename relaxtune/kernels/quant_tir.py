"""Compute definitions (TE) of the kernels that read quantized weights as they are stored
(`quant_formats`): the projection ``y = x W^T (+ b)`` with W dequantized inside the kernel, and the
embedding lookup that dequantizes only the rows it gathers. The weights are never materialised in float32.

`linear` is two blocks: ``dequantize`` (spatial, W[j, k] from the parts, annotated with
``ir_attrs.DEQUANTIZE_ATTR`` = the format's name) and ``matmul`` (``y[..., j] += x[..., k] * W[j, k]``,
accumulated in float32), plus ``bias`` / ``cast`` when asked; `linear` reads the float16 scales through
float32 stages (`float32_scales`). In that form every scheduler handles it: the rules inline ``dequantize``
into the vector dot products of the GEMV (`schedules/rules/cpu_quant_gemv.py`, which converts a tile's
scales at once) or into the packed weight panels of the matmul (`cpu_matmul.py`), MetaSchedule's
AutoInline into its tiles. A Relax caller emits them with
``relax.frontend.nn.op.tensor_expr_op`` (or ``BlockBuilder.emit_te``); leading dimensions may be symbolic.

`take_rows` is one spatial block, ``out[..., k] = W[ids[...], k]``, with the dequantization of that row inline.
"""

from __future__ import annotations

from tvm import te, tirx

from ..ir_attrs import DEQUANTIZE_ATTR, DEQUANTIZE_SCALE_ATTR
from .quant_formats import CHUNK, WeightFormat


def weight_value(fmt: WeightFormat, parts: dict[str, te.Tensor], j, k):
    """Weight (j, k) in float32, the arithmetic of `quant_formats.dequantize`."""
    q = parts["qweight"]
    if fmt.bits == 16:
        return q[j, k].astype("float32")
    g = k // fmt.group
    scale = parts["scale"][j, g].astype("float32")
    if fmt.bits == 8:
        return q[j, k].astype("float32") * scale
    half = CHUNK // 2
    byte = q[j, k // CHUNK * half + k % half]
    nibble = (byte >> (k % CHUNK // half * 4).astype("uint8")) & tirx.const(15, "uint8")
    if fmt.has_min:
        return scale * nibble.astype("float32") + parts["min"][j, g].astype("float32")
    return (nibble.astype("int32") - fmt.offset).astype("float32") * scale


def dequantize(fmt: WeightFormat, parts: dict[str, te.Tensor], cols: int, name: str = "dequantize") -> te.Tensor:
    """W (N, cols) float32 as one annotated spatial block."""
    rows = parts["qweight"].shape[0]
    return te.compute(
        (rows, cols), lambda j, k: weight_value(fmt, parts, j, k), name=name, attrs={DEQUANTIZE_ATTR: fmt.name}
    )


def float32_scales(parts: dict[str, te.Tensor]) -> dict[str, te.Tensor]:
    """`parts` with the float16 ``scale`` / ``min`` read through float32 stages (annotated
    ``DEQUANTIZE_SCALE_ATTR``): the same values, converted where a rule chooses (a tile's at once)."""

    def to_float32(name: str) -> te.Tensor:
        part = parts[name]
        return te.compute(
            part.shape,
            lambda j, g: part[j, g].astype("float32"),
            name=f"dequantize_{name}",
            attrs={DEQUANTIZE_SCALE_ATTR: 1},
        )

    return {name: to_float32(name) if name in ("scale", "min") else part for name, part in parts.items()}


def linear(
    fmt: WeightFormat,
    x: te.Tensor,
    parts: dict[str, te.Tensor],
    bias: te.Tensor | None = None,
    out_dtype: str | None = None,
) -> te.Tensor:
    """``x (..., K) @ W(N, K)^T (+ bias)`` with W dequantized in the kernel; float32 accumulation, the
    result in `out_dtype` (default: x's dtype)."""
    cols = x.shape[-1]
    w = dequantize(fmt, float32_scales(parts), cols)
    k = te.reduce_axis((0, cols), "k")
    lead = tuple(x.shape[:-1])

    def product(*idx):
        value = x[(*idx[:-1], k)]
        value = value if value.dtype == "float32" else value.astype("float32")
        return te.sum(value * w[idx[-1], k], axis=k)

    y = te.compute((*lead, w.shape[0]), product, name="matmul")
    if bias is not None:
        y = te.compute(y.shape, lambda *i: y[i] + bias[i[-1]].astype("float32"), name="bias")
    out_dtype = out_dtype or x.dtype
    if out_dtype != "float32":
        y = te.compute(y.shape, lambda *i: y[i].astype(out_dtype), name="cast")
    return y


def take_rows(fmt: WeightFormat, ids: te.Tensor, parts: dict[str, te.Tensor], cols: int, out_dtype: str) -> te.Tensor:
    """``out[..., k] = W[ids[...], k]`` (an embedding lookup), each gathered row dequantized in place."""

    def value(*idx):
        row = ids[idx[:-1]]
        out = weight_value(fmt, parts, row, idx[-1])
        return out if out_dtype == "float32" else out.astype(out_dtype)

    return te.compute((*ids.shape, cols), value, name="take_rows", attrs={DEQUANTIZE_ATTR: fmt.name})
