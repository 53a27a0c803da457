"""The int8 decode GEMV (relaxtune/kernels/quant_dot_tir.py) built and run: against the same arithmetic in
numpy (activations quantized per 32 as ggml's Q8_1, integer dot products per block) to float32 rounding, and
against dequantize-then-matmul in float32 within the int8 activations' error, with the host's instructions
(VNNI's vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd for 4-bit weights). Skipped where the host has neither."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.target import codegen

from relaxtune.kernels import quant_dot_tir
from relaxtune.kernels import quant_formats as qf

gguf = pytest.importorskip("gguf")

FORMATS = ["q4_0", "q4_1", "q8_0", "q4g32", "q8g32"]


def target():
    return tvm.target.Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": 2})


FORM = quant_dot_tir.dot_form(target())  # "vnni", "avx2" (4-bit weights only) or None
pytestmark = pytest.mark.skipif(FORM is None, reason="the host has neither VNNI nor AVX2")


def _needs_form(fmt) -> None:
    if FORM == "avx2" and fmt.bits != 4:
        pytest.skip("AVX2's vpmaddubsw takes 4-bit weights only (8-bit ones would saturate its int16 sums)")


def parts_for(name: str, rows: int, cols: int, seed: int = 0) -> dict[str, np.ndarray]:
    fmt = qf.format_named(name)
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    kind = next((k for k, f in qf.GGUF.items() if f == fmt), None)
    if kind is None:
        return qf.quantize(fmt, values)
    raw = gguf.quants.quantize(values, getattr(gguf.GGMLQuantizationType, kind))
    return qf.from_gguf(kind, raw, rows, cols)


def int8_reference(fmt, parts, x: np.ndarray) -> np.ndarray:
    """The kernel's arithmetic in numpy (float64 sums of exact integer dot products)."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    xq = np.round(blocks * inv[:, None]).astype(np.int64)
    dx = (amax / np.float32(127)).astype(np.float64)
    q = parts["qweight"]
    ints = qf._unpack4(q).astype(np.int64) - fmt.offset if fmt.bits == 4 else q.astype(np.int64)
    dots = (ints.reshape(q.shape[0], -1, 32) * xq[None]).sum(axis=-1)
    y = (dots * parts["scale"].astype(np.float64) * dx[None]).sum(axis=1)
    if fmt.has_min:
        y += (parts["min"].astype(np.float64) * (dx * xq.sum(axis=1))[None]).sum(axis=1)
    return y


def run(fmt, parts, x, tile):
    rows, cols = parts["qweight"].shape[0], x.shape[-1]
    func = quant_dot_tir.gemv(fmt, rows, cols, tile, form=FORM).with_attr("global_symbol", "main")
    fn = tvm.compile(tvm.IRModule({"main": func}), target=target())["main"]
    out = tvm.runtime.tensor(np.zeros((1, 1, rows), np.float32))
    fn(tvm.runtime.tensor(x.reshape(1, 1, cols)), *[tvm.runtime.tensor(parts[p]) for p in fmt.part_names], out)
    return out.numpy().reshape(-1)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows, cols, tile", [(48, 128, 4), (40, 64, 8), (16, 192, 1)])
def test_int8_gemv_matches_its_arithmetic_and_float(name, rows, cols, tile):
    fmt = qf.format_named(name)
    _needs_form(fmt)
    parts = parts_for(name, rows, cols)
    x = np.random.default_rng(1).standard_normal(cols).astype(np.float32)
    x[:32] = 0  # a block of zeros: its scale is 0, never a division by it
    got = run(fmt, parts, x, tile)
    want = int8_reference(fmt, parts, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    exact = qf.dequantize(fmt, parts).astype(np.float64) @ x.astype(np.float64)
    assert np.abs(got - exact).max() < 0.03 * np.abs(exact).max()  # int8 activations: ~1% of the largest


def test_eligible_and_tiles():
    assert quant_dot_tir.eligible(qf.GGUF["Q4_1"], 576)
    assert not quant_dot_tir.eligible(qf.GGUF["Q4_1"], 544)  # 17 blocks: 4-bit goes two blocks per load
    assert quant_dot_tir.eligible(qf.GGUF["Q8_0"], 544)
    assert not quant_dot_tir.eligible(qf.format_named("q4g128"), 512)
    assert not quant_dot_tir.eligible(qf.GGUF["F16"], 512)
    assert quant_dot_tir.tile_rows(960, 16) == 16 and quant_dot_tir.tile_rows(40, 16) == 8
    assert quant_dot_tir.tile_rows(7, 4) == 1
    with pytest.raises(ValueError, match="no int8 GEMV"):
        quant_dot_tir.gemv(qf.GGUF["F16"], 16, 64)
    with pytest.raises(ValueError, match="avx2 for 4-bit"):
        quant_dot_tir.gemv(qf.GGUF["Q8_0"], 16, 64, form="avx2")


def test_avx2_form_multiplies_with_pmaddubsw_and_pmaddwd():
    """The AVX2 form's kernel calls the two AVX2 intrinsics and no vpdpbusd (structure of the TIR)."""
    text = quant_dot_tir.gemv(qf.GGUF["Q4_0"], 16, 64, form="avx2").script()
    assert quant_dot_tir.PMADDUBSW in text and quant_dot_tir.PMADDWD in text and quant_dot_tir.DPBUSD not in text
    assert quant_dot_tir.DPBUSD in quant_dot_tir.gemv(qf.GGUF["Q4_0"], 16, 64).script()


@pytest.mark.parametrize("prologue", ["norm", "swiglu", "none"])
def test_fused_prologue_and_residual(prologue):
    """The row normed (RMSNorm) or gated (SwiGLU) before it is quantized, and a residual added: against the int8
    arithmetic on numpy's transformed row (a value rounding the other way moves a block by one step: 1e-3)."""
    fmt, rows, cols = qf.GGUF["Q4_1"], 32, 128
    parts = parts_for("q4_1", rows, cols)
    rng = np.random.default_rng(2)
    x = rng.standard_normal(2 * cols if prologue == "swiglu" else cols).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    res = rng.standard_normal(rows).astype(np.float32)
    if prologue == "norm":
        row = x / np.sqrt(np.mean(x * x) + 1e-6) * gamma
    elif prologue == "swiglu":
        row = x[:cols] / (1 + np.exp(-x[:cols])) * x[cols:]
    else:
        row = x
    fused = quant_dot_tir.Fused(norm=prologue == "norm", eps=1e-6, swiglu=prologue == "swiglu", residual=True)
    func = quant_dot_tir.gemv(fmt, rows, cols, 8, fused, FORM).with_attr("global_symbol", "main")
    fn = tvm.compile(tvm.IRModule({"main": func}), target=target())["main"]
    out = tvm.runtime.tensor(np.zeros((1, 1, rows), np.float32))
    args = [x.reshape(1, 1, -1)] + ([gamma] if prologue == "norm" else []) + [parts[p] for p in fmt.part_names]
    fn(*[tvm.runtime.tensor(a) for a in args], tvm.runtime.tensor(res.reshape(1, 1, rows)), out)
    want = int8_reference(fmt, parts, row.astype(np.float32)) + res
    np.testing.assert_allclose(out.numpy().reshape(-1), want, rtol=0, atol=1e-3 * np.abs(want).max())
