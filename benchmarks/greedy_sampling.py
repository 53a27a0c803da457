"""The host's greedy choice of the next token from float16 logits (a GPU build's (1, 1, vocab) output): numpy's
argmax against `relaxtune.runtime.llm.greedy` (int16 keys of the same order), through `LLM.sample` as generate
calls it, the logits' copy to numpy included. Medians of interleaved rounds.

    python benchmarks/greedy_sampling.py [--vocab 49152] [--rounds 7] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's by default")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200, help="choices timed per sample")
    args = parser.parse_args()
    import tvm

    from relaxtune.runtime.llm import LLM

    rng = np.random.default_rng(0)
    logits = tvm.runtime.tensor((rng.standard_normal((1, 1, args.vocab)) * 5).astype(np.float16))
    ways = {
        "numpy argmax": lambda: int(np.argmax(logits.numpy().reshape(-1))),
        "relaxtune greedy": lambda: LLM.sample(logits, 0.0, 1.0, rng),
    }
    assert len({f() for f in ways.values()}) == 1, "the two ways chose different tokens"
    samples: dict = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, choose in ways.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                choose()
            samples[name].append((time.perf_counter() - start) / args.calls * 1e6)
    medians = {name: statistics.median(s) for name, s in samples.items()}
    for name, us in medians.items():
        print(f"{name}: {us:.1f} us per token")
    print(f"numpy argmax / relaxtune greedy: {medians['numpy argmax'] / medians['relaxtune greedy']:.1f}x")


if __name__ == "__main__":
    main()
