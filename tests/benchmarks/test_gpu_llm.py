"""benchmarks/gpu_llm.py's every step on the CPU (`--device cpu --model tiny`): the random checkpoint, relaxtune's
build of it through hf:DIR, the same weights in transformers, the token check and the interleaved timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("transformers")


def test_cpu_path_runs_and_agrees_with_transformers(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_llm.py"), "--out", str(out), "--work", str(tmp_path)]
    command += ["--device", "cpu", "--model", "tiny", "--modes", "eager", "--prefill", "8,16", "--decode", "16"]
    command += ["--steps", "4", "--rounds", "1"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((out / "gpu_llm.json").read_text())
    assert results["errors"] == {}
    assert set(results["medians"]) == {"relaxtune", "transformers eager"}
    for system in results["medians"].values():
        assert set(system["prefill"]) == {"8", "16"} and set(system["decode"]) == {"16"}
        assert all(v > 0 for per in system.values() for v in per.values())
    # float32 both: the same greedy tokens and next-token logits, from the same checkpoint
    ours = results["agreement"]["relaxtune"]
    assert ours["greedy_same_prefix"] == 32
    same = ours["vs_transformers_same_dtype"]
    assert same["argmax_agree"] == same["steps"] == 33 and same["rel_err"] < 1e-4
    assert results["weight_bytes"] > 0 and results["copy_GBps"] > 0
    text = (out / "gpu_llm.md").read_text()
    assert "| relaxtune |" in text and "x floor" in text and "| relaxtune | 32 |" in text
