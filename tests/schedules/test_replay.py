"""Traces tuned on static kernels, re-applied to symbolic ones; padding to the register tile."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.script import tirx as T

from relaxtune.schedules import padding, replay


def _matmul(rows):
    @T.prim_func(s_tir=True)
    def matmul(
        x: T.Buffer((rows, T.int64(64)), "float32"),
        w: T.Buffer((T.int64(64), T.int64(32)), "float32"),
        y: T.Buffer((rows, T.int64(32)), "float32"),
    ):
        for i, j, k in T.grid(rows, T.int64(32), T.int64(64)):
            with T.sblock("matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    y[vi, vj] = T.float32(0)
                y[vi, vj] = y[vi, vj] + x[vi, vk] * w[vk, vj]

    return matmul


def _tuned_trace(static):
    """A trace as MetaSchedule would record it: sampled tiles, then splits, reorder, parallel."""
    sch = replay.fresh_schedule(static)
    block = sch.get_sblock("matmul")
    i, j, k = sch.get_loops(block)
    i0, i1, i2 = sch.split(i, sch.sample_perfect_tile(i, n=3, decision=[2, 2, 4]))
    j0, j1 = sch.split(j, sch.sample_perfect_tile(j, n=2, decision=[2, 16]))
    sch.reorder(i0, j0, i1, k, i2, j1)
    sch.parallel(sch.fuse(i0, j0))
    sch.vectorize(j1)
    return sch.trace


def insts_of(trace):
    return [inst.kind.name for inst in trace.insts]


def test_generalize_folds_samples_into_free_outer_factors():
    trace = _tuned_trace(_matmul(T.int64(16)))
    insts, _ = replay.generalize(trace)
    splits = [inputs[1:] for kind, inputs, _, _ in insts if kind == "Split"]
    assert splits == [[None, 2, 4], [None, 16]]
    assert all(kind != "SamplePerfectTile" for kind, *_ in insts)
    first_sample = next(i for i, inst in enumerate(insts_of(trace)) if inst == "SamplePerfectTile")
    rows, _ = replay.generalize(trace, row_samples={first_sample: 1})
    assert [inputs[1:] for kind, inputs, _, _ in rows if kind == "Split"][0] == [None, 1, 4]


def test_row_tile_keeps_inner_levels_up_to_the_cap():
    assert replay.row_tile([2, 8, 8, 1]) == (2, 8)
    assert replay.row_tile([1, 1, 4, 4]) == (3, 16)
    assert replay.row_tile([4, 32, 1, 1]) == (2, 1)


def test_row_samples_and_multiples():
    static = _matmul(T.int64(16))
    trace = _tuned_trace(static)
    samples = replay.row_samples(static, trace, {"n": 16})
    assert list(samples.values()) == [("n", 2, 8)]
    assert replay.multiples(samples) == {"n": 8}


def test_symbolic_replay_guards_and_padding_removes_the_guard():
    n = T.int64()
    static, dynamic = _matmul(T.int64(16)), _matmul(tvm.tirx.Var("n", "int64"))
    trace = _tuned_trace(static)
    direct = replay.apply_trace(dynamic, replay.generalize(trace))
    assert replay.has_guard(direct)
    assert not replay.has_guard(replay.apply_trace(static, replay.generalize(trace)))
    assert padding.can_pad(dynamic, {"n"})


def test_fresh_schedule_leaves_the_kernel_untouched():
    dynamic = _matmul(tvm.tirx.Var("n", "int64"))
    before = dynamic.script()
    replay.apply_trace(dynamic, replay.generalize(_tuned_trace(_matmul(T.int64(16)))))
    replay.apply_trace(dynamic, replay.generalize(_tuned_trace(_matmul(T.int64(16)))))
    assert dynamic.script() == before


def _bound(second: int) -> tirx.PrimFunc:
    """Two blocks in one kernel, each row loop on blockIdx.x and column loop on threadIdx.x (64, then `second`)."""
    from tvm import s_tir

    x = te.placeholder((4, 64), "float32", name="x")
    y = te.compute((4, 64), lambda i, j: x[i, j] * 2.0, name="y")
    z = te.compute((4, 64), lambda i, j: y[i, j] + 1.0, name="z")
    sch = s_tir.Schedule(te.create_prim_func([x, z]))
    for block, threads in (("y", 64), ("z", second)):
        i, j = sch.get_loops(sch.get_sblock(block))
        _, inner = sch.split(j, [None, threads])
        sch.bind(i, "blockIdx.x")
        sch.bind(inner, "threadIdx.x")
    return sch.mod["main"]


def test_a_thread_index_bound_at_two_extents_is_caught_without_a_gpu():
    assert replay.threads_agree(_bound(64)) and replay.thread_extents(_bound(64))["threadIdx.x"] == {"64"}
    assert not replay.threads_agree(_bound(16))  # what a smaller row tile left in a record's cooperative fetch
    assert replay.thread_extents(_bound(16))["threadIdx.x"] == {"64", "16"}


def test_padded_call_zero_fills_in_one_kernel_and_is_right_at_multiples_and_between():
    """The caller side of padding: rows grown to the multiple by one copy kernel (no zero-row concat:
    on the H200 that made gpt2-block's padded records 100% off at exactly n = 16), the output sliced back."""
    n = tvm.tirx.Var("n", "int64")
    kernel = _matmul(n)
    x_ty = relax.TensorType((n, 64), "float32")
    w_ty = relax.TensorType((64, 32), "float32")
    out_ty = relax.TensorType((n, 32), "float32")
    pads = {"n": (n, 8)}
    bb = relax.BlockBuilder()
    x, w = relax.Var("x", x_ty), relax.Var("w", w_ty)
    with bb.function("main", [x, w]):
        gv = bb.add_func(padding.padded_kernel(kernel, [x_ty, w_ty], out_ty, pads), "matmul_padded")
        y = padding.emit_padded_call(bb, gv, [x, w], out_ty, pads)
        bb.emit_func_output(y)
    mod = bb.get()
    ops = [c.op.name for c in _calls(mod["main"]) if isinstance(c.op, tvm.ir.Op)]
    assert "relax.concat" not in ops and "relax.zeros" not in ops
    assert sum(1 for gv in mod.get_global_vars() if gv.name_hint.startswith("zero_filled")) == 1
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(0)
    wv = rng.standard_normal((64, 32)).astype("float32")
    for rows in (1, 5, 8, 13, 16):
        xv = rng.standard_normal((rows, 64)).astype("float32")
        got = vm["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(wv)).numpy()
        np.testing.assert_allclose(got, xv @ wv, rtol=1e-4, atol=1e-4)


def _calls(func):
    found = []
    relax.analysis.post_order_visit(func, lambda e: found.append(e) if isinstance(e, relax.Call) else None)
    return found
