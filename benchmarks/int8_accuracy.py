"""Greedy tokens and logit error of compiled builds of a GGUF model against transformers' float32 model of the
same file (its weights dequantized by gguf, activations float32): for each prompt, 32 greedy tokens of the
reference; per build, how many of its own greedy tokens match them before the first difference, and the
largest logit error (relative to the step's largest logit) over the 32 steps with the reference's tokens fed
(teacher-forced). With --llama-cpp, llama.cpp's (xllamacpp) greedy tokens on the same file likewise (it
multiplies with activations quantized to 8 bits too).

    python benchmarks/int8_accuracy.py build/smollm2-int8.so build/smollm2-f32act.so [--model smollm2] [--llama-cpp]

Figures: docs/results.md ("Quantized weights (CPU)").
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

PROMPTS = ("The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):")
STEPS = 32


def prefix(got: list[int], want: list[int]) -> int:
    """Tokens of `got` equal to `want` before the first difference."""
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def llama_cpp_tokens(path: str, prompts: list[list[int]]) -> list[list[int]]:
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = path
    params.n_ctx = 256
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = 2
    server = xllamacpp.Server(params)
    out = []
    for ids in prompts:
        reply = server.handle_completions(
            {"prompt": ids, "n_predict": STEPS, "temperature": 0.0, "ignore_eos": True, "n_probs": 1}
        )
        out.append([int(step["id"]) for step in reply["choices"][0]["logprobs"]["content"]])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--llama-cpp", action="store_true")
    args = parser.parse_args()
    import torch

    from relaxtune import LLM, torchvision_compat

    torchvision_compat.install()  # transformers imports torchvision when installed; its extension may not load
    import transformers

    from relaxtune.workloads.language_model import PACKAGED, packaged_path

    path = packaged_path(args.model) if args.model in PACKAGED else args.model.removeprefix("gguf:")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(os.path.dirname(path)), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    llms = {os.path.basename(a): LLM(a) for a in args.artifacts}
    first = next(iter(llms.values()))
    prompts = [first.encode(p) for p in PROMPTS]
    print("| prompt | build | greedy tokens equal (of 32) | max logit error (teacher-forced) |\n|---|---|---|---|")
    references = []
    for text, ids in zip(PROMPTS, prompts):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=STEPS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                eos_token_id=None,
                pad_token_id=0,
            )
        want = out.sequences[0, len(ids) :].tolist()
        references.append(want)
        for name, llm in llms.items():
            got = list(llm.generate_tokens(ids, max_tokens=STEPS, stop=False))
            llm.reset(len(ids) + STEPS + 1)
            logits, worst = llm.prefill(ids), 0.0
            for step, token in enumerate(want):
                reference = out.logits[step][0].numpy()
                error = np.abs(logits.numpy().reshape(-1) - reference).max() / np.abs(reference).max()
                worst = max(worst, float(error))
                logits = llm.decode(token)
            print(f"| {text!r} | {name} | {prefix(got, want)} | {worst:.2e} |", flush=True)
    if args.llama_cpp:
        for text, got, want in zip(PROMPTS, llama_cpp_tokens(str(path), prompts), references):
            print(f"| {text!r} | llama.cpp | {prefix(got, want)} | - |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
