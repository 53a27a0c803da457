"""The verifier, on plans written by hand: it accepts safe reuse and catches overlapping live tensors."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax, tirx

from relaxtune.relax_passes.pipeline import explicit_allocation_passes
from relaxtune.relax_passes.verify_memory_plan import elementwise_inplace, verify

_ALLOC = "relax.builtin.alloc_tensor"


def _module(target):
    """x -> a = exp(x) -> b = exp(a) -> c = b @ w -> d = c + x (returned); n <= 64."""
    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 16), "float32"))
    w = relax.Var("w", relax.TensorType((16, 16), "float32"))
    with bb.function("main", [x, w], attrs={"tir_var_upper_bound": {"n": 64}}):
        with bb.dataflow():
            a = bb.emit(relax.op.exp(x))
            b = bb.emit(relax.op.exp(a))
            c = bb.emit(relax.op.matmul(b, w))
            d = bb.emit_output(relax.op.add(c, x))
        bb.emit_func_output(d)
    with target.target:
        return tvm.transform.Sequential([relax.transform.LegalizeOps(), *explicit_allocation_passes()])(bb.get())


def _by_hand(func, offsets: list, arena) -> relax.Function:
    """Put the k-th allocation at offsets[k] (None: leave it alone) in one storage of `arena` bytes."""
    bb = relax.BlockBuilder()
    storage = bb.normalize(relax.op.memory.alloc_storage(relax.ShapeExpr([arena]), 0, "global", "uint8"))
    store = relax.Var("arena", storage.ty)
    bindings, k = [relax.VarBinding(store, storage)], 0
    for binding in func.body.blocks[0].bindings:
        value = binding.value
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == _ALLOC:
            offset, k = offsets[k], k + 1
            if offset is not None:
                value = bb.normalize(relax.op.memory.alloc_tensor(store, offset, value.args[0], value.args[1]))
        bindings.append(relax.VarBinding(binding.var, value))
    return relax.Function(
        func.params,
        relax.SeqExpr([relax.BindingBlock(bindings)], func.body.body),
        func.ret_ty,
        func.is_pure,
        func.attrs,
    )


@pytest.fixture(scope="module")
def case(target):
    mod = _module(target)
    n = [v for v in relax.analysis.defined_symbolic_vars(mod["main"]) if v.name == "n"][0]
    return mod, n * tirx.const(64, "int64")  # bytes of one (n, 16) float32 tensor


def _check(case, offsets, arena_rows=4, values=(1, 17, 64), with_kernels=True):
    mod, size = case
    func = _by_hand(mod["main"], offsets, size * tirx.const(arena_rows, "int64"))
    return [p for n in values for p in verify(func, {"n": n}, mod if with_kernels else None)]


def test_disjoint_and_dead_reuse_are_accepted(case):
    _, s = case
    assert _check(case, [0, s, s * 2, None]) == []
    # a dies at exp(a) -> b; c is allocated later and may take a's bytes
    assert _check(case, [0, s, 0, None]) == []


def test_overlapping_live_tensors_are_caught(case):
    _, s = case
    problems = _check(case, [0, s, s, None], values=(5,))  # b is read by the matmul that writes c
    assert len(problems) == 1 and "alloc1" in problems[0] and "alloc2" in problems[0]
    half = tirx.floordiv(s, tirx.const(2, "int64"))
    assert _check(case, [0, s, s + half, None], values=(8,))  # a partial overlap too


def test_inplace_needs_an_elementwise_kernel_and_its_proof(case):
    _, s = case
    # exp(a) -> b in a's bytes: accepted with the kernels, refused without them
    assert _check(case, [0, 0, s, None]) == []
    assert _check(case, [0, 0, s, None], values=(3,), with_kernels=False)
    # b @ w -> c in b's bytes: a matmul is never in-place
    assert _check(case, [0, s, s, None], values=(3,))


def test_overlap_behind_a_repeated_name_is_caught(target):
    """t = exp(x); u = t @ w; a second tensor named t = exp(u); out = t(second) + t(first).

    The first t is read by the last kernel, so the second t may not take its bytes. A liveness
    keyed by names (as both planner and verifier had) ended the first t at the matmul and
    accepted that plan: the wrong rows of padded tuned calls, whose rewrite repeats names.
    """
    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 16), "float32"))
    w = relax.Var("w", relax.TensorType((16, 16), "float32"))
    with bb.function("main", [x, w], attrs={"tir_var_upper_bound": {"n": 64}}):
        with bb.dataflow():
            first = bb.emit(relax.op.exp(x), name_hint="t")
            u = bb.emit(relax.op.matmul(first, w))
            second = relax.DataflowVar("t", first.ty)  # the builder would rename it: bind it directly
            bb.emit_normalized(relax.VarBinding(second, bb.normalize(relax.op.exp(u))))
            out = bb.emit_output(relax.op.add(second, first))
        bb.emit_func_output(out)
    with target.target:
        mod = tvm.transform.Sequential([relax.transform.LegalizeOps(), *explicit_allocation_passes()])(bb.get())
    names = [b.var.name for b in mod["main"].body.blocks[0].bindings]
    assert names.count("t") == 2
    size = [v for v in relax.analysis.defined_symbolic_vars(mod["main"]) if v.name == "n"][0] * tirx.const(64, "int64")
    arena = size * tirx.const(3, "int64")
    assert verify(_by_hand(mod["main"], [0, size, size * 2, None], arena), {"n": 9}, mod) == []
    problems = verify(
        _by_hand(mod["main"], [0, size, 0, None], arena), {"n": 9}, mod
    )  # second t in the first t's bytes
    assert len(problems) == 1 and problems[0].startswith("alloc (") and "overlaps alloc2 (" in problems[0], problems


def test_bytes_outside_the_storage_misaligned_or_returned_are_caught(case):
    _, s = case
    assert any("outside" in p for p in _check(case, [0, s, s * 2, None], arena_rows=2, values=(4,)))
    assert any("misaligned" in p for p in _check(case, [0, s + tirx.const(4, "int64"), s * 3, None], values=(4,)))
    assert any("returned" in p for p in _check(case, [0, s, 0, s * 2], values=(4,)))


def test_tvm_static_plan_passes_the_verifier(case, target):
    mod, _ = case
    with target.target:
        planned = relax.transform.StaticPlanBlockMemory()(mod)
    for n in (1, 33, 64):
        assert verify(planned["main"], {"n": n}, mod) == []


def test_elementwise_proof_on_kernels(case, target):
    mod, _ = case
    kernels = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}
    assert elementwise_inplace(kernels["tir_exp"], 0, 1)
    assert elementwise_inplace(kernels["add"], 0, 2) and elementwise_inplace(kernels["add"], 1, 2)
    assert not elementwise_inplace(kernels["matmul"], 0, 2)  # reads a row for every output element
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((16, 16), "float32"))
    with bb.function("main", [x]):
        t = bb.emit(relax.op.permute_dims(x))
        bb.emit_func_output(bb.emit(relax.op.nn.softmax(t, axis=-1)))
    with target.target:
        other = relax.transform.LegalizeOps()(bb.get())
    others = {gv.name_hint: f for gv, f in other.functions_items() if isinstance(f, tirx.PrimFunc)}
    assert not elementwise_inplace(others["transpose"], 0, 1)  # same shape, other element
    assert not elementwise_inplace(others["softmax"], 0, 1)  # reads the whole row
