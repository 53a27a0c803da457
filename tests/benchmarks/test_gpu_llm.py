"""benchmarks/gpu_llm.py's every step on the CPU (`--device cpu --model tiny`): the random checkpoint, relaxtune's
build of it through hf:DIR, the same weights in transformers, the token check and the interleaved timings; with
`--quantize f16,q4f16`, relaxtune's 4-bit build (q4f32 on the CPU) against transformers on the requantized copy."""

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
    command += ["--steps", "4", "--rounds", "1", "--quantize", "f16,q4f16"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((out / "gpu_llm.json").read_text())
    assert results["errors"] == {}
    assert set(results["medians"]) == {"relaxtune", "transformers eager", "relaxtune q4f32", "transformers eager q4f32"}
    assert results["weights_of"]["relaxtune q4f32"] == results["weights_of"]["transformers eager q4f32"] == "q4f32"
    for system in results["medians"].values():
        assert set(system["prefill"]) == {"8", "16"} and set(system["decode"]) == {"16"}
        assert all(v > 0 for per in system.values() for v in per.values())
    # float32 both: the same greedy tokens and next-token logits, from the same checkpoint
    # (4-bit: relaxtune's kernels and transformers on the dequantized copy compute with the same weights)
    for name in ("relaxtune", "relaxtune q4f32"):
        ours = results["agreement"][name]
        assert ours["greedy_same_prefix"] == 32, name
        same = ours["vs_transformers_same_dtype"]
        assert same["argmax_agree"] == same["steps"] == 33 and same["rel_err"] < 1e-4, name
    assert results["weight_bytes"] > 0 and results["copy_GBps"] > 0
    assert 0 < results["quantized_bytes"]["q4f32"] < results["weight_bytes"] / 3
    text = (out / "gpu_llm.md").read_text()
    assert "| relaxtune |" in text and "x floor" in text and "| relaxtune | 32 |" in text
    assert "| relaxtune q4f32 | 32 |" in text and "q4f32 weights |" in text
