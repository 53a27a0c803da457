"""The quantized kernels (relaxtune/kernels/quant_tir.py), scheduled by the CPU rules and run: dequantization
bit for bit against `gguf.quants.dequantize`, the fused projection against dequantize-then-matmul in numpy
at several n per bucket kind (static GEMV rows, a symbolic row count), the embedding lookup."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import te, tirx
from tvm.target import codegen

from relaxtune.kernels import quant_formats as qf
from relaxtune.kernels import quant_tir
from relaxtune.schedules.rules import QuantGemv, apply_cpu_rules

gguf = pytest.importorskip("gguf")

N_OUT, K = 48, 128
FORMATS = ["q4_0", "q4_1", "q8_0", "f16", "q4g128", "q8g128"]


def target():
    return tvm.target.Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": 2})


def compiled(tensors):
    func = te.create_prim_func(tensors).with_attr("global_symbol", "main")
    mod = apply_cpu_rules(tvm.IRModule({"main": func}), target())
    assert mod["main"].attrs.get("tirx.is_scheduled")
    return tvm.compile(mod, target=target())["main"]


def parts_for(name: str, rows: int, cols: int, seed: int = 0) -> dict[str, np.ndarray]:
    fmt = qf.format_named(name)
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    kind = next((k for k, f in qf.GGUF.items() if f == fmt), None)
    if kind is None:
        return qf.quantize(fmt, values)
    raw = (
        values.astype(np.float16)
        if kind == "F16"
        else gguf.quants.quantize(values, getattr(gguf.GGMLQuantizationType, kind))
    )
    return qf.from_gguf(kind, raw, rows, cols)


def placeholders(fmt, rows: int, cols: int) -> dict[str, te.Tensor]:
    return {p: te.placeholder(shape, dtype, name=p) for p, (shape, dtype) in fmt.shapes(rows, cols).items()}


def run(fn, *arrays, out_shape, out_dtype="float32"):
    out = tvm.runtime.tensor(np.zeros(out_shape, out_dtype))
    fn(*[tvm.runtime.tensor(a) for a in arrays], out)
    return out.numpy()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "F16"])
def test_dequantize_kernel_is_gguf_bit_for_bit(kind):
    fmt = qf.GGUF[kind]
    values = np.random.default_rng(1).standard_normal((N_OUT, K)).astype(np.float32)
    raw = (
        values.astype(np.float16)
        if kind == "F16"
        else gguf.quants.quantize(values, getattr(gguf.GGMLQuantizationType, kind))
    )
    want = (
        raw.astype(np.float32)
        if kind == "F16"
        else gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
    )
    parts = qf.from_gguf(kind, raw, N_OUT, K)
    ph = placeholders(fmt, N_OUT, K)
    fn = compiled([*ph.values(), quant_tir.dequantize(fmt, ph, K)])
    got = run(fn, *parts.values(), out_shape=(N_OUT, K))
    assert np.array_equal(got.view(np.uint32), want.reshape(N_OUT, K).view(np.uint32))


def reference(fmt, parts, x, bias=None):
    w = qf.dequantize(fmt, parts).astype(np.float64)
    y = x.astype(np.float64) @ w.T
    return y if bias is None else y + bias


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(("rows", "cols"), [(1, K), (2, K), (4, K), (1, 512), (1, 576)])
def test_gemv_rows_against_numpy(name, rows, cols):
    """Static few-row kernels (a decode step, the n = 1 / 2 / 3..4 buckets): the QuantGemv rule; 512 and 576
    input features: scales converted 8 groups at a time, and a tile's whole rows at once (18 groups)."""
    fmt = qf.format_named(name)
    if cols % max(fmt.group, 32):
        pytest.skip(f"{name} takes a multiple of {fmt.group} input features")
    parts = parts_for(name, N_OUT, cols)
    x_ph = te.placeholder((1, rows, cols), "float32", name="x")
    ph = placeholders(fmt, N_OUT, cols)
    tensors = [x_ph, *ph.values(), quant_tir.linear(fmt, x_ph, ph)]
    assert QuantGemv().apply(te.create_prim_func(tensors), target(), False) is not None
    fn = compiled(tensors)
    x = np.random.default_rng(rows).standard_normal((1, rows, cols)).astype(np.float32)
    got = run(fn, x, *parts.values(), out_shape=(1, rows, N_OUT))
    np.testing.assert_allclose(got, reference(fmt, parts, x), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", ["q4_1", "q8_0", "q4g128"])
def test_symbolic_rows_with_bias_against_numpy(name):
    """One kernel for a range of n (the prefill buckets): the matmul rule packs dequantized panels."""
    fmt = qf.format_named(name)
    n = tirx.Var("n", "int64")
    parts = parts_for(name, N_OUT, K, seed=3)
    bias = np.random.default_rng(4).standard_normal(N_OUT).astype(np.float32)
    x_ph, b_ph = te.placeholder((1, n, K), "float32", name="x"), te.placeholder((N_OUT,), "float32", name="b")
    ph = placeholders(fmt, N_OUT, K)
    fn = compiled([x_ph, *ph.values(), b_ph, quant_tir.linear(fmt, x_ph, ph, bias=b_ph)])
    for rows in (1, 3, 17, 64):
        x = np.random.default_rng(rows).standard_normal((1, rows, K)).astype(np.float32)
        got = run(fn, x, *parts.values(), bias, out_shape=(1, rows, N_OUT))
        np.testing.assert_allclose(got, reference(fmt, parts, x, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", ["q8_0", "q4_1"])
def test_take_rows_dequantizes_the_gathered_rows_exactly(name):
    fmt = qf.format_named(name)
    parts = parts_for(name, N_OUT, K, seed=5)
    ids_ph = te.placeholder((1, 7), "int32", name="ids")
    ph = placeholders(fmt, N_OUT, K)
    fn = compiled([ids_ph, *ph.values(), quant_tir.take_rows(fmt, ids_ph, ph, K, "float32")])
    ids = np.array([[0, 5, 47, 5, 12, 1, 30]], dtype=np.int32)
    got = run(fn, ids, *parts.values(), out_shape=(1, 7, K))
    assert np.array_equal(got[0], qf.dequantize(fmt, parts)[ids[0]])
