"""Tuning through TVM's RPC tracker on loopback: two servers, one of them killed mid-run, no tracker.

Every tracker and server is started here on 127.0.0.1 with free ports and stopped by the fixture.
"""

from __future__ import annotations

import threading
import time

import pytest

from relaxtune import api
from relaxtune.__main__ import main
from relaxtune.config import JobConfig, TuneConfig
from relaxtune.errors import UserError
from relaxtune.schedules import cache
from relaxtune.schedules.builder import make_runner
from relaxtune.schedules.database import CacheDatabase
from relaxtune.schedules.rpc import LocalCluster, TrackerRunner, check_tracker, free_port

pytestmark = pytest.mark.integration
KEY = "relaxtune-test-cpu"


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster({KEY: 2}, timeout_s=60) as running:
        yield running


def _job(tmp_path, cluster) -> JobConfig:
    return JobConfig(
        cache_dir=tmp_path, tune=TuneConfig(trials=16, trials_per_iter=8, rpc_tracker=cluster.address, device_key=KEY)
    )


def _check_cache(folder, trials: int, failed: int) -> None:
    """The folder reads back cleanly: one record per trial, measured times except for the failed
    ones, which MetaSchedule commits with its failure time (1e10 s) so they are not measured again."""
    database = CacheDatabase(folder)
    records = database.get_all_tuning_records()
    assert database.problems == []
    assert len(records) == trials
    secs = sorted(max(float(s) for s in r.run_secs) for r in records)
    assert all(0 < s < 1 for s in secs[: trials - failed]) and secs[trials - failed :] == [1e10] * failed


@pytest.mark.parametrize(
    "address", ["localhost", "127.0.0.1:", ":9190", "127.0.0.1:http", "127.0.0.1:0", "127.0.0.1:70000"]
)
def test_malformed_tracker_address_is_refused(address):
    with pytest.raises(UserError, match="HOST:PORT") as err:
        TuneConfig(rpc_tracker=address, device_key=KEY)
    assert repr(address) in str(err.value)


def test_tracker_and_key_come_together():
    with pytest.raises(UserError, match="--device-key"):
        TuneConfig(rpc_tracker="127.0.0.1:9190")
    with pytest.raises(UserError, match="--rpc"):
        TuneConfig(device_key=KEY)
    assert TuneConfig(rpc_tracker="node7:9190", device_key=KEY).tracker_address == ("node7", 9190)
    assert TuneConfig().tracker_address is None


def test_unreachable_tracker_is_one_line_naming_it(capsys):
    address = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(UserError) as err:
        make_runner(TuneConfig(rpc_tracker=address, device_key=KEY))
    message = str(err.value)
    assert address in message and "unreachable" in message and "\n" not in message
    assert time.monotonic() - start < 10
    code = main(
        ["tune", "mlp", "--config", "hidden=64,ffn=128,max_seq=64,max_batch=2", "--rpc", address, "--device-key", KEY]
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and address in lines[0], lines


def test_runner_measures_on_the_servers_of_the_key(cluster):
    runner = make_runner(TuneConfig(rpc_tracker=cluster.address, device_key=KEY))
    assert isinstance(runner, TrackerRunner)
    assert runner.workers == 2  # one connection per registered server
    assert (runner.rpc_config.tracker_host, runner.rpc_config.tracker_port, runner.rpc_config.tracker_key) == (
        "127.0.0.1",
        int(cluster.address.rpartition(":")[2]),
        KEY,
    )
    with pytest.raises(UserError) as err:
        check_tracker(TuneConfig(rpc_tracker=cluster.address, device_key="no-such-key"), wait_s=0)
    assert "'no-such-key'" in str(err.value) and KEY in str(err.value) and cluster.address in str(err.value)


def test_a_batch_with_no_server_left_fails_at_once_with_the_reason(cluster):
    from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, RPCConfig, RunnerInput

    host, _, port = cluster.address.rpartition(":")
    runner = TrackerRunner(
        RPCConfig(host, int(port), "gone-key"), EvaluatorConfig(), workers=1, limit_s=5, server_wait_s=0
    )
    start = time.monotonic()
    results = [f.result() for f in runner.run([RunnerInput("/nonexistent/mod.so", "cpu", []) for _ in range(3)])]
    assert time.monotonic() - start < 5
    assert [r.run_secs for r in results] == [None] * 3
    assert all("no RPC server is registered under key 'gone-key'" in r.error_msg for r in results)


def test_tuning_through_two_servers_writes_a_readable_cache(cluster, tiny_mlp, target, tmp_path):
    result = api.tune(tiny_mlp, target, _job(tmp_path, cluster), progress=False)
    assert result.trials_run == 16 and result.failed == 0
    assert sum(t.trials for t in result.tasks) == 16
    assert any(t.best_us < float("inf") for t in result.tasks)
    _check_cache(cache.folder_for(tmp_path, target), 16, failed=0)


def test_a_server_killed_mid_run_costs_only_its_candidate(cluster, tiny_mlp, target, tmp_path):
    killed = threading.Event()

    def kill_first_server_mid_session():
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if cluster.in_session(KEY, 0):
                cluster.kill(KEY, 0)
                killed.set()
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_first_server_mid_session, daemon=True)
    killer.start()
    result = api.tune(tiny_mlp, target, _job(tmp_path, cluster), progress=False)
    killer.join(timeout=1)
    assert killed.is_set(), "the first server never served a session"
    cluster.wait_for({KEY: 1})  # the tracker dropped it; the other one is still there
    assert result.trials_run == 16  # the job went on with the other server
    # the candidate the dead server held (none when the kill fell between two candidates of its
    # session), counted by the progress bar and committed with MetaSchedule's failure time
    assert result.failed <= 1
    folder = cache.folder_for(tmp_path, target)
    _check_cache(folder, 16, failed=result.failed)
    if result.failed:
        logs = "".join(p.read_text() for p in (folder / "logs").glob("*task_*.log"))
        events = "".join(p.read_text() for p in (folder / "events").glob("*.jsonl"))
        assert "RPCRunner" in logs + events
