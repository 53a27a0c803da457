"""Two artifacts of one workload timed side by side, interleaved, in one process (runtime only).

    python benchmarks/artifact_ab.py A.so B.so --shape b=1 --shape n=1,32,128,512 [--rounds 15] [--json OUT]

Both must take the same inputs (e.g. one workload compiled by two versions of relaxtune, or with two
options, or with and without its tuning records: `relaxtune compile W -o W.so` and `... --no-cache -o
W-rules.so`). Both are sampled in turns (`--rounds` rounds of back-to-back windows of about 20 ms,
`measure.timing.timed_samples`). Prints per shape each artifact's median and fastest ms, B / A as the
median of the per-round ratios and as the ratio of the fastest windows (what each does when the shared
machine lets it), and B's largest difference from A's output.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import numpy as np

from relaxtune import threads
from relaxtune.measure.timing import timed_samples
from relaxtune.runtime.artifact import Artifact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--shape", action="append", default=[], metavar="DIM=N,N,...")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    threads.configure()
    a, b = Artifact.load(args.a), Artifact.load(args.b)
    grid = {k: [int(v) for v in values.split(",")] for k, _, values in (s.partition("=") for s in args.shape)}
    dims = {d: grid.get(d, [bounds["lower"]]) for d, bounds in a.manifest["dims"].items()}
    print(
        f"| shape | {args.a.name} median / fastest ms | {args.b.name} median / fastest ms | B / A (median of "
        "per-round ratios) | B / A (fastest) | max abs diff |\n|---|---|---|---|---|---|"
    )
    rows = []
    for values in itertools.product(*dims.values()):
        point = dict(zip(dims, values))
        inputs = a.random_inputs(point)
        diff = float(np.max(np.abs(a(inputs).astype("float64") - b(inputs))))
        ms = timed_samples({"a": a.caller(inputs), "b": b.caller(inputs)}, args.rounds)
        ratio = statistics.median(y / x for x, y in zip(ms["a"], ms["b"]))
        row = {
            "shape": point,
            **{f"{k}_median_ms": statistics.median(v) for k, v in ms.items()},
            **{f"{k}_fastest_ms": min(v) for k, v in ms.items()},
            "b_over_a": ratio,
            "b_over_a_fastest": min(ms["b"]) / min(ms["a"]),
            "max_abs_diff": diff,
        }
        rows.append(row)
        shape = " ".join(f"{k}={v}" for k, v in point.items())
        print(
            f"| {shape} | {row['a_median_ms']:.3f} / {row['a_fastest_ms']:.3f} "
            f"| {row['b_median_ms']:.3f} / {row['b_fastest_ms']:.3f} | {ratio:.3f} | {row['b_over_a_fastest']:.3f} "
            f"| {diff:.1e} |",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps({"a": str(args.a), "b": str(args.b), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
