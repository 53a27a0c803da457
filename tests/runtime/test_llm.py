"""relaxtune.LLM and relaxtune generate: text, sampling, chat, bad input, the runtime alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from relaxtune.errors import UserError


def test_greedy_generation_is_repeatable_and_stops_at_max_tokens(tiny_llm):
    from relaxtune import LLM

    llm = LLM(tiny_llm)
    first = list(llm.generate_tokens([5, 6, 7], max_tokens=12, stop=False))
    assert len(first) == 12 and first == list(llm.generate_tokens([5, 6, 7], max_tokens=12, stop=False))
    assert llm.stats.prompt_tokens == 3 and llm.stats.new_tokens == 12 and llm.stats.decode_tokens_per_s > 0


def test_calls_of_every_length_share_one_token_buffer_and_agree(tiny_llm):
    """A prompt over max_prefill (64) runs as chunks of 64 and 36 rows, views of one device buffer of token ids:
    its logits and the next step's equal those of the same prompt given in other chunks. (Not against single
    steps: a CPU build's decode rounds activations to int8, its logits within a few % of prefill's.)"""
    import numpy as np

    from relaxtune import LLM

    llm = LLM(tiny_llm)
    ids = [int(t) for t in np.random.default_rng(0).integers(1, 350, 100)]
    buffer = llm._tokens

    def logits(chunks):
        llm.reset(128)
        for chunk in chunks:
            out = llm.prefill(chunk) if len(chunk) > 1 else llm.decode(chunk[0])
        return out.numpy().reshape(-1), llm.decode(7).numpy().reshape(-1)

    whole = logits([ids])
    for chunks in ([ids[:50], ids[50:]], [ids[:30], ids[30:94], ids[94:]]):
        for got, want in zip(logits(chunks), whole):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert llm._tokens is buffer and tuple(buffer.shape) == (1, 64)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_greedy_is_numpys_argmax(dtype):
    import numpy as np

    from relaxtune.runtime.llm import greedy

    rng = np.random.default_rng(0)
    for scale in (1e-3, 1.0, 60.0):
        values = (rng.standard_normal(49152) * scale).astype(dtype)
        assert greedy(values) == int(np.argmax(values))
    edges = np.array([-np.inf, -3.0, -0.5, -0.5, -np.inf], dtype)  # all negative, a tie: the first of equals
    assert greedy(edges) == int(np.argmax(edges)) == 2
    tiny = np.array([-65504.0, -6e-8, 6e-8, 6e-8, 65504.0, 65504.0, 1.0], dtype)  # subnormals, the largest
    assert greedy(tiny) == int(np.argmax(tiny)) == 4
    assert greedy(tiny[:4].reshape(1, 1, 4)) == 2  # (1, 1, vocab) logits as the model gives them
    zeros = np.array([-1.0, -0.0, 0.0, -2.0], dtype)  # -0 and +0 are equal: the first
    assert greedy(zeros) == int(np.argmax(zeros)) == 1


def test_sampling_uses_the_seed(tiny_llm):
    from relaxtune import LLM

    llm = LLM(tiny_llm)
    a = list(llm.generate_tokens([5, 6, 7], max_tokens=16, temperature=1.5, seed=1, stop=False))
    b = list(llm.generate_tokens([5, 6, 7], max_tokens=16, temperature=1.5, seed=1, stop=False))
    c = list(llm.generate_tokens([5, 6, 7], max_tokens=16, temperature=1.5, seed=2, stop=False))
    greedy = list(llm.generate_tokens([5, 6, 7], max_tokens=16, stop=False))
    assert a == b and a != c and a != greedy
    assert all(0 <= t < 350 for t in a + c)


def test_text_and_chat_prompts(tiny_llm):
    from relaxtune import LLM

    llm = LLM(tiny_llm)
    ids = llm.encode("The capital of France is", chat=True)
    assert (
        llm.tokenizer.decode(ids, skip_special_tokens=False)
        == "<|im_start|>user\nThe capital of France is<|im_end|>\n<|im_start|>assistant\n"
    )
    text = "".join(llm.generate("The capital of France is", max_tokens=8))
    ids = llm.encode("The capital of France is")
    tokens = list(llm.generate_tokens(ids, max_tokens=8))
    assert text == llm.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda llm: list(llm.generate_tokens([1, 2], max_tokens=0)), r"--max-tokens 0: give 1 or more"),
        (lambda llm: list(llm.generate_tokens([], max_tokens=4)), "the prompt is empty"),
        (
            lambda llm: list(llm.generate_tokens([1, 999], max_tokens=4)),
            r"token id 999 is outside the vocabulary: ids must be in \[0, 349\]",
        ),
        (lambda llm: list(llm.generate_tokens([1], max_tokens=4, temperature=-1)), "--temperature -1 is negative"),
    ],
)
def test_bad_arguments(tiny_llm, call, match):
    from relaxtune import LLM

    with pytest.raises(UserError, match=match):
        call(LLM(tiny_llm))


def test_prompt_longer_than_the_context_and_a_full_cache(tiny_llm):
    from relaxtune import LLM

    llm = LLM(tiny_llm, context=20)
    with pytest.raises(UserError, match="the prompt is 21 tokens, longer than the context of 20 tokens"):
        list(llm.generate_tokens(list(range(21)), max_tokens=1))
    with pytest.raises(
        UserError,
        match=r"would fill the KV cache of 20 positions: give --max-tokens <= 5 or a larger --context \(at most 256\)",
    ):
        list(llm.generate_tokens(list(range(15)), max_tokens=6))
    llm.reset(8)
    llm.prefill(list(range(8)))
    with pytest.raises(UserError, match=r"the KV cache is full \(8 of 8 positions\)"):
        llm.decode(3)
    with pytest.raises(UserError, match=r"--context 257 must be in \[1, 256\]"):
        LLM(tiny_llm, context=257)


def test_missing_tokenizer_and_wrong_artifacts(tiny_llm, tmp_path):
    import shutil

    from relaxtune import LLM
    from relaxtune.runtime import llm_files

    for suffix in (".so", ".json", ".weights.safetensors"):
        shutil.copy(
            llm_files.files(tiny_llm).library.with_suffix("").with_name(tiny_llm.stem + suffix), tmp_path / f"m{suffix}"
        )
    llm = LLM(tmp_path / "m.so")
    assert len(list(llm.generate_tokens([1, 2], max_tokens=2, stop=False))) == 2  # token ids need no tokenizer
    with pytest.raises(UserError, match=r"has no tokenizer \(m.tokenizer.json is missing\)"):
        list(llm.generate("hello", max_tokens=2))
    with pytest.raises(UserError, match="does not exist"):
        LLM(tmp_path / "other.so")


def test_generate_command_streams_and_reports(tiny_llm, capsys):
    from relaxtune.__main__ import main

    assert main(["generate", str(tiny_llm), "--prompt", "Once upon a time", "--max-tokens", "6"]) == 0
    err = capsys.readouterr().err
    assert "prompt tokens" in err and "prefill" in err and "decode" in err and "peak RSS" in err
    assert "sampling" in err and "ms/token" in err
    assert main(["generate", str(tiny_llm), "--prompt", "hi", "--max-tokens", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["relaxtune generate: error: --max-tokens 0: give 1 or more"]


def test_runs_with_the_runtime_library_only(tiny_llm):
    """TVM_USE_RUNTIME_LIB=1: no compiler library, and nothing imports tvm.relax."""
    from relaxtune import LLM

    want = list(LLM(tiny_llm).generate_tokens([5, 6, 7], max_tokens=6, stop=False))
    code = (
        "import sys, relaxtune; llm = relaxtune.LLM(sys.argv[1]); "
        "print(list(llm.generate_tokens([5, 6, 7], max_tokens=6, stop=False))); "
        "print(sorted(m for m in sys.modules if m.startswith('tvm.relax') or m.startswith('relaxtune.relax_passes')))"
    )
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    done = subprocess.run(
        [sys.executable, "-c", code, str(tiny_llm)], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    tokens, modules = done.stdout.strip().splitlines()[-2:]
    assert tokens == str(want) and modules == "[]"


def _as_compiled_for(tiny_llm, folder, device: str):
    """A copy of the tiny artifact whose manifest says it was compiled for `device`."""
    import json
    import shutil

    from relaxtune.runtime import llm_files

    found = llm_files.files(tiny_llm)
    copy = llm_files.files(folder / "m.so")
    for source, target in zip(
        (found.library, found.manifest, found.weights), (copy.library, copy.manifest, copy.weights)
    ):
        shutil.copy(source, target)
    manifest = json.loads(copy.manifest.read_text())
    manifest["device"], manifest["target"] = device, {"kind": device, "arch": "sm_90"} if device == "cuda" else {}
    copy.manifest.write_text(json.dumps(manifest))
    return copy.library


def test_an_artifact_runs_on_its_own_device_only(tiny_llm, tmp_path, capsys):
    from relaxtune import LLM
    from relaxtune.__main__ import main

    with pytest.raises(UserError, match=r"was compiled for cpu \(llvm\), not cuda: run it with --device cpu"):
        LLM(tiny_llm, device="cuda")
    assert len(list(LLM(tiny_llm, device="cpu").generate_tokens([1, 2], max_tokens=2, stop=False))) == 2
    cuda = _as_compiled_for(tiny_llm, tmp_path, "cuda")
    with pytest.raises(UserError, match=r"was compiled for cuda \(sm_90\), not cpu: run it with --device cuda"):
        LLM(cuda, device="cpu")
    assert main(["generate", str(cuda), "--prompt", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "compiled for cuda (sm_90), not cpu: run it with --device cuda" in err[0]
    import tvm

    if not tvm.cuda(0).exist:  # this machine has no GPU: its own device is refused in one line too
        with pytest.raises(UserError, match="runs on cuda, but"):
            LLM(cuda)
