"""Transfer: the best records of a similar task, refitted to a new shape, give valid candidates."""

from __future__ import annotations

import numpy as np
import pytest

from relaxtune.schedules import transfer


def _matmul(n: int, relu: bool = False):
    import tvm
    from tvm import te, topi

    a = te.placeholder((n, 64), name="a")
    b = te.placeholder((64, 32), name="b")
    k = te.reduce_axis((0, 64), name="k")
    c = te.compute((n, 32), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="matmul")
    out = topi.nn.relu(c) if relu else c
    func = te.create_prim_func([a, b, out]).with_attr("global_symbol", "main").with_attr("tirx.noalias", True)
    return tvm.IRModule({"main": func})


def _context(mod, target):
    from tvm.s_tir import meta_schedule as ms

    return ms.TuneContext(mod=mod, target=target.target, space_generator="post-order-apply", search_strategy="evolutionary", task_name="t", rand_state=3)


@pytest.fixture(scope="module")
def database(target):
    """Records of a 16-row matmul: design-space samples of three seeds, with made-up times."""
    from tvm.s_tir import meta_schedule as ms

    source = _matmul(16)
    db = ms.database.MemoryDatabase()
    workload = db.commit_workload(source)
    args = ms.arg_info.ArgInfo.from_prim_func(source["main"])
    for seed in range(3):
        context = ms.TuneContext(mod=source, target=target.target, space_generator="post-order-apply", search_strategy="evolutionary", task_name="s", rand_state=seed + 1)
        for i, sch in enumerate(context.space_generator.generate_design_space(source)):
            db.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, [1e-5 / (seed + i + 1)], target.target, args))
    return db


def test_fit_tile_keeps_inner_factors_that_divide():
    assert transfer.fit_tile(24, [2, 1, 4, 2]) == [3, 1, 4, 2]
    assert transfer.fit_tile(20, [1, 1, 8, 2]) == [5, 1, 2, 2]  # gcd(8, 10) = 2
    assert transfer.fit_tile(7, [1, 4, 2]) == [7, 1, 1]
    for extent, factors in [(24, [2, 1, 4, 2]), (20, [1, 1, 8, 2]), (7, [1, 4, 2]), (64, [1, 64])]:
        assert int(np.prod(transfer.fit_tile(extent, factors))) == extent


@pytest.mark.parametrize("rows", [1, 24, 48])
def test_transferred_candidates_build_and_compute_the_kernel(rows, database, target):
    import tvm

    mod = _matmul(rows)
    postprocs = _context(mod, target).space_generator.postprocs
    candidates = transfer.seed_candidates(mod, database, postprocs, limit=4)
    assert candidates, "a matmul of another row count has the same signature"
    rng = np.random.default_rng(rows)
    a = rng.standard_normal((rows, 64)).astype("float32")
    b = rng.standard_normal((64, 32)).astype("float32")
    for candidate in candidates:
        for inst in candidate.sch.trace.insts:
            if inst.kind.name == "SamplePerfectTile":  # still a sampled decision the search can mutate
                assert candidate.sch.trace.decisions[inst] is not None
        lib = tvm.tirx.build(candidate.sch.mod, target=target.target)
        out = tvm.runtime.tensor(np.zeros((rows, 32), "float32"))
        lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
        np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-4, atol=1e-4)


def test_nothing_transfers_to_another_kernel_family(database, target):
    mod = _matmul(16, relu=True)  # one more block: another signature
    assert transfer.signature(mod) != transfer.signature(_matmul(16))
    assert transfer.similar_records(mod, database) == []
    assert transfer.seed_candidates(mod, database, _context(mod, target).space_generator.postprocs, limit=4) == []


def test_same_task_is_not_its_own_source(database):
    assert transfer.similar_records(_matmul(16), database) == []


def test_nearest_shapes_come_first():
    assert transfer.distance(transfer.shape(_matmul(24)), transfer.shape(_matmul(16))) < transfer.distance(transfer.shape(_matmul(128)), transfer.shape(_matmul(16)))


def test_transfer_batch_is_filled_from_the_design_space(database, target):
    mod = _matmul(40)
    context = _context(mod, target)
    space = context.space_generator.generate_design_space(mod)
    postprocs = context.space_generator.postprocs
    alone = transfer.seed_candidates(mod, database, postprocs, limit=8)
    filled = transfer.seed_candidates(mod, database, postprocs, limit=8, space=space, seed=1)
    assert len(filled) == 8 > len(alone) >= 1
    assert [str(c.sch.trace) for c in filled[: len(alone)]] == [str(c.sch.trace) for c in alone]  # transferred first
    assert len({str(c.sch.trace) for c in filled}) == 8
    other = _matmul(16, relu=True)  # nothing transfers: no batch at all, not a random one
    other_context = _context(other, target)
    assert transfer.seed_candidates(other, database, other_context.space_generator.postprocs, 8, other_context.space_generator.generate_design_space(other)) == []


def test_transferred_candidates_are_measured(database, target):
    """The seeded batch is built and run like the search's own (a wrong device name once made
    every seeded run fail, spending a batch per new kernel on nothing)."""
    from tvm.s_tir import meta_schedule as ms

    from relaxtune.config import TuneConfig
    from relaxtune.schedules.builder import make_builder, make_runner

    mod = _matmul(24)
    context = _context(mod, target)
    candidates = transfer.seed_candidates(mod, database, context.space_generator.postprocs, limit=2)
    config = TuneConfig(build_workers=1)
    builder = make_builder(config)
    builder.start()
    try:
        db = ms.database.MemoryDatabase()
        builds, runs = transfer.measure(candidates, context, builder, make_runner(config), db)
    finally:
        builder.shutdown()
    assert [b.error_msg for b in builds] == [None] * len(candidates)
    assert [r.error_msg for r in runs] == [None] * len(candidates)
    assert all(0 < float(s) < 1 for r in runs for s in r.run_secs)
    assert len(db.get_all_tuning_records()) == len(candidates)


def test_a_trace_that_fails_to_replay_is_skipped(target):
    """A sketch that does not fit the module (TVM raises InternalError) gives no candidate: the
    except clause once named tvm.error.TVMError, which TVM 0.27 lacks, and crashed the job."""
    import tvm
    from tvm import te

    source = _matmul(16)
    sketch = _context(source, target).space_generator.generate_design_space(source)[0]
    a = te.placeholder((16, 64), name="A")
    relu = te.compute((16, 64), lambda i, j: tvm.tirx.max(a[i, j], tvm.tirx.const(0, "float32")), name="relu")
    other = tvm.IRModule({"main": te.create_prim_func([a, relu]).with_attr("global_symbol", "main")})
    assert transfer._sample(sketch, other, _context(other, target).space_generator.postprocs, seed=1) is None
