"""`relaxtune cache ls | show | merge | prune` on small synthetic caches."""

from __future__ import annotations

import json

import pytest
import tvm

from relaxtune.__main__ import main
from relaxtune.errors import UserError
from relaxtune.schedules import cache_tools, task_index
from relaxtune.schedules.database import CacheDatabase
from relaxtune.schedules.tasks import workload_key

from .test_database import _record, add_one


@pytest.fixture()
def cache(tmp_path):
    folder = tmp_path / "cache" / "llvm-test-0"
    db = CacheDatabase(folder, writable=True)
    for secs in (3e-6, 1e-6, 2e-6):
        db.commit_tuning_record(_record(db, secs))
    key = workload_key(tvm.IRModule({"main": add_one}))
    task_index.append(
        folder, [{"key": key, "kernel": "add_one", "workload": "toy", "bucket": {"n": [1, 16, 16]}, "rule_us": 5.0}]
    )
    return tmp_path / "cache"


def test_ls_rows_and_json(cache, tmp_path, capsys):
    rows = cache_tools.list_records(cache)
    assert len(rows) == 1
    row = rows[0]
    assert row["kernel"] == "add_one" and row["trials"] == 3 and row["best_us"] == pytest.approx(1.0)
    assert row["bucket"] == {"n": [1, 16, 16]} and row["rule_us"] == 5.0
    out = tmp_path / "ls.json"
    assert main(["cache", "ls", "--cache", str(cache), "--json", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert {"kernel", "target", "bucket", "best_us"} <= set(records[0])
    assert "add_one" in capsys.readouterr().out


def test_show_names_the_best_record(cache):
    text = cache_tools.show(cache, "add_one")
    assert "best 1.0" in text and "sch.split" in text and "T.prim_func" in text
    with pytest.raises(UserError, match="'nope'"):
        cache_tools.show(cache, "nope")


def test_merge_adds_only_new_records(cache, tmp_path):
    dest = tmp_path / "merged"
    assert cache_tools.merge([cache], dest) == 3
    assert cache_tools.merge([cache], dest) == 0
    assert cache_tools.list_records(dest)[0]["kernel"] == "add_one"


def test_prune_keeps_the_best_and_a_backup(cache):
    assert cache_tools.prune(cache, keep=1) == (3, 1)
    folder = next(cache.iterdir())
    rows = cache_tools.list_records(cache)
    assert rows[0]["trials"] == 1 and rows[0]["best_us"] == pytest.approx(1.0)
    assert (folder / "database_tuning_record.json.bak").read_text().count("\n") == 3
    with pytest.raises(UserError, match="--keep 0"):
        cache_tools.prune(cache, keep=0)
