"""`relaxtune report memory`: the table, the four peaks in --json, the PNG; bad input is one line."""

from __future__ import annotations

import json

import pytest

from relaxtune.__main__ import main

SMALL = "hidden=64,heads=4,kv_heads=2,ffn=128,max_seq=64,max_batch=2"


@pytest.mark.parametrize("shape", ["n=1", "n=40", "n=64"])
def test_report_prints_writes_and_draws(capsys, tmp_path, shape):
    out = tmp_path / "json" / "memory.json"
    code = main(
        [
            "report",
            "memory",
            "llama-block",
            "--config",
            SMALL,
            "--shape",
            shape,
            "--shape",
            "b=2",
            "--json",
            str(out),
            "--out",
            str(tmp_path),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    peaks = report["peak_bytes"]
    assert set(peaks) >= {"no_reuse", "tvm", "relaxtune", "lower_bound"} and all(
        isinstance(v, int) for v in peaks.values()
    )
    assert (
        0 < peaks["relaxtune"] <= peaks["tvm"]
        and peaks["relaxtune"] <= 1.05 * peaks["lower_bound"] <= 1.05 * peaks["no_reuse"]
    )
    allocated = report["allocated_bytes"]  # both sized for the bucket's upper bounds
    assert peaks["relaxtune"] <= allocated["relaxtune"] <= allocated["tvm"] and peaks["tvm"] <= allocated["tvm"]
    assert report["problems"] == [] and report["shape"] == {"b": 2, "n": int(shape[2:])}
    tensors = report["tensors"]
    assert tensors and all(t["offset"] % 64 == 0 and t["first"] <= t["last"] and t["bytes"] > 0 for t in tensors)
    assert sum(t["bytes"] for t in tensors) == peaks["no_reuse"]
    assert (
        "| relaxtune PlanMemory |" in printed
        and "| TVM StaticPlanBlockMemory |" in printed
        and tensors[0]["name"] in printed
    )
    stem = tmp_path / f"memory-llama-block-b2-n{shape[2:]}"
    assert stem.with_suffix(".md").read_text().strip() in printed
    assert stem.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _error_line(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and "error:" in err[0]
    return err[0]


def test_bad_input_is_one_clear_line(capsys, tmp_path):
    line = _error_line(
        capsys,
        [
            "report",
            "memory",
            "mlp",
            "--config",
            "hidden=64,ffn=128,max_seq=64",
            "--shape",
            "n=65",
            "--out",
            str(tmp_path),
        ],
    )
    assert "n=65" in line and "[1, 64]" in line
    assert "'q'" in _error_line(capsys, ["report", "memory", "mlp", "--shape", "q=3", "--out", str(tmp_path)])
    line = _error_line(capsys, ["compile", "mlp", "--memory-planner", "greedy", "-o", str(tmp_path / "m.so")])
    assert "'greedy'" in line and "relaxtune, tvm" in line
