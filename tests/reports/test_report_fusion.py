"""`relaxtune report fusion`: kernels and intermediate bytes, stock vs relaxtune fusion, in text and --json."""

from __future__ import annotations

import json

import pytest

from relaxtune.__main__ import main

SMALL = "hidden=64,heads=4,kv_heads=2,ffn=128,max_seq=64,max_batch=2"


@pytest.fixture(scope="module")
def llama_report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fusion")
    out = folder / "fusion.json"
    code = main(
        [
            "report",
            "fusion",
            "llama-block",
            "--config",
            SMALL,
            "--shape",
            "n=40",
            "--shape",
            "b=2",
            "--json",
            str(out),
            "--out",
            str(folder),
        ]
    )
    assert code == 0
    return json.loads(out.read_text()), folder


def test_json_has_both_fusions(llama_report):
    report, _ = llama_report
    for fusion in ("stock", "relaxtune"):
        assert isinstance(report[fusion]["kernels"], int) and isinstance(report[fusion]["intermediate_bytes"], int)
        assert report[fusion]["function"] == "main_n33_64_b1_2"  # the bucket that serves n=40
    assert report["shape"] == {"b": 2, "n": 40}


def test_relaxtune_has_fewer_kernels_and_bytes(llama_report):
    report, _ = llama_report
    stock, ours = report["stock"], report["relaxtune"]
    # q/k/v merged (-2 kernels), gate/up with their silu-multiply in one kernel (-1 kernel, -1 (b, n, ffn) tensor)
    assert ours["kernels"] <= stock["kernels"] - 3
    assert stock["intermediate_bytes"] - ours["intermediate_bytes"] >= 2 * 40 * 128 * 4


def test_kernels_list_the_ops_they_hold_and_bytes_add_up(llama_report):
    report, _ = llama_report
    rows = report["relaxtune"]["functions"][report["relaxtune"]["function"]]
    swiglu = [r for r in rows if r["ops"] == ["matmul", "matmul", "silu", "multiply"]]
    assert len(swiglu) == 1 and swiglu[0]["bytes"] == 2 * 40 * 128 * 4  # read by the down projection
    assert rows[-1]["intermediate"] is False and rows[-1]["bytes"] == 0  # the block's output is not an intermediate
    assert sum(r["bytes"] for r in rows) == report["relaxtune"]["intermediate_bytes"]
    # weight packing runs once at load, in main_transform_params
    load_ops = [op for r in report["relaxtune"]["functions"]["main_transform_params"] for op in r["ops"]]
    assert "concatenate" in load_ops and "stack" in load_ops


def test_markdown_is_printed_and_saved(llama_report, capsys):
    _, folder = llama_report
    text = (folder / "fusion-llama-block-b2-n40.md").read_text()
    assert "| stock |" in text and "| relaxtune |" in text and "matmul + matmul + silu + multiply" in text


def test_gpt2_block_never_more_kernels(tmp_path):
    out = tmp_path / "gpt2.json"
    assert (
        main(
            [
                "report",
                "fusion",
                "gpt2-block",
                "--config",
                "hidden=64,heads=4,max_seq=64",
                "--shape",
                "n=8",
                "--json",
                str(out),
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["relaxtune"]["kernels"] <= report["stock"]["kernels"]
    assert report["relaxtune"]["intermediate_bytes"] <= report["stock"]["intermediate_bytes"]


def test_bad_shape_is_one_line(capsys, tmp_path):
    code = main(["report", "fusion", "llama-block", "--config", SMALL, "--shape", "n=999", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "n" in err[0]
