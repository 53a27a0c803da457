"""PackQuantWeightsCuda (relax_passes/pack_quant_weights_cuda.py): a 4-bit weight only quantized projections read
is packed at load into the GPU layout and the projections read it; structure (Before / Expected), where it must
not fire, and numerics through an llvm build (the transform at load, then main at several n) against the
unpacked module."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from relaxtune.kernels import quant_formats as qf
from relaxtune.kernels import quant_gpu_tir, quant_tir
from relaxtune.relax_passes.pack_quant_weights_cuda import PackQuantWeightsCuda

N, K, G = 16, 64, 32
FMT = qf.own_format(4, G)
ENTRIES = ["main", "main_transform_params"]


def _linear(fmt=FMT, out_dtype="float16"):
    def compute(x, *parts):
        return quant_tir.linear(fmt, x, dict(zip(fmt.part_names, parts)), out_dtype=out_dtype)

    return compute


def _module(packed: bool, x_dtype: str = "float16", second_use: bool = False, fmt=FMT) -> tvm.IRModule:
    """main(x, w's parts) = proj(x), as LiftTransformParams leaves it (main_transform_params returning the parts);
    `packed`: the expected result of the pass."""
    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    parts = [relax.Var(f"w_{name}", relax.TensorType(*spec)) for name, spec in fmt.shapes(N, K).items()]
    ptuple = relax.Var("params", relax.TupleType([v.ty for v in parts]))
    with bb.function("main_transform_params", [ptuple], attrs={"num_input": 0}):
        with bb.dataflow():
            fields = [bb.emit(relax.TupleGetItem(ptuple, i)) for i in range(len(parts))]
            if packed:
                fields[0] = bb.emit(bb.call_te(quant_gpu_tir.pack_q4, fields[0], primfunc_name_hint="pack_q4_gpu"))
            out = bb.emit_output(relax.Tuple(fields))
        bb.emit_func_output(out)
    x = relax.Var("x", relax.TensorType((1, n, K), x_dtype))
    if packed:
        parts[0] = relax.Var("w_qweight", relax.TensorType((N, K // 8), "uint32"))
    with bb.function("main", [x, *parts], attrs={"num_input": 1}):
        with bb.dataflow():
            if packed:
                y = bb.emit(bb.call_te(quant_gpu_tir.linear, x, *parts, primfunc_name_hint="q4_gpu_linear"))
            else:
                y = bb.emit_te(_linear(fmt, x_dtype), x, *parts, primfunc_name_hint="dequantize_linear")
            if second_use:  # the integers read by something else: they keep GGUF's order
                total = relax.op.astype(relax.op.sum(parts[0], axis=[1]), x_dtype)
                y = bb.emit(relax.op.add(y, total))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _packed(mod):
    return relax.transform.DeadCodeElimination(ENTRIES)(PackQuantWeightsCuda()(mod))


def test_weights_are_packed_at_load_and_projections_read_them():
    tvm.ir.assert_structural_equal(_packed(_module(False)), _module(True))


def test_an_identity_transform_gets_its_outputs_as_a_tuple():
    """LiftTransformParams returns its parameter itself when nothing is lifted: the packed form is the same."""
    before = _module(False)
    identity = before["main_transform_params"]
    before["main_transform_params"] = relax.Function(
        identity.params, identity.params[0], identity.ret_ty, identity.is_pure, identity.attrs
    )
    tvm.ir.assert_structural_equal(_packed(before), _module(True))


@pytest.mark.parametrize(
    "case",
    [
        {"x_dtype": "float32"},  # float32 activations: the GPU kernel takes float16
        {"second_use": True},  # the integers read by more than projections
        {"fmt": qf.own_format(8, G)},  # 8-bit
        {"fmt": qf.GGUF["Q4_1"]},  # a min: w = d q + m
    ],
    ids=["fp32", "second-use", "q8", "q4_1"],
)
def test_does_not_fire(case):
    mod = _module(False, **case)
    tvm.ir.assert_structural_equal(PackQuantWeightsCuda()(mod), mod)


def test_packed_module_computes_the_same_on_llvm():
    rng = np.random.default_rng(0)
    parts = qf.quantize(FMT, rng.standard_normal((N, K)).astype(np.float32))
    xs = [rng.standard_normal((1, n, K)).astype(np.float16) for n in (1, 5)]
    target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    outs = []
    for mod in (_module(False), PackQuantWeightsCuda()(_module(False))):
        vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
        weights = vm["main_transform_params"](
            [tvm.runtime.tensor(parts["qweight"]), tvm.runtime.tensor(parts["scale"])]
        )
        outs.append([vm["main"](tvm.runtime.tensor(x), *weights).numpy() for x in xs])
    assert outs[1][0].shape == (1, 1, N) and outs[1][1].shape == (1, 5, N)
    for plain, packed in zip(*outs):  # the same float32 arithmetic in the same order
        np.testing.assert_array_equal(packed, plain)
