"""Where a compiled language model's time goes: each VM call (kernels, the KV cache's builtins, the VM's
own allocation and shape work) of one prefill and one decode step, summed by name.

    python benchmarks/profile_llm.py build/smollm2.so [--prefill 512] [--context 128] [--repeat 3]

Times come from the VM's instrument hook (`VirtualMachine.set_instrument`: wall time around each call,
the hook's own cost included), the fastest of --repeat runs per name; the step's wall time without the
hook is printed beside them. Markdown on stdout.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import numpy as np


def profile(llm, step, repeat: int) -> tuple[dict[str, tuple[float, int]], float]:
    """({name: (seconds, calls)}, wall seconds without the hook) of `step()`, best of `repeat` runs each."""
    walls = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        walls.append(time.perf_counter() - start)
    best: dict[str, tuple[float, int]] = {}
    for _ in range(repeat):
        totals, counts, stack = collections.Counter(), collections.Counter(), []

        def hook(func, name, before, ret, *args, totals=totals, counts=counts, stack=stack):
            if before:
                stack.append(time.perf_counter())
            else:
                totals[name] += time.perf_counter() - stack.pop()
                counts[name] += 1
            return 0

        llm.vm.set_instrument(hook)
        step()
        llm.vm.set_instrument(None)
        for name, seconds in totals.items():
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, counts[name])
    return best, min(walls)


def table(title: str, rows: dict[str, tuple[float, int]], wall: float, top: int) -> str:
    lines = [f"## {title}: {wall * 1e3:.2f} ms without the hook", "", "| call | ms | calls |", "|---|---|---|"]
    for name, (seconds, calls) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {name} | {seconds * 1e3:.3f} | {calls} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens of the profiled prefill")
    parser.add_argument(
        "--context", type=int, default=128, help="positions in the cache before the profiled decode step"
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    from relaxtune import LLM

    llm = LLM(args.artifact)
    ids = (
        np.random.default_rng(0)
        .integers(100, int(llm.model["vocab_size"]) - 1000, max(args.prefill, args.context))
        .tolist()
    )

    def prefill():
        llm.reset(args.prefill)
        llm.prefill(ids[: args.prefill])

    def decode():
        llm.reset(args.context + 1)
        llm.prefill(ids[: args.context])
        llm.decode(ids[0])

    rows, wall = profile(llm, prefill, args.repeat)
    print(table(f"prefill of {args.prefill} tokens", rows, wall, args.top))
    llm.reset(args.context + 1)
    llm.prefill(ids[: args.context])
    llm.decode(ids[0])

    def step():  # the same position each time
        llm.pop(1)
        llm.decode(ids[0])

    rows, wall = profile(llm, step, args.repeat)
    print(table(f"decode after {args.context} positions", rows, wall, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
