"""Weight formats the fused kernels read: GGUF's Q4_0, Q4_1, Q8_0 and F16 blocks, and relaxtune's own
weight-only group quantization (`--quantize q4f32 | q8f32 | q4f16`, groups of 32 or 128).

A weight W (N out features, K in features) in format `f` is stored as `parts`, each a 2-D array with one row
per output feature (so q/k/v or gate/up rows concatenate, and llama.cpp's q/k row order is undone, row-wise):

- ``qweight``: the integers. 4-bit: (N, K / 2) uint8, in GGUF's order within every 32 weights: byte i holds
  weight i in its low nibble and weight i + 16 in its high one. 8-bit: (N, K) int8. F16: (N, K) float16
  (the weight itself).
- ``scale``: (N, K / group) float16, one per group (none for F16).
- ``min``: (N, K / group) float16, Q4_1 only.

The value of weight (j, k), g = k // group, q its integer, computed in float32 exactly as
`gguf.quants.dequantize` computes it (the tests compare bit for bit):

- 4-bit with an offset (Q4_0, q4 groups): ``float(q - 8) * scale[j, g]``;
- Q4_1: ``scale[j, g] * float(q) + min[j, g]``;
- 8-bit (Q8_0, q8 groups): ``float(q) * scale[j, g]``;
- F16: ``float(q)``.

GGUF blocks are split into these parts once, at compile time (`from_gguf`): the same bytes, so an artifact's
weights are as large as the file's. `quantize` is ggml's own rounding (Q4_0 / Q8_0) applied per group, so
q4 and q8 at group 32 give exactly the blocks llama.cpp would write.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import GROUP_SIZES
from ..errors import UserError

CHUNK = 32  # 4-bit weights are packed per 32: byte i holds weights i and i + 16


@dataclass(frozen=True)
class WeightFormat:
    """How one weight is stored (see the module docstring)."""

    name: str
    bits: int  # 4, 8, or 16 (float16, no scale)
    group: int  # weights per scale; 0 without one
    offset: int = 0  # subtracted from a 4-bit integer before scaling (symmetric 4-bit: 8)
    has_min: bool = False  # Q4_1: w = scale * q + min

    @property
    def part_names(self) -> tuple[str, ...]:
        return ("qweight",) + (("scale",) if self.group else ()) + (("min",) if self.has_min else ())

    def shapes(self, rows: int, cols: int) -> dict[str, tuple[tuple[int, int], str]]:
        """Part name -> (shape, dtype) for a (rows, cols) weight."""
        self.check_columns(cols, "weight")
        if self.bits == 4:
            out = {"qweight": ((rows, cols // 2), "uint8")}
        else:
            out = {"qweight": ((rows, cols), "int8" if self.bits == 8 else "float16")}
        if self.group:
            out["scale"] = ((rows, cols // self.group), "float16")
        if self.has_min:
            out["min"] = ((rows, cols // self.group), "float16")
        return out

    def check_columns(self, cols: int, what: str) -> None:
        unit = max(self.group, CHUNK if self.bits == 4 else 1)
        if cols % unit:
            raise UserError(f"{what} has {cols} input features: format {self.name} needs a multiple of {unit}")

    def nbytes(self, rows: int, cols: int) -> int:
        return sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in self.shapes(rows, cols).values())


GGUF = {
    "Q4_0": WeightFormat("q4_0", 4, 32, offset=8),
    "Q4_1": WeightFormat("q4_1", 4, 32, has_min=True),
    "Q8_0": WeightFormat("q8_0", 8, 32),
    "F16": WeightFormat("f16", 16, 0),
}


def own_format(bits: int, group: int) -> WeightFormat:
    """relaxtune's symmetric group format: 4-bit (offset 8, ggml's Q4_0 rounding) or 8-bit (Q8_0's)."""
    if group not in GROUP_SIZES:
        raise UserError(f"--group-size {group} is not supported: use one of {', '.join(map(str, GROUP_SIZES))}")
    return WeightFormat(f"q{bits}g{group}", bits, group, offset=8 if bits == 4 else 0)


def format_named(name: str) -> WeightFormat:
    """The format of a `WeightFormat.name` (what kernels record in their dequantize block)."""
    for fmt in GGUF.values():
        if fmt.name == name:
            return fmt
    if name.startswith("q") and "g" in name:
        bits, group = name[1:].split("g")
        return own_format(int(bits), int(group))
    raise ValueError(f"unknown weight format {name!r}")


def from_gguf(kind: str, data: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """The parts of a GGUF tensor of type `kind` whose stored bytes are `data` (the reader's array)."""
    fmt = GGUF[kind]
    raw = np.ascontiguousarray(data).view(np.uint8)
    if fmt.bits == 16:
        return {"qweight": raw.view(np.float16).reshape(rows, cols)}
    blocks = raw.reshape(rows, cols // 32, -1)
    scale = blocks[..., 0:2].copy().view(np.float16).reshape(rows, -1)
    if fmt.has_min:
        mins = blocks[..., 2:4].copy().view(np.float16).reshape(rows, -1)
        return {"qweight": blocks[..., 4:].reshape(rows, -1).copy(), "scale": scale, "min": mins}
    qs = blocks[..., 2:].reshape(rows, -1).copy()
    return {"qweight": qs.view(np.int8) if fmt.bits == 8 else qs, "scale": scale}


def _unpack4(qweight: np.ndarray) -> np.ndarray:
    rows = qweight.shape[0]
    chunks = qweight.reshape(rows, -1, 16)
    return np.stack([chunks & 0x0F, chunks >> 4], axis=2).reshape(rows, -1)


def _pack4(values: np.ndarray) -> np.ndarray:
    rows = values.shape[0]
    chunks = values.astype(np.uint8).reshape(rows, -1, 2, 16)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << np.uint8(4))).reshape(rows, -1)


def dequantize(fmt: WeightFormat, parts: dict[str, np.ndarray]) -> np.ndarray:
    """float32 (N, K) of a weight stored as `parts` (the kernels' arithmetic, in numpy)."""
    q = parts["qweight"]
    if fmt.bits == 16:
        return q.astype(np.float32)
    ints = _unpack4(q) if fmt.bits == 4 else q
    scale = np.repeat(parts["scale"].astype(np.float32), fmt.group, axis=1)
    if fmt.has_min:
        return scale * ints.astype(np.float32) + np.repeat(parts["min"].astype(np.float32), fmt.group, axis=1)
    return (ints.astype(np.int8) - np.int8(fmt.offset)).astype(np.float32) * scale


def quantize(fmt: WeightFormat, values: np.ndarray) -> dict[str, np.ndarray]:
    """`values` (N, K) float in `fmt` (symmetric 4- or 8-bit groups, or F16), rounded as ggml rounds."""
    values = np.asarray(values, dtype=np.float32)
    rows, cols = values.shape
    fmt.check_columns(cols, "weight")
    if fmt.bits == 16:
        return {"qweight": values.astype(np.float16)}
    if fmt.has_min:
        raise ValueError(f"{fmt.name}: relaxtune quantizes to symmetric formats only")
    groups = values.reshape(rows, cols // fmt.group, fmt.group)
    if fmt.bits == 4:  # ggml's Q4_0: the value of largest magnitude maps to -8
        top = np.take_along_axis(groups, np.abs(groups).argmax(axis=-1)[..., None], axis=-1)
        d = top / -8
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, 0, 1 / d)
        q = np.trunc(groups * inv + np.float32(8.5)).astype(np.float32).clip(0, 15).astype(np.uint8)
        return {"qweight": _pack4(q.reshape(rows, cols)), "scale": d.astype(np.float16).reshape(rows, -1)}
    d = np.abs(groups).max(axis=-1, keepdims=True) / 127  # ggml's Q8_0
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, 0, 1 / d)
    scaled = np.abs(groups * inv)
    floor = np.floor(scaled)
    q = (np.sign(groups * inv) * (floor + np.floor(2 * (scaled - floor)))).astype(np.int8)  # C's roundf, as ggml
    return {"qweight": q.reshape(rows, cols), "scale": d.astype(np.float16).reshape(rows, -1)}


