"""Each tuned kernel against its rule, timed side by side, interleaved: what the search shipped, per kernel.

    python benchmarks/rule_vs_tuned.py llama-block --cache tuning_logs --buckets n=1,16,128,1024 [--rounds 31]
        [--json OUT.json]

For every tuning task of the workload (the static kernel at its bucket's tuning point) that the
cache holds records of: the rules' schedule (as `relaxtune compile` gives a kernel without a record)
and the best record's, made as `ApplyTunedSchedules` makes it (a rules' record: the rule with the
record's decisions, `space.schedule_from_decisions`; a generic one: its trace replayed, fast math
applied), both compiled and timed in turns: `--rounds` rounds, each timing both kernels back to back
(TVM's time evaluator, a window of at least 5 ms each, the order alternating), so load on the shared
machine hits both alike. Prints each one's median us, the median over rounds of tuned / rule (the
ratio within a round: robust to load that changes between rounds), the decisions that changed, and
the geometric mean of tuned / rule, of the medians and of the fastest windows; a kernel whose best
record is the rule's own point (no decision changed: the same TIR, `tests/schedules/test_space.py`)
counts 1, its measured ratio kept as `measured_ratio` (two timings of one kernel: the noise), and so does
one whose best record the job's side-by-side check (`schedules/confirm.py`) found no faster than its rule
(the build ships the rule).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from relaxtune import threads


def tuned_kernel(record, static, target):
    """The best record's schedule of the static kernel, as the build applies it (module docstring)."""
    from relaxtune.schedules import replay, space
    from relaxtune.schedules.rules import decisions, fast_math

    found = decisions.read(record.trace)
    if found is not None:
        return space.schedule_from_decisions(static, target, *found), found
    return fast_math.rewrite(replay.apply_trace(static, replay.generalize(record.trace))), None


def rule_decisions(mod, target) -> dict | None:
    """The rule's own decisions for the static kernel (None: no tunable rule)."""
    from relaxtune.schedules import space
    from relaxtune.schedules.rules import decisions

    candidate = space.rule_candidate(mod, target, space.postprocs())
    return decisions.read(candidate.sch.trace)[1] if candidate is not None else None


def paired(libs: dict, args: list, rounds: int) -> tuple[dict[str, float], float, float]:
    """(median us of each of the two kernels, median over rounds of the second / the first, the second's fastest
    window / the first's), timed in turns."""
    import statistics

    import tvm

    names = list(libs)
    timers = {n: libs[n].mod.time_evaluator("main", tvm.cpu(0), number=1, repeat=1, min_repeat_ms=5) for n in names}
    for timer in timers.values():
        timer(*args)  # warm-up
    samples: dict[str, list[float]] = {n: [] for n in names}
    ratios = []
    for r in range(rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            samples[n].append(timers[n](*args).mean * 1e6)
        ratios.append(samples[names[1]][-1] / samples[names[0]][-1])
    fastest = min(samples[names[1]]) / min(samples[names[0]])
    return {n: statistics.median(v) for n, v in samples.items()}, statistics.median(ratios), fastest


def compare(tasks, database, target, rounds: int, index: dict | None = None) -> list[dict]:
    """One row per task with records: rule and tuned us (interleaved medians), ratio, decisions changed. With the
    cache's task `index`, a kernel whose best record the job's side-by-side check found no faster than its rule
    (`schedules/confirm.py`: the build ships the rule) counts 1, its measured ratio kept."""
    import tvm

    from relaxtune.schedules import confirm, task_index

    dev = tvm.cpu(0)
    rows = []
    for task in tasks:
        records = database.get_top_k(database.commit_workload(task.mod), 1) if database.has_workload(task.mod) else []
        if not records:
            continue
        tuned, found = tuned_kernel(records[0], task.mod["main"], target)
        libs = {
            "rule": tvm.compile(task_index.rule_scheduled(task.mod, target), target=target),
            "tuned": tvm.compile(tvm.IRModule({"main": tuned.with_attr("global_symbol", "main")}), target=target),
        }
        rng = np.random.default_rng(0)
        args = [
            tvm.runtime.tensor(rng.standard_normal([int(d) for d in p.shape]).astype(str(p.dtype)), dev)
            for p in task.mod["main"].params
        ]
        medians, ratio, fastest = paired(libs, args, rounds)
        rule = rule_decisions(task.mod, target)
        chosen = found[1] if found else None
        changed = {k: f"{rule.get(k)}: {v}" for k, v in chosen.items() if rule.get(k) != v} if rule and chosen else None
        same = changed == {}  # the best record is the rule's own point: the same TIR (tests/schedules/test_space.py)
        confirmed = (index or {}).get(task.key, {}).get("confirmed", {})
        record_us = confirm.record_us(records[0])
        kept_rule = confirm.ships_rule(confirmed, record_us)
        same = same or kept_rule
        rows.append(
            {
                "task": task.name,
                "rule_us": medians["rule"],
                "tuned_us": medians["tuned"],
                "tuned_over_rule": 1.0 if same else ratio,
                "tuned_over_rule_fastest": 1.0 if same else fastest,
                "measured_ratio": ratio,  # for the rule's own point: the two timings of one kernel, the noise
                "measured_ratio_fastest": fastest,
                "record_us": record_us,
                "ships": "rule" if same else "record",
                "changed": changed,
            }
        )
        print(
            f"{task.name:44s} rule {rows[-1]['rule_us']:10.1f} us  tuned {rows[-1]['tuned_us']:10.1f} us  "
            f"{rows[-1]['tuned_over_rule']:.3f} (fastest {fastest:.3f})  "
            f"{changed if changed is not None else 'generic record'}"
            f"{' (the build ships the rule: counted 1)' if same else ''}",
            flush=True,
        )
    return rows


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload")
    parser.add_argument("--cache", type=Path, default=Path("tuning_logs"))
    parser.add_argument("--buckets", action="append", default=[], metavar="DIM=TOPS")
    parser.add_argument("--config", default="", help="the workload's config, k=v,...")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    threads.configure()
    from relaxtune import api, targets
    from relaxtune.config import BucketConfig, JobConfig
    from relaxtune.workloads import load, parse_config

    target = targets.resolve("cpu")
    job = JobConfig(cache_dir=args.cache, buckets=BucketConfig.parse(args.buckets))
    workload = load(args.workload, parse_config(args.config) if args.config else None)
    database, _ = api.open_cache(target, job, writable=False)
    from relaxtune.schedules import cache, task_index

    index = task_index.load(cache.folder_for(args.cache, target))
    rows = compare(api.extract_tasks(workload, target, job), database, target.target, args.rounds, index)
    ratio = geomean(r["tuned_over_rule"] for r in rows)
    worst = max((r["tuned_over_rule"] for r in rows), default=float("nan"))
    fastest = geomean(r["tuned_over_rule_fastest"] for r in rows)
    print(
        f"{len(rows)} kernels: tuned / rule geometric mean {ratio:.3f} (fastest windows {fastest:.3f}), "
        f"worst {worst:.3f}"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"kernels": rows, "geomean": ratio, "geomean_fastest": fastest, "worst": worst}, indent=1)
        )


if __name__ == "__main__":
    main()
