"""MergeQuantProjections (relax_passes/merge_quant_projections.py): 4-bit projections of one activation become one
projection over weights concatenated at load, then slices: on the head axis when each is reshaped to heads (q / k),
on the last axis otherwise (gate / up); structure (Before / Expected), where it does not fire, and a q4f16
llama-block that computes the same on llvm with and without it."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx

from relaxtune.config import QuantizeConfig
from relaxtune.kernels import quant_gpu_tir
from relaxtune.relax_passes.merge_quant_projections import MergeQuantProjections
from relaxtune.relax_passes.pack_quant_weights_cuda import PackQuantWeightsCuda
from relaxtune.workloads import load, parse_config

K, G, D = 64, 32, 16
ROWS = {"q": 2 * D, "k": D, "gate": 32, "up": 32}  # q: 2 heads, k: 1 head of D
ENTRIES = ["main", "main_transform_params"]


def _part_types(rows: int):
    return relax.TensorType((rows, K // 8), "uint32"), relax.TensorType((rows, K // G), "float16")


def _linear(bb, x, packed, scale):
    return bb.emit(bb.call_te(quant_gpu_tir.linear, x, packed, scale, primfunc_name_hint="q4_gpu_linear"))


def _module(merged: bool) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    groups = [("q", "k"), ("gate", "up")]
    names = [name for group in groups for name in group]
    types = [t for name in names for t in _part_types(ROWS[name])]
    ptuple = relax.Var("params", relax.TupleType(types))
    with bb.function("main_transform_params", [ptuple], attrs={"num_input": 0}):
        with bb.dataflow():
            fields = [bb.emit(relax.TupleGetItem(ptuple, i)) for i in range(len(types))]
            if merged:  # per group: the packed words, then the scales, concatenated along the rows
                fields = [
                    bb.emit(relax.op.concat([fields[4 * g + p], fields[4 * g + 2 + p]], axis=0))
                    for g in (0, 1)
                    for p in (0, 1)
                ]
            out = bb.emit_output(relax.Tuple(fields))
        bb.emit_func_output(out)
    x = relax.Var("x", relax.TensorType((1, n, K), "float16"))
    if merged:
        params = [relax.Var(f"w{i}", t) for i, t in enumerate([*_part_types(3 * D), *_part_types(64)])]
    else:
        params = [relax.Var(f"w{i}", t) for i, t in enumerate(types)]
    with bb.function("main", [x, *params], attrs={"num_input": 1}):
        with bb.dataflow():
            h = bb.emit(relax.op.negative(x))  # gate / up read another activation
            if merged:
                qk = bb.emit(relax.op.reshape(_linear(bb, x, *params[:2]), [1, n, 3, D]))
                q = bb.emit(relax.op.strided_slice(qk, axes=[2], begin=[0], end=[2]))
                k = bb.emit(relax.op.strided_slice(qk, axes=[2], begin=[2], end=[3]))
                gu = _linear(bb, h, *params[2:])
                gate = bb.emit(relax.op.strided_slice(gu, axes=[2], begin=[0], end=[32]))
                up = bb.emit(relax.op.strided_slice(gu, axes=[2], begin=[32], end=[64]))
            else:
                q = bb.emit(relax.op.reshape(_linear(bb, x, *params[0:2]), [1, n, 2, D]))
                k = bb.emit(relax.op.reshape(_linear(bb, x, *params[2:4]), [1, n, 1, D]))
                gate = _linear(bb, h, *params[4:6])
                up = _linear(bb, h, *params[6:8])
            mlp = bb.emit(relax.op.multiply(relax.op.nn.silu(gate), up))
            out = bb.emit_output(relax.Tuple([q, k, mlp]))
        bb.emit_func_output(out)
    return bb.get()


def test_projections_of_one_activation_are_merged_and_sliced():
    got = relax.transform.DeadCodeElimination(ENTRIES)(MergeQuantProjections()(_module(False)))
    want = relax.transform.DeadCodeElimination(ENTRIES)(_module(True))
    tvm.ir.assert_structural_equal(got["main_transform_params"], want["main_transform_params"])
    # the kernels are the same TE definitions; their names depend on the order the builder met them
    tvm.ir.assert_structural_equal(_calling(got, want)["main"], want["main"])


def _same(a, b) -> bool:
    try:
        tvm.ir.assert_structural_equal(a, b)
        return True
    except ValueError:
        return False


def _calling(mod: tvm.IRModule, names: tvm.IRModule) -> tvm.IRModule:
    """`mod` with each call_tir calling the kernel of `names` structurally equal to its own."""
    kernels = [(gv, f) for gv, f in names.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]

    @relax.expr_functor.mutator
    class Rename(relax.expr_functor.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op != tvm.ir.Op.get("relax.call_tir"):
                return call
            gv = next(g for g, f in kernels if _same(f, mod[call.args[0]]))
            return relax.call_tir(gv, call.args[1], call.ty)

    out = mod.clone()
    out["main"] = Rename(mod).visit_expr(mod["main"])
    return out


def test_projections_of_different_activations_are_left_alone():
    bb = relax.BlockBuilder()
    types = [*_part_types(D), *_part_types(D)]
    ptuple = relax.Var("params", relax.TupleType(types))
    with bb.function("main_transform_params", [ptuple], attrs={"num_input": 0}):
        with bb.dataflow():
            out = bb.emit_output(relax.Tuple([bb.emit(relax.TupleGetItem(ptuple, i)) for i in range(4)]))
        bb.emit_func_output(out)
    x = relax.Var("x", relax.TensorType((1, 1, K), "float16"))
    params = [relax.Var(f"w{i}", t) for i, t in enumerate(types)]
    with bb.function("main", [x, *params], attrs={"num_input": 1}):
        with bb.dataflow():
            a = _linear(bb, x, *params[:2])
            b = _linear(bb, bb.emit(relax.op.negative(x)), *params[2:])
            out = bb.emit_output(relax.Tuple([a, b]))
        bb.emit_func_output(out)
    mod = bb.get()
    tvm.ir.assert_structural_equal(MergeQuantProjections()(mod), mod)


def test_q4f16_llama_block_computes_the_same_merged_on_llvm():
    work = load(
        "llama-block",
        parse_config("hidden=256,heads=4,kv_heads=2,ffn=512,max_seq=64,max_batch=1"),
        quantize=QuantizeConfig("q4f16", 32),
    )
    packed = PackQuantWeightsCuda()(relax.transform.LiftTransformParams()(work.mod))
    merged = MergeQuantProjections()(packed)
    assert merged["main"].script().count("q4_gpu_linear") == 4  # q / k / v and gate / up one call each, o, down
    target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    x = np.random.default_rng(0).standard_normal((1, 5, 256)).astype(np.float16)
    outs = []
    for mod in (packed, merged):
        vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
        weights = vm["main_transform_params"]([tvm.runtime.tensor(v) for v in work.params.values()])
        outs.append(vm["main"](tvm.runtime.tensor(x), *weights).numpy())
    np.testing.assert_array_equal(outs[1], outs[0])  # rows are independent: the same arithmetic
