"""The GPU layout of 4-bit weights (relaxtune/kernels/quant_formats.py `pack_q4_gpu`, kernels/quant_gpu_tir.py):
the numpy packer and its TIR twin agree bit for bit, and the weights it holds dequantize, in numpy and in TIR
(llvm), bit for bit as the GGUF-order parts do (`quant_formats.dequantize`)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import te

from relaxtune.kernels import quant_formats as qf
from relaxtune.kernels import quant_gpu_tir

ROWS, COLS = 5, 256
LLVM = tvm.target.Target({"kind": "llvm", "num-cores": 2})


def _parts(fmt, seed=0):
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    values[0, :32] = 0.0  # an all-zero group: scale 0
    values[1, 70] = -30.0  # an outlier
    return qf.quantize(fmt, values)


def _build(compute, placeholders):
    func = te.create_prim_func([*placeholders, compute(*placeholders)])
    return tvm.compile(tvm.IRModule({"main": func}), target=LLVM)


@pytest.mark.parametrize("fmt", [qf.own_format(4, 32), qf.own_format(4, 128), qf.GGUF["Q4_0"]], ids=lambda f: f.name)
def test_gpu_layout_dequantizes_bit_for_bit_as_gguf_order(fmt):
    parts = _parts(fmt)
    packed = qf.pack_q4_gpu(parts["qweight"])
    assert packed.dtype == np.uint32 and packed.shape == (ROWS, COLS // 8)
    assert packed.nbytes == parts["qweight"].nbytes  # the same bytes, reordered
    np.testing.assert_array_equal(qf.unpack_q4_gpu(packed), qf._unpack4(parts["qweight"]))
    np.testing.assert_array_equal(
        qf.dequantize_q4_gpu(packed, parts["scale"]).view(np.uint32), qf.dequantize(fmt, parts).view(np.uint32)
    )


def test_gpu_layout_puts_each_pair_at_one_offset_of_both_halves():
    """Word j holds weights 8j..8j+7: weight 8j + 2i at bit 4i, 8j + 2i + 1 at bit 16 + 4i (what the kernel's
    masks 0x000F000F / 0x00F000F0, then the word shifted by 8, take as half2 pairs)."""
    q = np.tile(np.arange(16, dtype=np.uint8), 2)[None, :]  # weights 0..15, 0..15 (one 32-weight chunk)
    word0 = int(qf.pack_q4_gpu(qf._pack4(q))[0, 0])
    assert word0 == sum(w << (4 * (e // 2) + 16 * (e % 2)) for e, w in enumerate(range(8)))
    for i in range(4):
        pair = (word0 >> (8 * (i // 2))) & (0x000F000F << (4 * (i % 2)))
        assert (pair >> (4 * (i % 2))) & 0xF == 2 * i and (pair >> (16 + 4 * (i % 2))) == 2 * i + 1


def test_tir_packer_matches_numpy():
    parts = _parts(qf.own_format(4, 32), seed=1)
    qweight = te.placeholder((ROWS, COLS // 2), "uint8", name="qweight")
    ex = _build(quant_gpu_tir.pack_q4, [qweight])
    out = tvm.runtime.tensor(np.zeros((ROWS, COLS // 8), np.uint32))
    ex["main"](tvm.runtime.tensor(parts["qweight"]), out)
    np.testing.assert_array_equal(out.numpy(), qf.pack_q4_gpu(parts["qweight"]))


@pytest.mark.parametrize("group", [32, 128])
def test_tir_dequantize_and_linear_match_numpy(group):
    fmt = qf.own_format(4, group)
    parts = _parts(fmt, seed=group)
    packed_np = qf.pack_q4_gpu(parts["qweight"])
    packed = te.placeholder((ROWS, COLS // 8), "uint32", name="packed")
    scale = te.placeholder((ROWS, COLS // group), "float16", name="scale")
    ex = _build(quant_gpu_tir.dequantize, [packed, scale])
    out = tvm.runtime.tensor(np.zeros((ROWS, COLS), np.float32))
    ex["main"](tvm.runtime.tensor(packed_np), tvm.runtime.tensor(parts["scale"]), out)
    reference = qf.dequantize(fmt, parts)
    np.testing.assert_array_equal(out.numpy().view(np.uint32), reference.view(np.uint32))

    x = te.placeholder((3, COLS), "float16", name="x")
    ex = _build(quant_gpu_tir.linear, [x, packed, scale])
    xv = np.random.default_rng(3).standard_normal((3, COLS)).astype(np.float16)
    y = tvm.runtime.tensor(np.zeros((3, ROWS), np.float16))
    ex["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(packed_np), tvm.runtime.tensor(parts["scale"]), y)
    expected = (xv.astype(np.float64) @ reference.T.astype(np.float64)).astype(np.float16)
    np.testing.assert_allclose(y.numpy().astype(np.float32), expected.astype(np.float32), rtol=2e-3, atol=2e-3)


def test_the_scheduled_dequantize_kernel_binds_threads_and_stores_16_bytes_a_thread():
    func = quant_gpu_tir.dequantize_kernel(64, 32, 8)
    text = func.script()
    assert func.attrs["tirx.is_scheduled"] and "blockIdx.x" in text and "threadIdx.x" in text
    assert "T.unroll" in text and text.count("T.vectorized(8)") == 1
    ex = tvm.compile(
        tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
        target=tvm.target.Target({"kind": "cuda", "arch": "sm_90"}),
    )
    source = ex.mod.imports[0].inspect_source()
    stores = [line for line in source.splitlines() if "dequantize_q4_gpu_ptr +" in line and "=" in line]
    assert len(stores) == 1 and stores[0].lstrip().startswith("*(uint4*)"), stores  # the 8 halves in one store