# ---- the GPU layout of 4-bit weights with an offset of 8 (Q4_0, q4 groups): what the CUDA decode GEMV reads
# (relaxtune/kernels/qgemv.cu). Per output row, uint32 words of 8 consecutive weights k = 8j .. 8j + 7: weight
# 8j + 2i in bits 4i .. 4i + 3 and weight 8j + 2i + 1 in bits 16 + 4i .. 16 + 4i + 3 (i = 0..3), so that
# `(word >> 8 * (i // 2)) & (0x000F000F << 4 * (i % 2))` holds the pair (2i, 2i + 1) as the low mantissa bits of a
# half2, next to x's pair. A 16-byte load holds 32 weights. Repacked once from `qweight` (at load:
# relax_passes/pack_quant_weights_cuda.py); the scales stay as they are.
GPU_WORD = 8  # weights per uint32 word of the GPU layout
_GPU_SHIFTS = np.array([4 * (e // 2) + 16 * (e % 2) for e in range(GPU_WORD)], dtype=np.uint32)


def is_gpu_q4(fmt: WeightFormat) -> bool:
    """Whether `fmt` is a 4-bit format the GPU layout takes: an offset of 8, no min (Q4_0, q4g32, q4g128)."""
    return fmt.bits == 4 and fmt.offset == 8 and not fmt.has_min


def pack_q4_gpu(qweight: np.ndarray) -> np.ndarray:
    """(N, K / 8) uint32 in the GPU layout (above) of a 4-bit `qweight` (N, K / 2) in GGUF's order."""
    rows = qweight.shape[0]
    nibbles = _unpack4(qweight).astype(np.uint32).reshape(rows, -1, GPU_WORD)
    return np.bitwise_or.reduce(nibbles << _GPU_SHIFTS, axis=-1).astype(np.uint32)


def unpack_q4_gpu(packed: np.ndarray) -> np.ndarray:
    """(N, K) uint8 integers 0..15 of a weight in the GPU layout."""
    rows = packed.shape[0]
    words = np.asarray(packed, dtype=np.uint32)[..., None]
    return ((words >> _GPU_SHIFTS) & np.uint32(15)).astype(np.uint8).reshape(rows, -1)


def dequantize_q4_gpu(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 (N, K) of a weight in the GPU layout with its (N, K / group) float16 scales: ``(q - 8) * scale``,
    bit for bit `dequantize` of the same weight in GGUF's order."""
    ints = unpack_q4_gpu(packed)
    group = ints.shape[1] // scale.shape[1]
    return (ints.astype(np.int8) - np.int8(8)).astype(np.float32) * np.repeat(scale.astype(np.float32), group, axis=1)


ACTIVATION_PIECE = 16  # x values per int8 scale in the GPU's int8-activation GEMV (qgemv_stream.cu's i8 families)


def quantize_activation_pieces(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 values (..., K), float32 scales (..., K / 16)) of float16 `x` as the int8-activation GEMV rounds it:
    per piece of 16, ``rint(x * (127 / absmax))`` in float32 (half to even), the scale ``absmax / 127``."""
    pieces = np.asarray(x, dtype=np.float16).astype(np.float32).reshape(*x.shape[:-1], -1, ACTIVATION_PIECE)
    amax = np.abs(pieces).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(pieces * inv).astype(np.int8)
    return q.reshape(x.shape), (amax[..., 0] / np.float32(127)).astype(np.float32)


def q4_gemv_int8_reference(x: np.ndarray, packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float64 (rows, N) of `x` (rows, K) float16 times a GPU-layout 4-bit weight as the int8-activation kernel
    computes it: x rounded to int8 per piece of 16 (`quantize_activation_pieces`), each piece's integer dot product
    with (q - 8) exact, times the piece's and the group's scales; only the kernel's float32 sum order differs."""
    xq, xs = quantize_activation_pieces(x)
    ints = unpack_q4_gpu(packed).astype(np.int64) - 8  # (N, K)
    rows, k = xq.shape
    n, pieces = ints.shape[0], k // ACTIVATION_PIECE
    dots = np.einsum("npe,rpe->rnp", ints.reshape(n, pieces, -1), xq.astype(np.int64).reshape(rows, pieces, -1))
    group = k // scale.shape[1]
    w_scale = np.repeat(scale.astype(np.float64), group // ACTIVATION_PIECE, axis=1)  # (N, pieces)
    return np.einsum("rnp,np,rp->rn", dots.astype(np.float64), w_scale, xs.astype(np.float64))
