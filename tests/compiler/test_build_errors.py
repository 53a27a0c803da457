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
