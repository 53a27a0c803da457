"""How repeatable the local runner's timings of a batch are, its windows in turns or one candidate after another.

    python benchmarks/runner_repeatability.py [--shapes 128x256x1024,16x1024x256] [--points 8] [--reps 8]

For each static matmul `x(M, K) @ W(K, N)` (`heldout_matmuls.matmul_task`), `--points` distinct points of the
rules' design space (random decisions, seeded) are built once; then the batch is measured `--reps` times by each
of two local runners (`schedules/workers.py`, the job's timing windows: `TuneConfig.measure_windows` of at least
`window_ms`), alternating which goes first: `interleave=True` (a batch's windows taken in turns) and
`interleave=False` (one candidate after another, as MetaSchedule measures). Printed per runner: how often two
repetitions order a pair of candidates the same way (pairs whose medians differ by more than 3%), and the
median |log| distance of a timing from its candidate's median over the repetitions. A cost model's ranking of a
measured batch cannot agree with the measurement more often than two measurements agree with each other.
"""

from __future__ import annotations

import argparse
import itertools
import random

import numpy as np

from relaxtune import threads


def points(task, target, count: int, seed: int) -> list:
    """`count` distinct candidates of the task's rules' space (random decisions), the rule's own first."""
    import tvm_ffi

    from relaxtune.schedules import space

    post = space.postprocs()
    out, keys, rng = [space.rule_candidate(task.mod, target, post)], set(), random.Random(seed)
    keys.add(int(tvm_ffi.structural_hash(out[0].sch.mod)))
    for _ in range(50 * count):
        if len(out) >= count:
            break
        values = {
            "rows": rng.choice((3, 4, 5, 6, 8)),
            "units": rng.choice((1, 2, 4, 8)),
            "k_unroll": rng.choice((1, 2, 4, 8)),
        }
        found = space.from_decisions(task.mod, target, "Matmul", values, post)
        if found is not None and int(tvm_ffi.structural_hash(found.sch.mod)) not in keys:
            keys.add(int(tvm_ffi.structural_hash(found.sch.mod)))
            out.append(found)
    return out


def agreement(runs: np.ndarray) -> tuple[float, float]:
    """(share of same-ordered candidate pairs over pairs of repetitions, median |log(time / candidate's median)|)."""
    median = np.median(runs, axis=0)
    same = total = 0
    for a, b in itertools.combinations(range(len(runs)), 2):
        for i, j in itertools.combinations(range(runs.shape[1]), 2):
            if abs(np.log(median[i] / median[j])) <= np.log(1.03):
                continue
            same += np.sign(runs[a, i] - runs[a, j]) == np.sign(runs[b, i] - runs[b, j])
            total += 1
    return same / max(total, 1), float(np.median(np.abs(np.log(runs / median))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="128x256x1024,16x1024x256")
    parser.add_argument("--points", type=int, default=8)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    threads.configure()
    from heldout_matmuls import matmul_task
    from tvm.s_tir import meta_schedule as ms

    from relaxtune import targets
    from relaxtune.config import TuneConfig
    from relaxtune.schedules import intrin
    from relaxtune.schedules.builder import make_builder
    from relaxtune.schedules.workers import LocalRunner

    target = targets.resolve("cpu").target
    intrin.register_for("llvm")
    config = TuneConfig()
    evaluator = ms.runner.EvaluatorConfig(number=1, repeat=config.measure_windows, min_repeat_ms=config.window_ms)
    runners = {
        mode: LocalRunner(timeout_sec=config.run_timeout_s, evaluator_config=evaluator, interleave=mode == "in turns")
        for mode in ("in turns", "one after another")
    }
    builder = make_builder(config)
    try:
        for shape in args.shapes.split(","):
            task = matmul_task(*(int(v) for v in shape.split("x")))
            chosen = points(task, target, args.points, args.seed)
            built = builder.build([ms.builder.BuilderInput(c.sch.mod, target) for c in chosen])
            inputs = [ms.runner.RunnerInput(b.artifact_path, "cpu", c.args_info) for b, c in zip(built, chosen)]
            times: dict[str, list] = {mode: [] for mode in runners}
            for rep in range(args.reps):
                for mode in list(runners)[:: 1 if rep % 2 == 0 else -1]:
                    results = [f.result() for f in runners[mode].run(inputs)]
                    times[mode].append([float(r.run_secs[0]) for r in results])
            for mode, runs in times.items():
                same, spread = agreement(np.asarray(runs))
                print(
                    f"{shape} {len(chosen)} points, {args.reps} repetitions, {mode}: pairs ordered alike {same:.3f}, "
                    f"median |log(t / median)| {spread:.3f}"
                )
    finally:
        builder.shutdown()
        for runner in runners.values():
            runner.shutdown()


if __name__ == "__main__":
    main()
