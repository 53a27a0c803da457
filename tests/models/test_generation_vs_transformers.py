"""The compiled model against transformers' float32 model of the same GGUF file: greedy tokens and logits
at every step, over the bucket boundaries, chunked prefill and decode after a long prefill."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

# logits compared relative to the step's largest logit: float32 sums in another order, and relaxtune's
# exp approximation (8e-8 relative) in the softmax; measured on these models: at most 5e-6
LOGIT_TOLERANCE = 1e-4
PROMPTS = ([5, 17, 230, 41, 300], list(range(3, 40)), [7])


def hf_greedy(model, prompt: list[int], steps: int):
    """transformers' greedy tokens and the logits it chose them from."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out.sequences[0, len(prompt) :].tolist(), [logits[0].numpy() for logits in out.logits]


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("name", ["gqa_tied", "mha_untied", "qwen2"])
def test_greedy_tokens_and_logits_match_transformers(name, tiny_artifact, reference_model):
    from relaxtune import LLM

    llm = LLM(tiny_artifact(name))
    model = reference_model(name)
    for prompt in PROMPTS:
        want_tokens, want_logits = hf_greedy(model, prompt, 32)
        got = list(llm.generate_tokens(prompt, max_tokens=32, stop=False))
        assert got == want_tokens, f"{name}, prompt {prompt[:6]}: tokens differ"
        llm.reset(len(prompt) + 33)
        logits = llm.prefill(prompt)
        for step, token in enumerate(want_tokens):
            err = relative(logits.numpy().reshape(-1), want_logits[step])
            assert err < LOGIT_TOLERANCE, f"{name}, prompt {prompt[:6]}, step {step}: logits off by {err:.2e}"
            logits = llm.decode(token)


@pytest.mark.parametrize("length", [1, 2, 17, 128, 129, 1000])
def test_prefill_across_buckets_and_chunks_then_decode(length, tiny_artifact, reference_model):
    """Prefill lengths on both sides of the bucket boundaries (1|2, 16|17, 128|129) and past max_prefill
    (256: 1000 tokens prefill in four chunks, each attending to the cache), then decode steps."""
    from relaxtune import LLM

    llm = LLM(tiny_artifact("gqa_tied"))
    rng = np.random.default_rng(length)
    ids = rng.integers(0, 350, length).tolist()
    follow = rng.integers(0, 350, 4).tolist()
    want = hf_logits(reference_model("gqa_tied"), ids + follow)
    llm.reset(length + 4)
    got = [llm.prefill(ids).numpy().reshape(-1)] + [llm.decode(t).numpy().reshape(-1) for t in follow]
    for step, logits in enumerate(got):
        err = relative(logits, want[length - 1 + step])
        assert err < LOGIT_TOLERANCE, f"prefill {length}, step {step}: logits off by {err:.2e}"


def test_decode_after_long_prefill_equals_prefill_of_the_whole_sequence(tiny_artifact):
    from relaxtune import LLM

    llm = LLM(tiny_artifact("gqa_tied"))
    ids = np.random.default_rng(7).integers(0, 350, 301).tolist()
    llm.reset(301)
    whole = llm.prefill(ids).numpy().reshape(-1)
    llm.reset(301)
    llm.prefill(ids[:300])
    stepped = llm.decode(ids[300]).numpy().reshape(-1)
    assert relative(stepped, whole) < LOGIT_TOLERANCE
    assert int(np.argmax(stepped)) == int(np.argmax(whole))


# int8 activations (decode's projections over 4-bit blocks, relax_passes/quant_dot_gemv.py): the activations are
# rounded to 8 bits per 32 values, as llama.cpp rounds them, so logits move by about a percent of the largest
INT8_LOGIT_TOLERANCE = 5e-2


def _host_has_int8_dots() -> bool:
    from tvm.target import Target, codegen

    from relaxtune.kernels import quant_dot_tir

    return quant_dot_tir.dot_form(Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()})) is not None


@pytest.mark.skipif(
    not _host_has_int8_dots(),
    reason="the host has neither VNNI nor AVX2: QuantDotGemv leaves the projections as they are",
)
def test_int8_activations_stay_close_to_the_float32_reference(tiny_artifact, reference_model):
    """Teacher-forced on transformers' greedy tokens: every step's logits within INT8_LOGIT_TOLERANCE, and the
    int8 build differs from the float32 one (the int8 kernels ran)."""
    from relaxtune import LLM

    int8, f32 = LLM(tiny_artifact("gqa_tied", int8=True)), LLM(tiny_artifact("gqa_tied"))
    model = reference_model("gqa_tied")
    prompt = PROMPTS[0]
    want_tokens, want_logits = hf_greedy(model, prompt, 16)
    errors, moved = [], 0.0
    for llm in (int8, f32):
        llm.reset(len(prompt) + 17)
    logits, plain = int8.prefill(prompt), f32.prefill(prompt)
    for step, token in enumerate(want_tokens):
        errors.append(relative(logits.numpy().reshape(-1), want_logits[step]))
        moved = max(moved, relative(logits.numpy().reshape(-1), plain.numpy().reshape(-1)))
        logits, plain = int8.decode(token), f32.decode(token)
    assert max(errors) < INT8_LOGIT_TOLERANCE, errors
    assert moved > 1e-6  # the decode steps took int8 activations
