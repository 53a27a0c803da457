"""The cost model's prior: candidates of the rules' space measured on matmul shapes no workload uses.

    python benchmarks/cost_prior.py --cache build/prior --trials 144 [--out schedules/cost_prior.npz]

Tunes one job (`schedules/tune.py`, the rules' design space, a fresh cache `--cache`) over a grid of
static matmuls `x(M, K) @ W(K, N)` (`SHAPES`: M from a decode row to 512 rows, K and N of sizes that
neither the built-in workloads nor `heldout_matmuls.py` use, so a model warm-started from them has
seen none of the kernels it is later judged on), then writes what the job's cost model was trained
on, each candidate's row of decisions, shape and derived features (`schedules/features.py`) and its
measured cost, grouped by kernel (half of each batch picked at random, for a prior that has seen the
space's corners), to `--out` with the SIMD lanes of the target that measured them.
`schedules/cost_model.py` warm-starts a target folder without a model of its own from that file where
the target's float32 lanes are the same.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from relaxtune import threads

ROWS = (1, 5, 24, 64, 200, 512)
SIZES = ((320, 1280), (1280, 320), (640, 640), (448, 896), (896, 448))


def shapes() -> list[tuple[int, int, int]]:
    """Each row count with three of the (K, N) pairs, rotating: 18 kernels."""
    return [(m, *SIZES[(i + j) % len(SIZES)]) for i, m in enumerate(ROWS) for j in range(3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path("build/prior"))
    parser.add_argument("--trials", type=int, default=144)
    parser.add_argument("--out", type=Path, default=Path("schedules/cost_prior.npz"))
    args = parser.parse_args()
    threads.configure()
    from heldout_matmuls import matmul_task

    from relaxtune import targets
    from relaxtune.config import TuneConfig
    from relaxtune.schedules import cache, cost_model, intrin
    from relaxtune.schedules.database import CacheDatabase
    from relaxtune.schedules.features import PER_STORE
    from relaxtune.schedules.rules._utils import lanes
    from relaxtune.schedules.tune import tune

    target = targets.resolve("cpu")
    intrin.register_for("llvm")
    tasks = [matmul_task(*shape) for shape in shapes()]
    folder = cache.folder_for(args.cache, target)
    folder.mkdir(parents=True, exist_ok=True)
    cache.check_compatible(folder, target)
    database = CacheDatabase(folder, writable=True)
    config = TuneConfig(
        trials=args.trials, space="rules", early_stop_batches=0, explore=0.5, check_buckets=False, cost_prior=False
    )
    result = tune(tasks, target.target, database, config, folder)
    print(f"tuned {result.trials_run} trials over {len(tasks)} kernels in {result.wall_s:.0f} s")
    model, _ = cost_model.load(folder)
    rows, costs, groups = [], [], []
    for number, group in enumerate(model.data.values()):
        for features, cost in zip(group.features, group.costs):
            if features.shape[0] == 1 and features[0, PER_STORE]:  # one row, a rule's candidate
                rows.append(features[0, PER_STORE:])
                costs.append(float(cost))
                groups.append(number)
    np.savez_compressed(
        args.out,
        rows=np.asarray(rows, dtype="float32"),
        costs=np.asarray(costs, dtype="float64"),
        group=np.asarray(groups, dtype="int32"),
        lanes=np.int32(lanes(target.target, "float32")),
        target=np.str_(str(target.target)),
    )
    print(f"{len(rows)} candidates of {len(set(groups))} kernels written to {args.out}")


if __name__ == "__main__":
    main()
