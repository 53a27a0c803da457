"""Transfer: the best records of a similar task, refitted to a new shape or carried across fused
element-wise blocks, give valid candidates."""

from __future__ import annotations

import numpy as np
import pytest

from relaxtune.schedules import transfer


def _matmul(n: int, relu: bool = False, add: bool = False, depth: int = 64):
    """(n, depth) x (depth, 32), optionally with a fused relu or residual add (a block "T_add")."""
    import tvm
    from tvm import te, topi

    a = te.placeholder((n, depth), name="a")
    b = te.placeholder((depth, 32), name="b")
    k = te.reduce_axis((0, depth), name="k")
    c = te.compute((n, 32), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="matmul")
    out, extra = (topi.nn.relu(c) if relu else c), []
    if add:
        r = te.placeholder((n, 32), name="r")
        out, extra = te.compute((n, 32), lambda i, j: out[i, j] + r[i, j], name="T_add"), [r]
    func = te.create_prim_func([a, b, *extra, out]).with_attr("global_symbol", "main").with_attr("tirx.noalias", True)
    return tvm.IRModule({"main": func})


def _context(mod, target):
    from tvm.s_tir import meta_schedule as ms

    return ms.TuneContext(
        mod=mod,
        target=target.target,
        space_generator="post-order-apply",
        search_strategy="evolutionary",
        task_name="t",
        rand_state=3,
    )


@pytest.fixture(scope="module")
def database(target):
    """Records of a 16-row matmul: design-space samples of three seeds, with made-up times."""
    from tvm.s_tir import meta_schedule as ms

    source = _matmul(16)
    db = ms.database.MemoryDatabase()
    workload = db.commit_workload(source)
    args = ms.arg_info.ArgInfo.from_prim_func(source["main"])
    for seed in range(3):
        context = ms.TuneContext(
            mod=source,
            target=target.target,
            space_generator="post-order-apply",
            search_strategy="evolutionary",
            task_name="s",
            rand_state=seed + 1,
        )
        for i, sch in enumerate(context.space_generator.generate_design_space(source)):
            db.commit_tuning_record(
                ms.database.TuningRecord(sch.trace, workload, [1e-5 / (seed + i + 1)], target.target, args)
            )
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


def test_nothing_transfers_to_another_main_computation(database, target):
    mod = _matmul(16, add=True, depth=32)  # another block structure and another reduction length
    assert transfer.signature(mod) != transfer.signature(_matmul(16))
    assert transfer.core(mod) != transfer.core(_matmul(16)) and transfer.core(_matmul(24)) != transfer.core(_matmul(16))
    assert transfer.similar_records(mod, database) == []
    assert transfer.seed_candidates(mod, database, _context(mod, target).space_generator.postprocs, limit=4) == []


def _records(source, target, seeds: int = 3):
    """A database holding design-space samples of `source` with made-up times."""
    from tvm.s_tir import meta_schedule as ms

    db = ms.database.MemoryDatabase()
    workload = db.commit_workload(source)
    args = ms.arg_info.ArgInfo.from_prim_func(source["main"])
    for seed in range(seeds):
        context = ms.TuneContext(
            mod=source,
            target=target.target,
            space_generator="post-order-apply",
            search_strategy="evolutionary",
            task_name="s",
            rand_state=seed + 1,
        )
        for i, sch in enumerate(context.space_generator.generate_design_space(source)):
            db.commit_tuning_record(
                ms.database.TuningRecord(sch.trace, workload, [1e-5 / (seed + i + 1)], target.target, args)
            )
    return db


@pytest.mark.parametrize("source, dest", [("add", "plain"), ("plain", "add"), ("relu", "add")])
def test_traces_carry_across_fused_epilogues_and_compute_the_kernel(source, dest, target):
    """A matmul's traces carried to the same matmul with another fused element-wise epilogue: the
    main block keeps its tiling, instructions on absent blocks are dropped, and the kernel built
    from each candidate computes its own function."""
    import tvm

    kinds = {"plain": {}, "add": {"add": True}, "relu": {"relu": True}}
    src, mod = _matmul(16, **kinds[source]), _matmul(16, **kinds[dest])
    assert transfer.signature(src) != transfer.signature(mod) and transfer.core(src) == transfer.core(mod)
    db = _records(src, target)
    candidates = transfer.seed_candidates(mod, db, _context(mod, target).space_generator.postprocs, limit=4)
    assert len(candidates) >= 2
    tile = lambda trace: [list(trace.decisions[i]) for i in trace.insts if i.kind.name == "SamplePerfectTile"]  # noqa: E731
    sources = [tile(r.trace) for r in transfer.similar_records(mod, db)]
    rng = np.random.default_rng(0)
    a, b, r = (rng.standard_normal(s).astype("float32") for s in [(16, 64), (64, 32), (16, 32)])
    want = {"plain": a @ b, "add": a @ b + r}[dest]
    for candidate in candidates:
        assert tile(candidate.sch.trace) in sources  # the main block's tiling, as the search sampled it
        lib = tvm.tirx.build(candidate.sch.mod, target=target.target)
        out = tvm.runtime.tensor(np.zeros((16, 32), "float32"))
        lib["main"](*[tvm.runtime.tensor(x) for x in ([a, b, r] if dest == "add" else [a, b])], out)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)


