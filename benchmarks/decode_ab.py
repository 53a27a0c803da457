"""Decode time per token of two or more compiled builds of one language model, interleaved in one process: each
round times --steps decode steps of every artifact in turn after a --context-token prompt, so load on a shared
machine falls on all alike. Prints each artifact's median and best ms per token and, per round, its ratio to
the first artifact (the median of those ratios); wall time, or with --cpu the process's CPU time (with
TVM_NUM_THREADS=1 the least disturbed by other jobs on the machine).

    python benchmarks/decode_ab.py build/a.so build/b.so [--context 128 1024] [--rounds 7] [--steps 32]

Threads: TVM_NUM_THREADS (relaxtune.threads sets one per core). Figures: docs/results.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--context", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--cpu", action="store_true", help="process CPU time instead of wall time")
    args = parser.parse_args()
    from relaxtune import LLM

    llms = [LLM(a) for a in args.artifacts]
    vocab = int(llms[0].model["vocab_size"])
    rng = np.random.default_rng(0)
    clock = time.process_time if args.cpu else time.perf_counter
    print("| context | artifact | median ms/token | best | median ratio to the first |\n|---|---|---|---|---|")
    for context in args.context:
        ids = rng.integers(100, vocab - 1000, context).tolist()
        follow = rng.integers(100, vocab - 1000, args.steps).tolist()
        times = [[] for _ in llms]
        for _ in range(args.rounds + 1):  # the first round warms up
            for i, llm in enumerate(llms):
                llm.reset(context + args.steps + 1)
                llm.prefill(ids)
                start = clock()
                for token in follow:
                    llm.decode(token)
                times[i].append((clock() - start) / args.steps * 1e3)
        times = [t[1:] for t in times]
        for i, path in enumerate(args.artifacts):
            ratio = statistics.median(a / b for a, b in zip(times[i], times[0]))
            print(
                f"| {context} | {os.path.basename(path)} | {statistics.median(times[i]):.2f} | {min(times[i]):.2f} "
                f"| {ratio:.3f} |",
                flush=True,
            )
    print(f"\nload average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
