"""A kernel that fails in codegen is one line naming it, never a TVM traceback."""

from __future__ import annotations

import os

from relaxtune.__main__ import main

BAD = os.path.join(os.path.dirname(__file__), "data", "bad_kernel.py")


def test_a_kernel_that_fails_to_build_is_named_in_one_line(capsys, tmp_path):
    assert main(["compile", BAD, "--no-cache", "-o", str(tmp_path / "bad.so")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "kernel copy_rows" in err[0] and "failed to build" in err[0] and "extent 0" in err[0], err[0]


WRONG_REFERENCE = """
import dataclasses
import os

from relaxtune.workloads import load


def workload():
    w = load(os.path.join({data!r}, "user_decode.py"))
    return dataclasses.replace(w, reference=lambda inputs, params: w.reference(inputs, params) + 1.0)
"""


def test_a_build_that_disagrees_with_its_reference_is_not_written(capsys, tmp_path):
    """What an importer that computes the model wrong looks like to compile (hf:falcon through TVM's importer)."""
    source = tmp_path / "off_by_one.py"
    data = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workloads", "data")
    source.write_text(WRONG_REFERENCE.format(data=data))
    assert main(["compile", str(source), "--no-cache", "-o", str(tmp_path / "w.so")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "disagrees with its reference at m=3" in err[0], err
    assert not list(tmp_path.glob("w.*"))
