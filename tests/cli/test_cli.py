"""The CLI: bad input gets one line naming the value and what is allowed (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from relaxtune.__main__ import main

SMALL = "hidden=64,ffn=128,max_seq=64,max_batch=2"


def _error_line(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and "error:" in err[0]
    return err[0]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["tune", "nosuch-model"], ["'nosuch-model'", "llama-block", "mlp"]),
        (["tune", "mlp", "--target", "tpu"], ["'tpu'", "cpu", "cuda"]),
        (["tune", "mlp", "--target", "{bad json"], ["not valid JSON"]),
        (["tune", "mlp", "--config", "hidden"], ["'hidden'", "key=value"]),
        (["tune", "mlp", "--config", "heads=4"], ["'heads'", "hidden"]),
        (["tune", "mlp", "--config", "hidden=big"], ["hidden", "big"]),
        (["tune", "mlp", "--dtype", "int8"], ["int8", "float32"]),
        (["tune", "mlp", "--trials", "-1"], ["-1"]),
        (["tune", "mlp", "--time-limit", "-5"], ["--time-limit -5", "seconds"]),
        (["tune", "mlp", "--buckets", "n=abc"], ["n=abc", "NAME=TOP1"]),
        (["compile", "mlp", "-o", "x.txt"], ["x.txt", ".so"]),
        (["run", "missing/none.so"], ["missing/none.so", "does not exist"]),
        (["bench", "mlp", "--systems", "tensorrt"], ["tensorrt", "torch.compile"]),
        (["compile", "mlp", "-o", "x.so", "--paged-attention", "flashinfer"], ["'flashinfer'", "relaxtune", "tvm"]),
        (["bench", "mlp", "--config", SMALL, "--shape", "n=1,100"], ["n=100", "[1, 64]"]),
        (["bench", "mlp", "--config", SMALL, "--shape", "q=1"], ["'q'", "'b'"]),
    ],
)
def test_bad_input_is_one_clear_line(capsys, argv, words):
    line = _error_line(capsys, argv)
    for word in words:
        assert word in line, line


@pytest.mark.parametrize(
    "flags, expected",
    [
        ([], "default"),
        (["--no-flash-attention"], {"enabled": False}),
        (["--paged-attention", "relaxtune"], {}),
        (["--paged-attention", "tvm"], {"paged_decode": False, "paged_prefill_grid": False, "paged_prefill": False}),
        (
            ["--no-flash-attention", "--paged-attention", "tvm"],
            {"enabled": False, "paged_decode": False, "paged_prefill_grid": False, "paged_prefill": False},
        ),
    ],
)
def test_attention_flags_become_one_flash_attention_config(flags, expected):
    import argparse

    from relaxtune.cli import common
    from relaxtune.config import FlashAttention
    from relaxtune.relax_passes.pipeline import fusion_passes
    from relaxtune.targets import resolve

    parser = argparse.ArgumentParser()
    parser.add_argument("--buckets", action="append", default=[])
    parser.add_argument("--cache", default=None)
    common.add_gpu_options(parser)
    options = common.job_config(parser.parse_args(flags)).compile
    want = FlashAttention() if expected == "default" else FlashAttention(**expected)
    assert options.flash_attention == want
    names = {type(p).__name__ for p in fusion_passes(resolve("cuda:sm_90").target, {}, options)}
    paged = {"PagedDecodeCuda", "PagedPrefillGridCuda", "PagedPrefillFlashCuda"}
    assert names & paged == (set() if "tvm" in flags else paged)


def test_compile_in_an_empty_folder_is_a_rules_only_compile(capsys, caplog, tmp_path, monkeypatch):
    """No cache anywhere (an installed relaxtune used outside the repository): one warning, rules only."""
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.delenv("RELAXTUNE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert main(["compile", "mlp", "--config", SMALL, "-o", "m.so"]) == 0
    out = capsys.readouterr().out
    assert f"cache: {tmp_path / 'xdg' / 'relaxtune'}" in out and "no kernel tuned" in out
    assert (folder / "m.so").exists() and (folder / "m.json").exists()
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "rule-based schedules" in r.message]
    assert len(warnings) == 1 and "does not exist" in warnings[0].getMessage()


def test_the_cache_location_follows_flag_variable_checkout_then_user_folder(tmp_path, monkeypatch):
    from relaxtune.config import default_cache_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("RELAXTUNE_CACHE", raising=False)
    assert default_cache_dir() == tmp_path / "xdg" / "relaxtune"
    (tmp_path / "tuning_logs").mkdir()
    assert default_cache_dir() == Path("tuning_logs")
    monkeypatch.setenv("RELAXTUNE_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "mlp.so"
    assert main(["compile", "mlp", "--config", SMALL, "--no-cache", "-o", str(out)]) == 0
    return out


def test_run_refuses_out_of_bounds_and_wrong_dtype(capsys, artifact, tmp_path):
    assert "n=65" in _error_line(capsys, ["run", str(artifact), "--shape", "b=1", "--shape", "n=65"])
    assert "'q'" in _error_line(capsys, ["run", str(artifact), "--shape", "q=3"])
    bad = tmp_path / "in.npz"
    np.savez(bad, x=np.zeros((1, 4, 64), dtype="float64"))
    line = _error_line(capsys, ["run", str(artifact), "--inputs", str(bad)])
    assert "float64" in line and "float32" in line
    manifest = artifact.with_name("mlp.json")
    saved = manifest.read_text()
    manifest.write_text("{oops")
    try:
        assert "damaged" in _error_line(capsys, ["run", str(artifact), "--shape", "b=1", "--shape", "n=4"])
    finally:
        manifest.write_text(saved)


def test_manifest_describes_the_artifact(artifact):
    manifest = json.loads(artifact.with_name("mlp.json").read_text())
    assert manifest["entry"] == "main"
    assert manifest["inputs"] == [
        {"name": "x", "shape": ["b", "n", 64], "dtype": "float32", "fill": "normal", "high": 0}
    ]
    assert manifest["dims"] == {"b": {"lower": 1, "upper": 2}, "n": {"lower": 1, "upper": 64}}
    assert manifest["target"]["kind"] == "llvm" and manifest["tvm_version"]
    assert len(manifest["params"]) == 3


def test_run_without_a_shape_checks_against_the_reference_stored_at_compile_time(
    capsys, artifact, tmp_path, monkeypatch
):
    """A host with the TVM runtime only cannot rebuild the workload; the artifact brings its own check."""
    import shutil

    from relaxtune.cli import run_cmd
    from relaxtune.runtime.artifact import check_path, file_digests

    stored = dict(np.load(check_path(artifact)))
    assert set(stored) == {"x", "expected"} and stored["x"].shape[:2] == (2, 3)  # b = 3 clipped to max_batch 2, n = 3
    assert json.loads(artifact.with_suffix(".json").read_text())["check"] == {"dims": {"b": 2, "n": 3}}
    monkeypatch.setattr(run_cmd, "reference", lambda *a: pytest.fail("the stored check needs no reference built here"))
    assert main(["run", str(artifact), "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "vs the reference stored at compile time" in out and "(ok)" in out, out
    wrong = tmp_path / "wrong.so"
    for src in artifact.parent.glob(artifact.stem + ".*"):
        shutil.copy(src, tmp_path / src.name.replace(artifact.stem, "wrong", 1))
    np.savez(check_path(wrong), x=stored["x"], expected=stored["expected"] + 1.0)  # not the model's output
    assert "wrong.check.npz is damaged" in _error_line(capsys, ["run", str(wrong)])  # its digest is the old one's
    manifest_path = wrong.with_suffix(".json")
    manifest = json.loads(manifest_path.read_text())
    manifest["files"].update(file_digests(wrong, ("check",)))
    manifest_path.write_text(json.dumps(manifest))
    assert main(["run", str(wrong), "--repeat", "2"]) == 1 and "MISMATCH" in capsys.readouterr().out


def test_a_reference_that_fails_at_compile_time_leaves_no_check_and_compile_succeeds(tmp_path, caplog):
    import dataclasses

    from relaxtune import workloads
    from relaxtune.runtime.artifact import check_path, write_check

    def broken(inputs, params):
        raise ImportError("no onnxruntime here")

    workload = dataclasses.replace(
        workloads.load("mlp", {"hidden": "64", "ffn": "128", "max_seq": "64", "max_batch": "2"}), reference=broken
    )
    assert write_check(workload, tmp_path / "m.so") is None and not check_path(tmp_path / "m.so").exists()
    assert "no stored reference check for m.so" in caplog.text and "onnxruntime" in caplog.text


@pytest.mark.parametrize(
    "workload, config", [("mlp", SMALL), ("llama-block", "hidden=64,heads=2,kv_heads=2,ffn=128,max_seq=64,max_batch=2")]
)
def test_bfloat16_artifacts_keep_their_dtype_and_pass_their_checks(capsys, tmp_path, workload, config):
    """numpy writes bfloat16 arrays to .npz as 2-byte void: params, the stored check and --inputs
    come back as bfloat16."""
    import ml_dtypes

    from relaxtune.runtime.artifact import check_path, paths

    so = tmp_path / "bf.so"
    assert main(["compile", workload, "--config", config, "--dtype", "bfloat16", "--no-cache", "-o", str(so)]) == 0
    manifest = json.loads(paths(so)[1].read_text())
    assert {p["dtype"] for p in manifest["params"]} == {"bfloat16"} and manifest["inputs"][0]["dtype"] == "bfloat16"
    assert np.load(paths(so)[0])[manifest["params"][0]["name"]].dtype.kind == "V"  # what numpy keeps of bfloat16
    capsys.readouterr()
    assert main(["run", str(so), "--repeat", "2"]) == 0  # the stored check
    assert (
        main(["run", str(so), "--repeat", "2", "--shape", "b=1", "--shape", "n=17"]) == 0
    )  # the reference rebuilt here
    inputs = tmp_path / "in.npz"
    np.savez(inputs, x=np.load(check_path(so))["x"])
    assert main(["run", str(so), "--repeat", "2", "--inputs", str(inputs)]) == 0
    out = capsys.readouterr().out
    assert out.count("(ok)") == 3, out
    errors = [float(e) for e in __import__("re").findall(r"max error vs [\w ]+ ([\d.e+-]+)", out)]
    assert errors and max(errors) < 2e-2, out  # 8 mantissa bits: the reference in float32 is this close
    assert ml_dtypes.bfloat16 == np.dtype("bfloat16")


def test_gpt2_block_refuses_bfloat16_in_one_line(capsys, tmp_path):
    line = _error_line(capsys, ["compile", "gpt2-block", "--dtype", "bfloat16", "-o", str(tmp_path / "g.so")])
    assert "'bfloat16'" in line and "float16" in line


@pytest.mark.parametrize("damage", ["truncated_so", "altered_params", "missing_check"])
def test_a_damaged_artifact_is_refused_before_it_loads(capsys, artifact, tmp_path, damage):
    import shutil

    copy = tmp_path / "mlp.so"
    for suffix in (".so", ".json", ".params.npz", ".check.npz"):
        shutil.copy(artifact.with_name("mlp" + suffix), tmp_path / ("mlp" + suffix))
    if damage == "truncated_so":  # the loader would map a cut ELF and die with SIGBUS, no message
        copy.write_bytes(copy.read_bytes()[:1000])
        expected = "mlp.so is damaged"
    elif damage == "altered_params":
        data = bytearray((tmp_path / "mlp.params.npz").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (tmp_path / "mlp.params.npz").write_bytes(bytes(data))
        expected = "mlp.params.npz is damaged"
    else:
        (tmp_path / "mlp.check.npz").unlink()
        expected = "mlp.check.npz does not exist"
    assert expected in _error_line(capsys, ["run", str(copy)])
