"""Every benchmark starts from the installed package, with no path manipulation: `--help` in a fresh process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if "argparse" in p.read_text())

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_benchmark_starts(script, tmp_path):
    # from another folder: the checkout's relaxtune/ must not be what gets imported
    done = subprocess.run(
        [sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()


def test_no_benchmark_edits_the_import_path():
    for script in (ROOT / "benchmarks").glob("*.py"):
        text = script.read_text()
        assert "sys.path.insert" not in text and "__path__.append" not in text, script.name
