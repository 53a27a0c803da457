"""QuantDotGemv (relax_passes/quant_dot_gemv.py): a one-row quantized projection becomes the int8 kernel, with
the rms_norm or SwiGLU that makes its input and the residual add of its output fused; the module then computes
what it computed (within the int8 activations' error); calls of several rows, other formats and non-VNNI
targets are left alone."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, te
from tvm.target import codegen

from relaxtune.kernels import quant_dot_tir, quant_tir
from relaxtune.kernels import quant_formats as qf
from relaxtune.relax_passes.quant_dot_gemv import QuantDotGemv, linear_format

N, K = 32, 128
HOST = tvm.target.Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": 2})


def _module(fmt, rows: int, prologue: str, residual: bool):
    """main(x, gamma, res, *parts): [rms_norm | swiglu] -> quantized linear -> [+ res]."""
    bb = relax.BlockBuilder()
    width = 2 * K if prologue == "swiglu" else K
    x = relax.Var("x", relax.TensorType((1, rows, width), "float32"))
    gamma = relax.Var("gamma", relax.TensorType((K,), "float32"))
    res = relax.Var("res", relax.TensorType((1, rows, N), "float32"))
    parts = [relax.Var(p, relax.TensorType(s, d)) for p, (s, d) in fmt.shapes(N, K).items()]

    def linear(x, *p):
        return quant_tir.linear(fmt, x, dict(zip(fmt.part_names, p)))

    with bb.function("main", [x, gamma, res, *parts]):
        with bb.dataflow():
            h = x
            if prologue == "norm":
                h = bb.emit(relax.op.nn.rms_norm(x, gamma, axes=[-1], epsilon=1e-5))
            elif prologue == "swiglu":
                halves = bb.emit(relax.op.split(x, 2, axis=-1))
                gate = bb.emit(relax.TupleGetItem(halves, 0))
                up = bb.emit(relax.TupleGetItem(halves, 1))
                h = bb.emit(relax.op.multiply(bb.emit(relax.op.nn.silu(gate)), up))
            y = bb.emit_te(linear, h, *parts, primfunc_name_hint="dequantize_linear")
            out = bb.emit_output(relax.op.add(res, y) if residual else y)
        bb.emit_func_output(out)
    return bb.get()


def _calls(mod) -> list[str]:
    names = []
    relax.analysis.post_order_visit(
        mod["main"].body,
        lambda e: (
            names.append(e.args[0].name_hint if e.op.name == "relax.call_tir" else e.op.name)
            if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op)
            else None
        ),
    )
    return names


def _run(mod, arrays):
    ex = tvm.compile(mod, target=HOST)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


def _rewrite(mod, target=HOST):
    with target:
        return relax.transform.DeadCodeElimination()(QuantDotGemv(target)(mod))


@pytest.mark.skipif(quant_dot_tir.dot_form(HOST) is None, reason="the host has neither VNNI nor AVX2")
@pytest.mark.parametrize("name", ["q4_1", "q4_0", "q4g32"])
@pytest.mark.parametrize("prologue, residual", [("none", False), ("norm", False), ("swiglu", True), ("none", True)])
def test_one_row_becomes_the_int8_kernel_with_its_neighbours(name, prologue, residual):
    fmt = qf.format_named(name)
    before = _module(fmt, 1, prologue, residual)
    after = _rewrite(before)
    calls = _calls(after)
    suffix = ("" if prologue == "none" else f"_{prologue}") + ("_residual" if residual else "")
    assert calls == [f"quant_dot_gemv_{name}_{N}x{K}{suffix}"], calls  # norm / split / silu / multiply / add absorbed
    kernel = after[calls[0]]
    assert kernel.attrs[quant_dot_tir.KIND_ATTR] == quant_dot_tir.KIND
    rng = np.random.default_rng(0)
    values = rng.standard_normal((N, K)).astype(np.float32)
    parts = qf.quantize(qf.own_format(fmt.bits, 32), values)
    if fmt.has_min:
        parts["min"] = (rng.standard_normal(parts["scale"].shape) * 0.1).astype(np.float16)
    width = 2 * K if prologue == "swiglu" else K
    arrays = [
        rng.standard_normal((1, 1, width)).astype(np.float32),
        rng.uniform(0.5, 1.5, K).astype(np.float32),
        rng.standard_normal((1, 1, N)).astype(np.float32),
        *[parts[p] for p in fmt.part_names],
    ]
    want, got = _run(before, arrays), _run(after, arrays)
    assert np.abs(got - want).max() < 0.03 * np.abs(want).max()


@pytest.mark.parametrize(
    "name, rows, target",
    [
        ("q4_1", 3, HOST),  # several rows: the float32 kernel
        ("q4g128", 1, HOST),  # groups of 128
        ("f16", 1, HOST),
        ("q8_0", 1, HOST),  # 8-bit: the float32 rule (INT8_BITS)
        ("q4_1", 1, tvm.target.Target({"kind": "llvm", "mcpu": "sandybridge"})),  # neither VNNI nor AVX2
    ],
)
def test_left_alone(name, rows, target):
    before = _module(qf.format_named(name), rows, "norm", True)
    after = _rewrite(before, target)
    assert "dequantize_linear" in _calls(after) and "relax.nn.rms_norm" in _calls(after)


def test_kernel_shapes_are_checked():
    fmt = qf.GGUF["Q4_1"]
    x = te.placeholder((1, 1, K), "float32")
    parts = {p: te.placeholder(s, d) for p, (s, d) in fmt.shapes(N, K).items()}
    bias = te.placeholder((N,), "float32")
    with_bias = te.create_prim_func([x, *parts.values(), bias, quant_tir.linear(fmt, x, parts, bias=bias)])
    assert linear_format(te.create_prim_func([x, *parts.values(), quant_tir.linear(fmt, x, parts)])) == fmt
    assert linear_format(with_bias) is None  # a bias block: not the plain projection


@pytest.mark.parametrize(
    "mcpu, instruction", [("haswell", quant_dot_tir.PMADDUBSW), ("sapphirerapids", quant_dot_tir.DPBUSD)]
)
def test_the_kernel_takes_the_targets_int8_instructions(mcpu, instruction):
    """AVX2 without VNNI (haswell): vpmaddubsw + vpmaddwd; with VNNI: vpdpbusd (the kernel's TIR, not run)."""
    after = _rewrite(
        _module(qf.format_named("q4_1"), 1, "none", False), tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    )
    calls = _calls(after)
    assert len(calls) == 1 and instruction in after[calls[0]].script(), calls
