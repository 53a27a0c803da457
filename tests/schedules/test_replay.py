"""Traces tuned on static kernels, re-applied to symbolic ones; padding to the register tile."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, te, tirx
from tvm.s_tir.schedule import Trace
from tvm.script import tirx as T

from relaxtune.schedules import padding, replay


def _matmul(rows):
    @T.prim_func(s_tir=True)
    def matmul(x: T.Buffer((rows, T.int64(64)), "float32"), w: T.Buffer((T.int64(64), T.int64(32)), "float32"), y: T.Buffer((rows, T.int64(32)), "float32")):
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
