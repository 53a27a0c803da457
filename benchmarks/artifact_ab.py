"""Two artifacts of one workload timed side by side, interleaved, in one process (runtime only).

    python benchmarks/artifact_ab.py A.so B.so --shape b=1 --shape n=1,32,128,512 [--rounds 15]

Both must take the same inputs (e.g. one workload compiled by two versions of relaxtune, or with two
options). Prints per shape each artifact's median ms, B / A, and B's largest difference from A's output.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import numpy as np

from relaxtune import threads
from relaxtune.measure.timing import interleaved
from relaxtune.runtime.artifact import Artifact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--shape", action="append", default=[], metavar="DIM=N,N,...")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    threads.configure()
    a, b = Artifact.load(args.a), Artifact.load(args.b)
    grid = {k: [int(v) for v in values.split(",")] for k, _, values in (s.partition("=") for s in args.shape)}
    dims = {d: grid.get(d, [bounds["lower"]]) for d, bounds in a.manifest["dims"].items()}
    print(f"| shape | {args.a.name} ms | {args.b.name} ms | B / A | max abs diff |\n|---|---|---|---|---|")
    for values in itertools.product(*dims.values()):
        point = dict(zip(dims, values))
        inputs = a.random_inputs(point)
        diff = float(np.max(np.abs(a(inputs).astype("float64") - b(inputs))))
        ms = interleaved({"a": a.caller(inputs), "b": b.caller(inputs)}, args.rounds)
        shape = " ".join(f"{k}={v}" for k, v in point.items())
        print(f"| {shape} | {ms['a']:.3f} | {ms['b']:.3f} | {ms['b'] / ms['a']:.3f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
