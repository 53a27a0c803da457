"""relaxtune compile gguf:PATH, then relaxtune generate: the command-line path, and its refusals."""

from __future__ import annotations

import json

import pytest


def test_compile_then_generate(tiny_gguf, tmp_path, capsys):
    from relaxtune.__main__ import main

    so = tmp_path / "tiny.so"
    assert (
        main(
            [
                "compile",
                f"gguf:{tiny_gguf('gqa_tied')}",
                "-o",
                str(so),
                "--no-cache",
                "--config",
                "max_prefill=64",
                "--buckets",
                "n=@32",
            ]
        )
        == 0
    )
    manifest = json.loads((tmp_path / "tiny.json").read_text())
    assert manifest["kind"] == "llm" and manifest["max_prefill"] == 64
    assert sorted(manifest["functions"]) == ["decode", "embed", "prefill"]
    assert manifest["tokenizer"]["chat"] == ["<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"]
    capsys.readouterr()
    assert main(["generate", str(so), "--prompt", "The capital of France is", "--max-tokens", "5", "--chat"]) == 0
    assert "prompt tokens" in capsys.readouterr().err


@pytest.mark.parametrize(
    "spec, message",
    [
        ("gguf:{tmp}/missing.gguf", "GGUF file {tmp}/missing.gguf does not exist"),
        ("gguf:{tmp}/text.gguf", "{tmp}/text.gguf is not a GGUF file"),
    ],
)
def test_bad_sources_are_one_line(spec, message, tmp_path, capsys):
    from relaxtune.__main__ import main

    (tmp_path / "text.gguf").write_text("not a model")
    assert main(["compile", spec.format(tmp=tmp_path), "-o", str(tmp_path / "x.so")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message.format(tmp=tmp_path) in err[0]


def test_packaged_name_without_its_package(monkeypatch):
    from relaxtune.errors import UserError
    from relaxtune.workloads import language_model as workload

    monkeypatch.setitem(workload.PACKAGED, "smollm2", ("relaxtune_no_such_package", "x.gguf"))
    with pytest.raises(UserError, match="model 'smollm2' needs the relaxtune-no-such-package package"):
        workload.packaged_path("smollm2")


def test_unknown_config_key(tiny_gguf):
    from relaxtune.errors import UserError
    from relaxtune.workloads import load

    with pytest.raises(UserError, match="unknown config key 'hidden' for a language model: valid keys are max_prefill"):
        load(f"gguf:{tiny_gguf('gqa_tied')}", {"hidden": "3"})
    with pytest.raises(UserError, match=r"config max_prefill=9999 must be in \[1, 2048\]"):
        load(f"gguf:{tiny_gguf('gqa_tied')}", {"max_prefill": "9999"})
