"""A tuning job killed mid-run keeps every committed record; the next run continues from them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from relaxtune.schedules.database import RECORDS, CacheDatabase

SMALL = "hidden=64,ffn=128,max_seq=64,max_batch=2"
pytestmark = pytest.mark.integration


def _records(folder):
    path = folder / RECORDS
    return path.read_text().count("\n") if path.exists() else 0


def test_kill_then_continue(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "relaxtune",
        "tune",
        "mlp",
        "--config",
        SMALL,
        "--cache",
        str(tmp_path),
        "--no-progress",
    ]
    proc = subprocess.Popen([*cmd, "--trials", "24"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    folder = None
    while time.time() < deadline and proc.poll() is None:
        folders = [p for p in tmp_path.iterdir() if p.is_dir()]
        if folders and _records(folders[0]) >= 8:
            folder = folders[0]
            break
        time.sleep(0.2)
    assert folder is not None, "no record was committed in time"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = CacheDatabase(folder)
    committed = len(kept.get_all_tuning_records())
    assert committed >= 8 and len(kept.problems) <= 1  # at most the line being written
    report = tmp_path / "tune.json"
    subprocess.run([*cmd, "--trials", "24", "--json", str(report)], check=True, stdout=subprocess.DEVNULL)
    result = json.loads(report.read_text())
    assert result["trials_cached"] == committed
    assert result["trials_run"] == 24 - committed
