"""The once-per-kernel check of a re-applied schedule: where it runs, and that it tells right from wrong."""

from __future__ import annotations

import tvm
from tvm import te, tirx

from relaxtune import targets
from relaxtune.schedules import validate


def _kernel(offset: float) -> tirx.PrimFunc:
    n = tirx.Var("n", "int64")
    x = te.placeholder((n, 8), "float32", name="x")
    y = te.compute((n, 8), lambda i, j: x[i, j] * 2.0 + offset, name="y")
    return te.create_prim_func([x, y])


def _split(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """A real schedule of the kernel: its row loop split by 4 (a tail at odd n) and the columns vectorised."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    i, j = sch.get_loops(sch.get_sblock("y"))
    sch.split(i, [None, 4])
    sch.vectorize(j)
    return sch.mod["main"]


def test_check_target_is_the_host_for_cpu_and_nowhere_for_a_gpu_this_machine_lacks():
    assert validate.check_target(targets.resolve("cpu").target).kind.name == "llvm"
    has_gpu = tvm.cuda(0).exist
    got = validate.check_target(targets.resolve("cuda").target)
    assert (got is not None and got.kind.name == "cuda") if has_gpu else got is None


def test_probe_values_are_small_and_inside_the_bucket():
    func = _kernel(1.0)
    assert validate.probe_values(func, {}) == {"n": 2}
    assert validate.probe_values(func, {"n": (129, 1024)}) == {"n": 129}
    assert validate.probe_values(func, {"n": (1, 1)}) == {"n": 1}


def test_same_results_tells_a_schedule_from_another_computation():
    reference = _kernel(1.0)
    bounds = {"n": (3, 64)}
    assert validate.same_results(reference, _split(reference), bounds)
    assert validate.same_results(
        reference, _split(reference), bounds, validate.check_target(targets.resolve("cpu").target)
    )
    assert not validate.same_results(reference, _split(_kernel(1.5)), bounds)  # off by 0.5 everywhere
