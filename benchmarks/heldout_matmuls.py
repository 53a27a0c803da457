"""Matmul shapes the rules were never tuned by hand for: tune each, then each tuned kernel against its rule.

    python benchmarks/heldout_matmuls.py --cache build/heldout --trials 64 [--shapes 1x4096x11008,7x576x1536,...]
        [--space rules] [--rounds 31] [--json OUT.json]

Each shape MxKxN is one static kernel `x(M, K) @ W(K, N)` (float32, the weight's layout of the built-in
workloads), a tuning task of weight 1 in one job of `--trials` trials (`schedules/tune.py`, the cache
`--cache`), then timed against its rule as `rule_vs_tuned.py` does (rounds of back-to-back windows, the
median of per-round ratios). Prints one line per kernel and the geometric mean of tuned / rule.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from relaxtune import threads

SHAPES = "1x4096x11008,7x576x1536,77x768x3072,300x1024x1024"


def matmul_task(m: int, k: int, n: int):
    """The tuning task of `x(m, k) @ W(k, n)`."""
    from tvm import te

    from relaxtune.schedules.tasks import Task, normalize, workload_key

    x, w = te.placeholder((m, k), name="x"), te.placeholder((k, n), name="w")
    r = te.reduce_axis((0, k), name="r")
    y = te.compute((m, n), lambda i, j: te.sum(x[i, r] * w[r, j], axis=r), name="matmul")
    mod = normalize(te.create_prim_func([x, w, y]))
    return Task(f"matmul_{m}x{k}x{n}", mod, workload_key(mod), 2.0 * m * k * n, {}, weight=1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path("build/heldout"))
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--shapes", default=SHAPES, help="comma-separated MxKxN")
    parser.add_argument("--space", default="rules")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    threads.configure()
    from rule_vs_tuned import compare, geomean

    from relaxtune import targets
    from relaxtune.config import TuneConfig
    from relaxtune.schedules import cache, intrin
    from relaxtune.schedules.database import CacheDatabase
    from relaxtune.schedules.tune import tune

    target = targets.resolve("cpu")
    intrin.register_for("llvm")
    tasks = [matmul_task(*(int(v) for v in shape.split("x"))) for shape in args.shapes.split(",")]
    folder = cache.folder_for(args.cache, target)
    folder.mkdir(parents=True, exist_ok=True)
    cache.check_compatible(folder, target)
    database = CacheDatabase(folder, writable=True)
    result = tune(tasks, target.target, database, TuneConfig(trials=args.trials, space=args.space), folder)
    print(f"tuned {result.trials_run} trials in {result.wall_s:.0f} s; ranking {result.ranking}")
    rows = compare(tasks, database, target.target, args.rounds)
    ratio = geomean(r["tuned_over_rule"] for r in rows)
    print(f"{len(rows)} held-out kernels: tuned / rule geometric mean {ratio:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"kernels": rows, "geomean": ratio, "ranking": result.ranking}, indent=1))


if __name__ == "__main__":
    main()