def test_carry_drops_what_names_an_absent_block(target):
    from tvm.s_tir import meta_schedule as ms

    fused = _matmul(16, add=True)
    context = ms.TuneContext(
        mod=fused,
        target=target.target,
        space_generator="post-order-apply",
        search_strategy="evolutionary",
        task_name="s",
        rand_state=1,
    )
    for sketch in context.space_generator.generate_design_space(fused):
        carried = transfer.carry(sketch.trace, _matmul(16))
        names = [i.kind.name for i in carried.insts]
        assert "GetConsumers" not in names and names.count("SamplePerfectTile") == 3
        assert len(carried.insts) < len(sketch.trace.insts)


def test_same_task_is_not_its_own_source(database):
    assert transfer.similar_records(_matmul(16), database) == []


def test_nearest_shapes_come_first():
    assert transfer.distance(transfer.shape(_matmul(24)), transfer.shape(_matmul(16))) < transfer.distance(
        transfer.shape(_matmul(128)), transfer.shape(_matmul(16))
    )


def test_transfer_gives_at_most_the_limit_and_nothing_from_another_computation(database, target):
    mod = _matmul(40)
    postprocs = _context(mod, target).space_generator.postprocs
    two = transfer.seed_candidates(mod, database, postprocs, limit=2)
    assert len(two) == 2 and len({str(c.sch.trace) for c in two}) == 2
    other = _matmul(16, add=True, depth=32)  # another main computation: nothing transfers
    assert transfer.seed_candidates(other, database, _context(other, target).space_generator.postprocs, 8) == []


def test_each_space_takes_its_own_records(database, target):
    """The rules' space takes a rules' record as the same rule's point with its decisions, never a generic
    trace; the generic space takes generic traces only."""
    from tvm.s_tir import meta_schedule as ms

    from relaxtune.schedules import space
    from relaxtune.schedules.rules import decisions

    source = _matmul(16)
    rules_point = space.from_decisions(
        source, target.target, "Matmul", {"rows": 8, "units": 1, "pack_b": 1, "k_unroll": 2}, space.postprocs()
    )
    db = ms.database.MemoryDatabase()
    workload = db.commit_workload(source)
    for record in database.get_all_tuning_records():
        db.commit_tuning_record(record)
    db.commit_tuning_record(
        ms.database.TuningRecord(rules_point.sch.trace, workload, [1e-7], target.target, rules_point.args_info)
    )
    mod = _matmul(40)
    rules = transfer.seed_candidates(mod, db, space.postprocs(), 8, target.target, "rules")
    assert [decisions.read(c.sch.trace) for c in rules] == [decisions.read(rules_point.sch.trace)]
    generic = transfer.seed_candidates(mod, db, space.postprocs(), 8, target.target, "generic")
    assert generic and all(decisions.read(c.sch.trace) is None for c in generic)
    both = transfer.seed_candidates(mod, db, space.postprocs(), 8, target.target, "both")
    assert len(both) == len(generic) + 1


def test_transferred_candidates_build_and_run(database, target):
    """Seeds are built and run like the search's own candidates (a wrong device name once made every
    seeded run fail, spending a batch per new kernel on nothing)."""
    from relaxtune.config import TuneConfig
    from relaxtune.schedules.builder import build_and_run, make_builder, make_runner

    mod = _matmul(24)
    candidates = transfer.seed_candidates(mod, database, _context(mod, target).space_generator.postprocs, limit=2)
    config = TuneConfig(build_workers=1)
    builder = make_builder(config)
    builder.start()
    try:
        builds, runs = build_and_run(
            [(c.sch.mod, c.args_info) for c in candidates], target.target, builder, make_runner(config)
        )
    finally:
        builder.shutdown()
    assert [b.error_msg for b in builds] == [None] * len(candidates)
    assert [r.error_msg for r in runs] == [None] * len(candidates)
    assert all(0 < float(s) < 1 for r in runs for s in r.run_secs)


def test_a_trace_that_fails_to_replay_is_skipped(target):
    """A sketch that does not fit the module (TVM raises InternalError) gives no candidate: the
    except clause once named tvm.error.TVMError, which TVM 0.27 lacks, and crashed the job."""
    import tvm
    from tvm import te
    from tvm.s_tir import meta_schedule as ms

    source = _matmul(16)
    sketch = _context(source, target).space_generator.generate_design_space(source)[0]
    db = ms.database.MemoryDatabase()
    args = ms.arg_info.ArgInfo.from_prim_func(source["main"])
    record = ms.database.TuningRecord(sketch.trace, db.commit_workload(source), [1e-5], target.target, args)
    a = te.placeholder((16, 64), name="A")
    relu = te.compute((16, 64), lambda i, j: tvm.tirx.max(a[i, j], tvm.tirx.const(0, "float32")), name="relu")
    other = tvm.IRModule({"main": te.create_prim_func([a, relu]).with_attr("global_symbol", "main")})
    assert transfer.adapt(record, other, _context(other, target).space_generator.postprocs) is None
