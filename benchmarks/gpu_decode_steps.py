"""The host's share of a relaxtune language model's decode step on the GPU: ms per step timed as `LLM.generate`
times them (the device synchronised after each step), with the call's token ids written into the LLM's one device
buffer (the default) and, in turns, with a device array made per call (`fresh`: an allocation per step, its release
a device synchronisation; the runtime's code before the buffer), medians of --rounds.

    S=$(bash scripts/device_install.sh) && export PYTHONPATH=$S:$PWD/benchmarks && \\
        python3 benchmarks/gpu_decode_steps.py --out $OUT/steps [--context 1024] [--steps 200] [--rounds 5]

The model is gpu_llm.py's (the SmolLM2-sized random checkpoint, written there), built as gpu_llm.py builds it.
Writes decode_steps.json to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from gpu_llm import MODELS, build

from relaxtune.models import random_checkpoint


def fresh_forward(llm, function: str, ids: list[int]):
    """LLM._forward with a device array made for the call's token ids (the code before the shared buffer)."""
    import numpy as np
    import tvm

    cache = llm._cache
    tokens = tvm.runtime.tensor(np.asarray([ids], dtype=np.int32), llm.device)
    embeddings = llm._functions["embed"](tokens, *llm._weights["embed"])
    cache.begin(len(ids))
    logits, _ = llm._functions[function](embeddings, cache.handle, *llm._weights[function])
    cache.end(len(ids))
    return logits


def ms_per_step(llm, forward, token: int, steps: int) -> float:
    """ms per step over `steps` steps from the sequence's length, which it has again after."""
    start = time.perf_counter()
    for _ in range(steps):
        forward("decode", [token])
        llm.device.sync()
    elapsed = time.perf_counter() - start
    llm.pop(steps)
    return elapsed / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_llm"), help="checkpoint and artifacts")
    parser.add_argument("--model", choices=tuple(MODELS), default="smollm2")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: checks the script only")
    parser.add_argument("--context", type=int, default=1024, help="the context before the timed steps")
    parser.add_argument("--steps", type=int, default=200, help="decode steps timed per sample")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from relaxtune import LLM

    args.out.mkdir(parents=True, exist_ok=True)
    folder = args.work / f"{args.model}-float16"
    if not (folder / "config.json").exists():
        random_checkpoint.write(folder, MODELS[args.model], "float16")
    llm = LLM(build(folder, args.work, args.device, True, (1, 16, args.context)), device=args.device)
    ways = {"buffer": llm._forward, "fresh": lambda f, ids: fresh_forward(llm, f, ids)}
    samples: dict = {name: [] for name in ways}
    llm.reset(args.context + max(args.steps, 20))
    llm.prefill(list(range(100, 100 + args.context)))
    for name, forward in ways.items():  # warm-up
        ms_per_step(llm, forward, 7, 20)
    for r in range(args.rounds):
        for name, forward in ways.items() if r % 2 == 0 else reversed(ways.items()):
            samples[name].append(ms_per_step(llm, forward, 7, args.steps))
        print(f"round {r + 1} of {args.rounds}: " + ", ".join(f"{n} {s[-1]:.4f} ms" for n, s in samples.items()))
    medians = {name: statistics.median(s) for name, s in samples.items()}
    result = {"context": args.context, "steps": args.steps, "samples_ms": samples, "median_ms": medians}
    result["fresh_over_buffer"] = medians["fresh"] / medians["buffer"]
    (args.out / "decode_steps.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "samples_ms"}, indent=1))


if __name__ == "__main__":
    main()
