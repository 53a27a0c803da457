"""benchmarks/gpu_decode_steps.py on the CPU (`--device cpu --model tiny`): both ways of passing the token ids time
their steps, the sequence keeps its length between samples, and the JSON holds the medians and their ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("transformers")


def test_cpu_path_times_both_ways(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_decode_steps.py"), "--out", str(out)]
    command += ["--work", str(tmp_path), "--device", "cpu", "--model", "tiny", "--context", "32"]
    command += ["--steps", "4", "--rounds", "2"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((out / "decode_steps.json").read_text())
    assert set(result["median_ms"]) == {"buffer", "fresh"}
    assert all(len(s) == 2 and min(s) > 0 for s in result["samples_ms"].values())
    assert result["fresh_over_buffer"] == result["median_ms"]["fresh"] / result["median_ms"]["buffer"]
