"""How repeatable a job's measurements are: the same point of the rules' space timed in several jobs.

    python benchmarks/measurement_noise.py C1 C2 C3 ... (cache folders of jobs of the same workload)

Reads every job's events files (`<cache>/<target>/events/*.jsonl`: each measured candidate's decisions and time,
`schedules/progress.py`) and keys each timing by its task and decisions. Prints, over the points measured in 3
or more jobs, the median |log| distance of a timing from the mean of the other jobs' timings of that point, raw
and relative to the rule's own timing in the same batch (which takes out what changed from job to job for
every candidate alike); the spread of those means between a task's points (what a ranking has to tell apart);
and an oracle's ranking: each job's batch scored by the other jobs' mean timing of the same points, pairwise
accuracy and top-2 recall as `relaxtune report tuning` computes them (`schedules/ranking.py`). No model can
agree with a batch's measurement much more often than another measurement of the same points does.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

NAMES = ("rows", "units", "pack_b", "k_unroll", "k_lanes", "cols")


def timings(folders: list[Path]) -> tuple[dict, list]:
    """({(task, decisions): [(job, log(us / rule's us in its batch), log us)]}, [(job, task, [(decisions, us)])])"""
    points, batches = defaultdict(list), []
    for job, folder in enumerate(folders):
        for path in sorted(folder.glob("*/events/*.jsonl")):
            for line in path.read_text().splitlines():
                event = json.loads(line)
                if event.get("ev") != "batch" or not event.get("decisions") or event["us"][0] is None:
                    continue
                rule, found = event["us"][0], []
                for us, chosen in zip(event["us"], event["decisions"]):
                    if us is None or chosen is None:
                        continue
                    key = (event["task"], tuple(chosen.get(n, 0) for n in NAMES))
                    points[key].append((job, np.log(us / rule), np.log(us)))
                    found.append((key, us))
                batches.append((job, found))
    return points, batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("caches", type=Path, nargs="+")
    args = parser.parse_args()
    from relaxtune.schedules.ranking import summarize

    points, batches = timings(args.caches)
    raw, relative, means = [], [], defaultdict(list)
    for (task, _), seen in points.items():
        if len({job for job, _, _ in seen}) < 3:
            continue
        means[task].append(np.mean([r for _, r, _ in seen]))
        for job, rel, log_us in seen:
            others = [(r, u) for j, r, u in seen if j != job]
            raw.append(abs(log_us - np.mean([u for _, u in others])))
            relative.append(abs(rel - np.mean([r for r, _ in others])))
    spread = [np.std(m) for m in means.values() if len(m) > 1]
    print(
        f"{len(raw)} timings of {sum(len(m) for m in means.values())} points measured in 3+ jobs: median |log| from "
        f"the other jobs' mean {np.median(raw):.3f} raw, {np.median(relative):.3f} relative to the batch's rule; "
        f"spread (std of log) of the points' means within a task: median {np.median(spread):.3f}"
    )
    held = []
    for job, found in batches:
        scores, costs = [], []
        for key, us in found:
            others = [u for j, _, u in points[key] if j != job]
            if others:
                scores.append(-float(np.mean(others)))
                costs.append(us)
        if len(costs) > 1:
            held.append({"scores": scores, "costs": costs})
    rank = summarize(held)
    print(
        f"oracle (the other jobs' mean timing of each point): pairwise accuracy {rank['pairwise_accuracy']:.3f} over "
        f"{rank['pairs']} pairs ({rank['pairwise_accuracy_beyond_noise']:.3f} over the {rank['pairs_beyond_noise']} "
        f"more than 3% apart) in {rank['batches']} batches, top-2 recall {rank['top2_recall']:.3f} (chance "
        f"{rank['top2_chance']:.3f})"
    )


if __name__ == "__main__":
    main()
