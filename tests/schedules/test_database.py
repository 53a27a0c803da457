"""The tuning cache: records survive, damage is reported and skipped, nothing is overwritten."""

from __future__ import annotations

import multiprocessing

import pytest
import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.script import tirx as T

from relaxtune.errors import UserError
from relaxtune.schedules import cache
from relaxtune.schedules.database import RECORDS, WORKLOADS, CacheDatabase


@T.prim_func(s_tir=True)
def add_one(a: T.Buffer((16,), "float32"), b: T.Buffer((16,), "float32")):
    T.func_attr({"global_symbol": "main", "tirx.noalias": True})
    for i in range(16):
        with T.sblock("b"):
            vi = T.axis.spatial(16, i)
            b[vi] = a[vi] + T.float32(1)


def _record(db, secs: float):
    mod = tvm.IRModule({"main": add_one})
    sch = tvm.s_tir.Schedule(mod)
    (loop,) = sch.get_loops(sch.get_sblock("b"))
    sch.split(loop, [None, 4])
    workload = db.commit_workload(mod)
    return ms.database.TuningRecord(
        sch.trace,
        workload,
        [tvm.tirx.FloatImm("float64", secs)],
        tvm.target.Target("llvm"),
        ms.arg_info.ArgInfo.from_prim_func(add_one),
    )


def test_records_persist_and_reopen(tmp_path):
    db = CacheDatabase(tmp_path, writable=True)
    for secs in (3e-6, 1e-6, 2e-6):
        db.commit_tuning_record(_record(db, secs))
    again = CacheDatabase(tmp_path)
    assert len(again.get_all_tuning_records()) == 3
    best = again.records_for(tvm.IRModule({"main": add_one}))[0]
    assert float(best.run_secs[0]) == pytest.approx(1e-6)
    assert again.problems == []
    # the files stay readable by stock MetaSchedule
    assert len(ms.database.JSONDatabase(work_dir=str(tmp_path)).get_all_tuning_records()) == 3


def test_packed_files_are_read_and_unpacked_by_a_writer(tmp_path):
    import lzma

    db = CacheDatabase(tmp_path, writable=True)
    for secs in (3e-6, 1e-6):
        db.commit_tuning_record(_record(db, secs))
    for name in (WORKLOADS, RECORDS):  # as `xz -9 NAME` leaves them
        (tmp_path / (name + ".xz")).write_bytes(lzma.compress((tmp_path / name).read_bytes()))
        (tmp_path / name).unlink()
    packed = CacheDatabase(tmp_path)
    assert len(packed.get_all_tuning_records()) == 2 and packed.problems == []
    assert float(packed.records_for(tvm.IRModule({"main": add_one}))[0].run_secs[0]) == pytest.approx(1e-6)
    assert not (tmp_path / WORKLOADS).exists()  # reading leaves the folder as it is
    writer = CacheDatabase(tmp_path, writable=True)
    writer.commit_tuning_record(_record(writer, 5e-7))
    assert sorted(p.name for p in tmp_path.iterdir() if "json" in p.name) == sorted([WORKLOADS, RECORDS])
    again = CacheDatabase(tmp_path)
    assert len(again.get_all_tuning_records()) == 3 and again.problems == []
    assert (tmp_path / WORKLOADS).read_text().count("\n") == 1  # the workload line reused, not written twice


def test_damaged_and_half_written_lines_are_reported_and_skipped(tmp_path):
    db = CacheDatabase(tmp_path, writable=True)
    db.commit_tuning_record(_record(db, 1e-6))
    lines = (tmp_path / RECORDS).read_text()
    with open(tmp_path / RECORDS, "a") as f:
        f.write("this is not json\n")
        f.write(lines.strip()[: len(lines) // 2])  # an interrupted append: no newline
    size_before = (tmp_path / RECORDS).stat().st_size
    writer = CacheDatabase(tmp_path, writable=True)  # closes the partial line, keeps every byte
    assert (tmp_path / RECORDS).stat().st_size == size_before + 1
    assert len(writer.problems) == 2 and all(RECORDS in p for p in writer.problems)
    assert ":2:" in writer.problems[0] and ":3:" in writer.problems[1]
    writer.commit_tuning_record(_record(writer, 5e-7))
    reader = CacheDatabase(tmp_path)
    assert len(reader.get_all_tuning_records()) == 2
    assert len(reader.problems) == 2


def test_record_of_a_damaged_workload_is_reported(tmp_path):
    db = CacheDatabase(tmp_path, writable=True)
    db.commit_tuning_record(_record(db, 1e-6))
    (tmp_path / WORKLOADS).write_text('["123", "not base64 IR"]\n')
    reader = CacheDatabase(tmp_path)
    assert len(reader.get_all_tuning_records()) == 0
    assert any("workload line" in p for p in reader.problems)


def _write_records(path, secs, count, start):
    db = CacheDatabase(path, writable=True)
    start.wait(60)
    for i in range(count):
        db.commit_tuning_record(_record(db, secs + i * 1e-9))


def test_concurrent_writers_leave_every_record(tmp_path):
    start = multiprocessing.Event()
    jobs = [multiprocessing.Process(target=_write_records, args=(tmp_path, secs, 25, start)) for secs in (1e-6, 2e-6)]
    for job in jobs:
        job.start()
    start.set()
    for job in jobs:
        job.join(120)
        assert job.exitcode == 0
    reader = CacheDatabase(tmp_path)
    assert reader.problems == []
    assert len(reader.get_all_tuning_records()) == 50
    assert (tmp_path / WORKLOADS).read_text().count("\n") == 1  # the shared workload is written once


def test_manifest_refuses_another_target(tmp_path, target):
    from relaxtune import targets

    cache.write_manifest(tmp_path, target, "mlp", {"trials_budget": 8})
    assert cache.read_manifest(tmp_path)["workloads"]["mlp"]["trials_budget"] == 8
    other = targets.resolve('{"kind": "llvm", "mcpu": "skylake", "num-cores": 4}')
    with pytest.raises(UserError, match="holds records for target"):
        cache.check_compatible(tmp_path, other)
    (tmp_path / cache.MANIFEST).write_text("{broken")
    with pytest.raises(UserError, match="damaged"):
        cache.read_manifest(tmp_path)
    assert (tmp_path / cache.MANIFEST).read_text() == "{broken"
