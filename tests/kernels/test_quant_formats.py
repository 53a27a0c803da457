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


def test_int8_activation_reference_is_the_exact_integer_product_of_its_roundings():
    """quantize_activation_pieces rounds each piece of 16 to [-127, 127] with its absmax at +-127 (a zero piece stays
    zero); q4_gemv_int8_reference is then x's int8 values times (q - 8), scaled: it equals the float64 product of the
    rounded x and the dequantized weight, and is within a few steps of x's rounding of the float32 product."""
    rng = np.random.default_rng(3)
    k, n = 256, 24
    w = rng.standard_normal((n, k)).astype(np.float32) / k**0.5
    parts = qf.quantize(qf.own_format(4, 32), w)
    packed = qf.pack_q4_gpu(parts["qweight"])
    x = rng.standard_normal((2, k)).astype(np.float16)
    x[1, :16] = 0
    xq, xs = qf.quantize_activation_pieces(x)
    assert xq.dtype == np.int8 and xs.shape == (2, k // 16) and xs[1, 0] == 0 and not xq[1, :16].any()
    assert np.abs(xq).max(axis=-1).tolist() == [127, 127]
    assert np.all(np.abs(xq.reshape(2, -1, 16)).max(axis=-1)[xs > 0] == 127)
    rounded = (xq.astype(np.float64).reshape(2, -1, 16) * xs[..., None]).reshape(2, k)
    weight = qf.dequantize_q4_gpu(packed, parts["scale"]).astype(np.float64)
    got = qf.q4_gemv_int8_reference(x, packed, parts["scale"])
    np.testing.assert_allclose(got, rounded @ weight.T, rtol=1e-12, atol=1e-12)
    exact = x.astype(np.float64) @ weight.T
    step = np.repeat(xs, 16, axis=1).astype(np.float64) / 2  # half a step of x's rounding per value
    assert np.all(np.abs(got - exact) <= step @ np.abs(weight.T) + 1e-9)
    assert np.abs(got - exact).max() > 0  # the rounding is there
