"""Weight formats (relaxtune/kernels/quant_formats.py): GGUF blocks split into parts and dequantized bit for bit
as `gguf.quants.dequantize` does, relaxtune's own rounding identical to ggml's, bad values refused."""

from __future__ import annotations

import numpy as np
import pytest

from relaxtune.errors import UserError
from relaxtune.kernels import quant_formats as qf

gguf = pytest.importorskip("gguf")

ROWS, COLS = 6, 256


def gguf_blocks(kind: str, values: np.ndarray) -> np.ndarray:
    t = getattr(gguf.GGMLQuantizationType, kind)
    return values.astype(np.float16) if kind == "F16" else gguf.quants.quantize(values, t)


def gguf_dequantized(kind: str, raw: np.ndarray) -> np.ndarray:
    if kind == "F16":
        return raw.astype(np.float32)
    return gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).reshape(ROWS, COLS)


@pytest.fixture
def values():
    rng = np.random.default_rng(0)
    out = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    out[0, :32] = 0.0  # an all-zero group: scale 0
    out[1, 40] = 25.0  # an outlier: its group's scale
    return out


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "F16"])
def test_gguf_parts_dequantize_bit_for_bit(kind, values):
    raw = gguf_blocks(kind, values)
    fmt = qf.GGUF[kind]
    parts = qf.from_gguf(kind, raw, ROWS, COLS)
    assert {k: (v.shape, str(v.dtype)) for k, v in parts.items()} == fmt.shapes(ROWS, COLS)
    assert sum(v.nbytes for v in parts.values()) == raw.nbytes == fmt.nbytes(ROWS, COLS)  # the same bytes
    got, want = qf.dequantize(fmt, parts), gguf_dequantized(kind, raw)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize(("bits", "kind"), [(4, "Q4_0"), (8, "Q8_0")])
def test_own_quantization_at_group_32_is_ggml_bit_for_bit(bits, kind, values):
    ours = qf.quantize(qf.own_format(bits, 32), values)
    theirs = qf.from_gguf(kind, gguf_blocks(kind, values), ROWS, COLS)
    assert ours.keys() == theirs.keys()
    for part in ours:
        assert np.array_equal(ours[part], theirs[part]), part


@pytest.mark.parametrize("bits", [4, 8])
def test_group_128_round_trip_error_is_within_a_step(bits, values):
    fmt = qf.own_format(bits, 128)
    parts = qf.quantize(fmt, values)
    assert parts["scale"].shape == (ROWS, COLS // 128)
    step = np.repeat(np.abs(parts["scale"].astype(np.float32)), 128, axis=1)
    err = np.abs(qf.dequantize(fmt, parts) - values)
    # half a step (4-bit: a whole one, +8 steps is clipped to +7 as ggml clips it), plus the fp16 rounding of
    # the scale times the largest integer
    largest = 8 if bits == 4 else 127
    assert np.all(err <= (1.0 if bits == 4 else 0.5) * step + largest * step * 2.0**-10 + 1e-6)
    assert err.max() > 0
    assert qf.format_named(fmt.name) == fmt


def test_refusals():
    with pytest.raises(UserError, match=r"--group-size 64 is not supported: use one of 32, 128"):
        qf.own_format(4, 64)
    with pytest.raises(UserError, match=r"has 48 input features: format q4_1 needs a multiple of 32"):
        qf.GGUF["Q4_1"].shapes(4, 48)
    with pytest.raises(ValueError, match="unknown weight format"):
        qf.format_named("q5_k")
